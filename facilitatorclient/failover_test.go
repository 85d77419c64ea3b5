package facilitatorclient

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/x402-gateway/caddy-x402/x402"
)

func TestFailoverUsesTheNextCompatibleMemberWhenTheFirstIsDown(t *testing.T) {
	calls := []struct {
		name string
		call func(fo *Failover) (string, error)
	}{
		{"verify", func(fo *Failover) (string, error) {
			resp, err := fo.Verify(context.Background(), permit2Request(mainnet))
			if err == nil && !resp.IsValid {
				err = fmt.Errorf("answer %+v is not valid", resp)
			}
			return "", err
		}},
		{"settle", func(fo *Failover) (string, error) {
			res, err := fo.SettleDetailed(context.Background(), permit2Request(mainnet))
			if err == nil && !res.Response.Success {
				err = fmt.Errorf("answer %+v is not a settlement", res.Response)
			}
			return res.Facilitator, err
		}},
	}
	for _, tt := range calls {
		t.Run(tt.name, func(t *testing.T) {
			// The first member answered /supported once and then went away a while ago: its kinds are cached,
			// its port is closed and the client has let go of the old connection, so the request surely never
			// reached it. (A request written into a connection the server had just closed may have reached
			// it: that is the "dropped after the body" case, which never fails over.)
			first := newFakeFacilitator(t, permit2Supported(mainnet))
			a := mustClient(t, first.URL())
			if _, err := a.Supported(context.Background()); err != nil {
				t.Fatal(err)
			}
			first.srv.Close()
			a.httpClient.CloseIdleConnections()
			second := newFakeFacilitator(t, permit2Supported(mainnet))
			fo := NewFailover(a, mustClient(t, second.URL()))

			by, err := tt.call(fo)
			if err != nil {
				t.Fatalf("want the second member's answer, got %v", err)
			}
			if n := second.verifyCalls.Load() + second.settleCalls.Load(); n != 1 {
				t.Fatalf("second member got %d requests, want 1", n)
			}
			if tt.name == "settle" && by != second.URL() {
				t.Fatalf("result names %s as the settling facilitator, want %s", by, second.URL())
			}
		})
	}
}

func TestFailoverNeverSendsAPermit2PaymentToAnERC2612OnlyMember(t *testing.T) {
	erc2612Only := newFakeFacilitator(t, erc2612Supported(walletA, mainnet, testnet))
	permit2Down := newFakeFacilitator(t, permit2Supported(mainnet))
	p := mustClient(t, permit2Down.URL())
	if _, err := p.Supported(context.Background()); err != nil {
		t.Fatal(err)
	}
	permit2Down.srv.Close()
	p.httpClient.CloseIdleConnections()
	// The erc2612 member comes first, and is up: it must still not be asked.
	fo := NewFailover(mustClient(t, erc2612Only.URL()), p)

	_, verifyErr := fo.Verify(context.Background(), permit2Request(mainnet))
	_, settleErr := fo.Settle(context.Background(), permit2Request(mainnet))
	for name, err := range map[string]error{"verify": verifyErr, "settle": settleErr} {
		fe := failureOf(t, err)
		if fe.Kind != x402.FailureUnreachable {
			t.Fatalf("%s: kind = %s, want unreachable (the only permit2 member is down): %v", name, fe.Kind, err)
		}
	}
	if n := erc2612Only.verifyCalls.Load() + erc2612Only.settleCalls.Load(); n != 0 {
		t.Fatalf("the erc2612-only member was sent %d permit2 requests, want none", n)
	}
	if !errors.Is(settleErr, ErrNotSent) {
		t.Fatalf("no member can have received the settlement, want ErrNotSent in %v", settleErr)
	}
}

func TestFailoverWithoutACompatibleMemberSaysWhatIsMissing(t *testing.T) {
	erc2612Only := newFakeFacilitator(t, erc2612Supported(walletA, mainnet))
	permit2Testnet := newFakeFacilitator(t, permit2Supported(testnet))
	fo := NewFailover(mustClient(t, erc2612Only.URL()), mustClient(t, permit2Testnet.URL()))

	tests := []struct {
		name string
		req  x402.VerifyRequest
		want string
	}{
		{"permit2 on mainnet", permit2Request(mainnet), `no facilitator supports permit2 on eip155:723487 (x402Version 2, scheme "exact")`},
		{"erc2612 on testnet", erc2612Request(testnet, walletA), `no facilitator supports erc2612 on eip155:72344 (x402Version 2, scheme "exact")`},
		{"permit2 in version 1", func() x402.VerifyRequest {
			r := permit2Request(testnet)
			r.X402Version, r.PaymentPayload.X402Version = 1, 1
			return r
		}(), `no facilitator supports permit2 on eip155:72344 (x402Version 1, scheme "exact")`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := fo.Verify(context.Background(), tt.req)
			fe := failureOf(t, err)
			if fe.Kind != x402.FailureRejected || fe.Op != "verify" {
				t.Fatalf("error = {op %s kind %s}, want {op verify kind rejected}: %v", fe.Op, fe.Kind, err)
			}
			if !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("error %q does not say %q", err, tt.want)
			}
			if !strings.Contains(err.Error(), erc2612Only.URL()+" offers exact/erc2612 on eip155:723487 v1") {
				t.Fatalf("error %q should say what each member offers", err)
			}
			_, err = fo.Settle(context.Background(), tt.req)
			if fe := failureOf(t, err); fe.Kind != x402.FailureRejected || fe.Op != "settle" {
				t.Fatalf("settle error = {op %s kind %s}, want {op settle kind rejected}: %v", fe.Op, fe.Kind, err)
			}
		})
	}
	if n := erc2612Only.verifyCalls.Load() + permit2Testnet.verifyCalls.Load() + erc2612Only.settleCalls.Load() + permit2Testnet.settleCalls.Load(); n != 0 {
		t.Fatalf("members were sent %d payments they do not support", n)
	}
}

func TestEmptyFailoverSaysNoFacilitatorIsConfigured(t *testing.T) {
	fo := NewFailover(nil, nil)
	_, err := fo.Verify(context.Background(), permit2Request(mainnet))
	if fe := failureOf(t, err); fe.Kind != x402.FailureRejected || !strings.Contains(err.Error(), "no facilitator configured") {
		t.Fatalf("error = %v, want rejected: no facilitator configured", err)
	}
	h, err := fo.Health(context.Background())
	if err != nil || h.Status != x402.HealthDown {
		t.Fatalf("health = %+v, %v; want down", h, err)
	}
}

func TestFailoverSettleStaysWithAMemberThePaymentMayHaveReached(t *testing.T) {
	rows := []struct {
		name   string
		settle func(w http.ResponseWriter, r *http.Request, body []byte)
	}{
		{"connection dropped after the body", func(w http.ResponseWriter, _ *http.Request, _ []byte) { dropConnection(w) }},
		{"500 without a body", func(w http.ResponseWriter, _ *http.Request, _ []byte) { writeRaw(w, 500, "") }},
		{"200 with garbage", func(w http.ResponseWriter, _ *http.Request, _ []byte) { writeRaw(w, 200, "ok") }},
	}
	for _, row := range rows {
		t.Run(row.name, func(t *testing.T) {
			first := newFakeFacilitator(t, permit2Supported(mainnet), func(f *fakeFacilitator) { f.settle = row.settle })
			second := newFakeFacilitator(t, permit2Supported(mainnet))
			fo := NewFailover(mustClient(t, first.URL()), mustClient(t, second.URL()))
			res, err := fo.SettleDetailed(context.Background(), permit2Request(mainnet))
			if !x402.IsUnreachable(err) {
				t.Fatalf("want an unreachable error from the first member, got %v", err)
			}
			if n := second.settleCalls.Load(); n != 0 {
				t.Fatalf("second member was sent %d settlements of a payment that may have settled at the first", n)
			}
			if res.Facilitator != first.URL() {
				t.Fatalf("result names %q, want the first member", res.Facilitator)
			}
		})
	}
}

func TestFailoverVerifyMovesOnAfterABadAnswerButNotAfterARefusal(t *testing.T) {
	rows := []struct {
		name       string
		verify     func(w http.ResponseWriter, r *http.Request, body []byte)
		wantSecond int64
		wantValid  bool
		wantErr    x402.FailureKind
	}{
		{"bad answer", func(w http.ResponseWriter, _ *http.Request, _ []byte) { writeRaw(w, 200, "<html/>") }, 1, true, ""},
		{"503", func(w http.ResponseWriter, _ *http.Request, _ []byte) { writeRaw(w, 503, "") }, 1, true, ""},
		{"refused payment", func(w http.ResponseWriter, _ *http.Request, _ []byte) {
			writeJSON(w, 200, x402.VerifyResponse{IsValid: false, InvalidReason: x402.ReasonInsufficientFunds, Payer: payer})
		}, 0, false, ""},
		{"401", func(w http.ResponseWriter, _ *http.Request, _ []byte) { writeRaw(w, 401, "") }, 0, false, x402.FailureRejected},
	}
	for _, row := range rows {
		t.Run(row.name, func(t *testing.T) {
			first := newFakeFacilitator(t, permit2Supported(mainnet), func(f *fakeFacilitator) { f.verify = row.verify })
			second := newFakeFacilitator(t, permit2Supported(mainnet))
			fo := NewFailover(mustClient(t, first.URL()), mustClient(t, second.URL()))
			resp, err := fo.Verify(context.Background(), permit2Request(mainnet))
			if row.wantErr != "" {
				if fe := failureOf(t, err); fe.Kind != row.wantErr {
					t.Fatalf("kind = %s, want %s", fe.Kind, row.wantErr)
				}
			} else if err != nil {
				t.Fatal(err)
			}
			if resp.IsValid != row.wantValid {
				t.Fatalf("isValid = %v, want %v", resp.IsValid, row.wantValid)
			}
			if n := second.verifyCalls.Load(); n != row.wantSecond {
				t.Fatalf("second member asked %d times, want %d", n, row.wantSecond)
			}
		})
	}
}

func TestFailoverSkipsAMemberWhoseSupportedFailedUntilItsRetryTime(t *testing.T) {
	clock := newTestClock()
	var down atomic.Bool
	down.Store(true)
	first := newFakeFacilitator(t, permit2Supported(mainnet), supportedDownWhile(&down))
	second := newFakeFacilitator(t, permit2Supported(mainnet))
	opts := []Option{WithClock(clock.Now), WithSupportedRetry(5 * time.Second), WithSupportedTTL(time.Hour)}
	a, b := mustClient(t, first.URL(), opts...), mustClient(t, second.URL(), opts...)
	fo := NewFailover(a, b)
	ctx := context.Background()

	// The counts are totals so far: /supported requests the first member saw, and payments each verified.
	steps := []struct {
		advance                   time.Duration
		recover                   bool
		firstAsked, first, second int64
	}{
		{0, false, 1, 0, 1},               // nothing known: both asked, the first fails and the second takes it
		{4 * time.Second, false, 1, 0, 2}, // inside the retry time: not even asked
		{time.Second, false, 2, 0, 3},     // retry time reached: asked aside, still down
		{time.Second, true, 2, 0, 4},      // up again, but its retry time has not come
		{4 * time.Second, false, 3, 0, 5}, // asked aside and answers; this payment already went to the second
		{time.Minute, false, 3, 1, 5},     // known again: first in order, so it takes the payment
		{time.Minute, false, 3, 2, 5},     // and its answer stays cached for the TTL
	}
	for i, s := range steps {
		clock.Advance(s.advance)
		if s.recover {
			down.Store(false)
		}
		if _, err := fo.Verify(ctx, permit2Request(mainnet)); err != nil {
			t.Fatalf("step %d: %v", i, err)
		}
		waitForFetches(t, a, b)
		if got := first.supportedCalls.Load(); got != s.firstAsked {
			t.Fatalf("step %d: first member's /supported asked %d times, want %d", i, got, s.firstAsked)
		}
		if got1, got2 := first.verifyCalls.Load(), second.verifyCalls.Load(); got1 != s.first || got2 != s.second {
			t.Fatalf("step %d: verifications first %d second %d, want %d and %d", i, got1, got2, s.first, s.second)
		}
	}
}

func TestFailoverChecksAMemberThatFailedAsideAndPrefersItOnceItAnswers(t *testing.T) {
	clock := newTestClock()
	var drop atomic.Bool
	drop.Store(true)
	first := newFakeFacilitator(t, permit2Supported(mainnet), func(f *fakeFacilitator) {
		f.verify = func(w http.ResponseWriter, _ *http.Request, _ []byte) {
			if drop.Load() {
				dropConnection(w)
				return
			}
			writeJSON(w, http.StatusOK, x402.VerifyResponse{IsValid: true, Payer: payer})
		}
	})
	second := newFakeFacilitator(t, permit2Supported(mainnet))
	opts := []Option{WithClock(clock.Now), WithSupportedTTL(time.Hour), WithRetries(0, 0)}
	a, b := mustClient(t, first.URL(), opts...), mustClient(t, second.URL(), opts...)
	fo := NewFailover(a, b)
	ctx := context.Background()

	// The counts are totals so far: /supported requests the first member saw, and verifications each saw.
	steps := []struct {
		drop                      bool
		firstAsked, first, second int64
	}{
		{true, 1, 1, 1},  // the first drops the verification, the second answers
		{false, 2, 1, 2}, // within its TTL the first's /supported is asked again, aside; the second answers
		{false, 2, 2, 2}, // the first answered /supported, so it is first again
	}
	for i, s := range steps {
		drop.Store(s.drop)
		if _, err := fo.Verify(ctx, permit2Request(mainnet)); err != nil {
			t.Fatalf("step %d: %v", i, err)
		}
		waitForFetches(t, a, b)
		if got := first.supportedCalls.Load(); got != s.firstAsked {
			t.Fatalf("step %d: first /supported asked %d times, want %d", i, got, s.firstAsked)
		}
		if got1, got2 := first.verifyCalls.Load(), second.verifyCalls.Load(); got1 != s.first || got2 != s.second {
			t.Fatalf("step %d: verifications first %d second %d, want %d and %d", i, got1, got2, s.first, s.second)
		}
	}
}

func TestFailoverStopsUsingAMemberWhoseSupportedRefreshFailed(t *testing.T) {
	clock := newTestClock()
	var down atomic.Bool
	first := newFakeFacilitator(t, permit2Supported(mainnet), supportedDownWhile(&down))
	second := newFakeFacilitator(t, permit2Supported(mainnet))
	opts := []Option{WithClock(clock.Now), WithSupportedTTL(time.Minute), WithSupportedRetry(time.Hour)}
	a, b := mustClient(t, first.URL(), opts...), mustClient(t, second.URL(), opts...)
	fo := NewFailover(a, b)
	ctx := context.Background()

	// The counts are totals so far: verifications each member saw.
	steps := []struct {
		advance       time.Duration
		down          bool
		first, second int64
	}{
		{0, false, 1, 0},           // both known, the first takes it
		{time.Minute, true, 2, 0},  // past the TTL: the first still takes it while its /supported is asked aside, and fails
		{time.Second, true, 2, 1},  // the failed refresh took the first out
		{time.Minute, false, 2, 2}, // and keeps it out until its retry time, though it would answer now
	}
	for i, s := range steps {
		clock.Advance(s.advance)
		down.Store(s.down)
		if _, err := fo.Verify(ctx, permit2Request(mainnet)); err != nil {
			t.Fatalf("step %d: %v", i, err)
		}
		waitForFetches(t, a, b)
		if got1, got2 := first.verifyCalls.Load(), second.verifyCalls.Load(); got1 != s.first || got2 != s.second {
			t.Fatalf("step %d: verifications first %d second %d, want %d and %d", i, got1, got2, s.first, s.second)
		}
	}
}

func TestFailoverDoesNotWaitForASickMembersSupportedWhileAnotherIsKnown(t *testing.T) {
	release := make(chan struct{})
	defer close(release)
	var hang atomic.Bool
	first := newFakeFacilitator(t, permit2Supported(mainnet), func(f *fakeFacilitator) {
		f.supported = func(w http.ResponseWriter, r *http.Request) {
			if hang.Load() {
				select {
				case <-release:
				case <-r.Context().Done():
				}
				return
			}
			writeJSON(w, http.StatusOK, permit2Supported(mainnet))
		}
		f.verify = func(w http.ResponseWriter, _ *http.Request, _ []byte) { writeRaw(w, 503, "") }
	})
	second := newFakeFacilitator(t, permit2Supported(mainnet))
	a, b := mustClient(t, first.URL()), mustClient(t, second.URL())
	fo := NewFailover(a, b)
	ctx := context.Background()
	if _, err := fo.Verify(ctx, permit2Request(mainnet)); err != nil {
		t.Fatal(err) // the first answers 503, the second takes it; the first is now invalidated
	}
	hang.Store(true)
	start := time.Now()
	if _, err := fo.Verify(ctx, permit2Request(mainnet)); err != nil {
		t.Fatal(err)
	}
	if elapsed := time.Since(start); elapsed > time.Second {
		t.Fatalf("the payment waited %s for the sick member's /supported", elapsed)
	}
	if n := second.verifyCalls.Load(); n != 2 {
		t.Fatalf("second member verified %d payments, want 2", n)
	}
}

func TestFailoverAbandonedSupportedFetchDoesNotMarkTheMemberDown(t *testing.T) {
	var hang atomic.Bool
	hang.Store(true)
	f := newFakeFacilitator(t, permit2Supported(mainnet), func(f *fakeFacilitator) {
		f.supported = func(w http.ResponseWriter, r *http.Request) {
			if hang.Load() {
				waitForClient(r)
				return
			}
			writeJSON(w, http.StatusOK, permit2Supported(mainnet))
		}
	})
	fo := NewFailover(mustClient(t, f.URL(), WithSupportedRetry(time.Hour)))
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	if _, err := fo.Verify(ctx, permit2Request(mainnet)); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("want the caller's deadline, got %v", err)
	}
	hang.Store(false)
	// Give the cancelled fetch time to finish; its failure must not put the member in its retry time.
	for f.supportedCalls.Load() < 1 {
		time.Sleep(time.Millisecond)
	}
	time.Sleep(20 * time.Millisecond)
	if _, err := fo.Verify(context.Background(), permit2Request(mainnet)); err != nil {
		t.Fatalf("the member must be asked again, got %v", err)
	}
}

// waitForFetches blocks until no /supported fetch of the clients is in flight.
func waitForFetches(t *testing.T, clients ...*Client) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for _, c := range clients {
		for {
			c.supported.mu.Lock()
			busy := c.supported.inflight != nil
			c.supported.mu.Unlock()
			if !busy {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("a /supported fetch of %s is still running", c)
			}
			time.Sleep(time.Millisecond)
		}
	}
}

func TestFailoverSupportedMergesTheMembers(t *testing.T) {
	p := permit2Supported(mainnet, testnet)
	p.Signers = map[string][]string{"eip155:*": {walletA}}
	e := erc2612Supported(strings.ToLower(walletA), mainnet)
	e.Signers["eip155:*"] = append(e.Signers["eip155:*"], walletB)
	e.Extensions = []string{x402.ExtensionEIP2612GasSponsoring, "bazaar"}
	a := newFakeFacilitator(t, p)
	b := newFakeFacilitator(t, e)
	dup := newFakeFacilitator(t, p)
	fo := NewFailover(mustClient(t, a.URL()), mustClient(t, b.URL()), mustClient(t, dup.URL()), mustClient(t, closedURL(t)))

	got, err := fo.Supported(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	wantKinds := append(slices.Clone(p.Kinds), e.Kinds...)
	if fmt.Sprint(got.Kinds) != fmt.Sprint(wantKinds) {
		t.Fatalf("kinds = %v\nwant %v", got.Kinds, wantKinds)
	}
	if want := []string{x402.ExtensionEIP2612GasSponsoring, "bazaar"}; !slices.Equal(got.Extensions, want) {
		t.Fatalf("extensions = %v, want %v", got.Extensions, want)
	}
	if want := []string{walletA, walletB}; !slices.Equal(got.Signers["eip155:*"], want) {
		t.Fatalf("signers = %v, want %v (addresses compared without case)", got.Signers, want)
	}
}

func TestFailoverSupportedFailsOnlyWhenNoMemberAnswers(t *testing.T) {
	fo := NewFailover(mustClient(t, closedURL(t)), mustClient(t, closedURL(t)))
	_, err := fo.Supported(context.Background())
	if fe := failureOf(t, err); fe.Kind != x402.FailureUnreachable {
		t.Fatalf("kind = %s, want unreachable: %v", fe.Kind, err)
	}
	if !errors.Is(err, ErrNotSent) {
		t.Fatalf("the members' errors should stay reachable through the joined error, got %v", err)
	}
}

func TestFailoverRoutesAnERC2612PaymentToTheOwnerOfItsSpender(t *testing.T) {
	a := newFakeFacilitator(t, erc2612Supported(walletA, mainnet))
	b := newFakeFacilitator(t, erc2612Supported(walletB, mainnet))
	fo := NewFailover(mustClient(t, a.URL()), mustClient(t, b.URL()))
	ctx := context.Background()

	if _, err := fo.Settle(ctx, erc2612Request(mainnet, strings.ToLower(walletB))); err != nil {
		t.Fatal(err)
	}
	if a.settleCalls.Load() != 0 || b.settleCalls.Load() != 1 {
		t.Fatalf("settlements a=%d b=%d, want only b, the owner of the spender", a.settleCalls.Load(), b.settleCalls.Load())
	}
	_, err := fo.Verify(ctx, erc2612Request(mainnet, "0x1111111111111111111111111111111111111111"))
	if fe := failureOf(t, err); fe.Kind != x402.FailureRejected || !strings.Contains(err.Error(), "does not own the permit's spender") {
		t.Fatalf("a spender nobody owns should be refused as such, got %v", err)
	}
}

// TestFailoverRoutesAnUptoPaymentToTheOwnerOfItsWitnessFacilitator: members sharing a journal each list only the
// wallets they hold; an upto payment, which only the wallet its witness names can settle, goes to that wallet's
// owner, and one naming a wallet no member owns is refused as such.
func TestFailoverRoutesAnUptoPaymentToTheOwnerOfItsWitnessFacilitator(t *testing.T) {
	uptoSupported := func(wallet string) x402.SupportedResponse {
		return x402.SupportedResponse{Extensions: []string{}, Signers: map[string][]string{mainnet: {wallet}},
			Kinds: []x402.SupportedKind{{X402Version: 2, Scheme: x402.SchemeUpto, Network: mainnet,
				Extra: x402.Extra{AssetTransferMethod: x402.TransferPermit2, FacilitatorAddress: wallet}}}}
	}
	upto := func(facilitator string) x402.VerifyRequest {
		req := permit2Request(mainnet)
		req.PaymentRequirements.Scheme, req.PaymentPayload.Accepted.Scheme = x402.SchemeUpto, x402.SchemeUpto
		req.PaymentPayload.Payload.Permit2Authorization.Witness.Facilitator = facilitator
		return req
	}
	a := newFakeFacilitator(t, uptoSupported(walletA))
	b := newFakeFacilitator(t, uptoSupported(walletB))
	fo := NewFailover(mustClient(t, a.URL()), mustClient(t, b.URL()))
	ctx := context.Background()
	if _, err := fo.Settle(ctx, upto(strings.ToLower(walletB))); err != nil {
		t.Fatal(err)
	}
	if a.settleCalls.Load() != 0 || b.settleCalls.Load() != 1 {
		t.Fatalf("settlements a=%d b=%d, want only b, the owner of the witness's facilitator", a.settleCalls.Load(), b.settleCalls.Load())
	}
	_, err := fo.Verify(ctx, upto("0x1111111111111111111111111111111111111111"))
	if fe := failureOf(t, err); fe.Kind != x402.FailureRejected || !strings.Contains(err.Error(), "does not own the upto witness's facilitator") {
		t.Fatalf("a witness facilitator nobody owns should be refused as such, got %v", err)
	}
}

func TestFailoverHealthSumsUpTheMembers(t *testing.T) {
	ok := func(network string) *fakeFacilitator {
		return newFakeFacilitator(t, permit2Supported(network), func(f *fakeFacilitator) {
			f.health = func(w http.ResponseWriter, _ *http.Request) {
				writeJSON(w, 200, x402.HealthResponse{Status: x402.HealthOK, Networks: []x402.NetworkHealth{{Network: network, Status: x402.HealthOK, RPCReachable: true}}})
			}
		})
	}
	down := newFakeFacilitator(t, permit2Supported(mainnet), func(f *fakeFacilitator) {
		f.health = func(w http.ResponseWriter, _ *http.Request) {
			writeJSON(w, 503, x402.HealthResponse{Status: x402.HealthDown, Networks: []x402.NetworkHealth{{Network: mainnet, Status: x402.HealthDown, Error: "rpc unreachable"}}})
		}
	})
	up := ok(mainnet)
	tests := []struct {
		name        string
		members     []*Client
		wantStatus  string
		wantMainnet string
	}{
		{"all ok", []*Client{mustClient(t, up.URL()), mustClient(t, ok(testnet).URL())}, x402.HealthOK, x402.HealthOK},
		{"one down, one ok", []*Client{mustClient(t, down.URL()), mustClient(t, up.URL())}, x402.HealthDegraded, x402.HealthOK},
		{"one unreachable, one ok", []*Client{mustClient(t, closedURL(t)), mustClient(t, up.URL())}, x402.HealthDegraded, x402.HealthOK},
		{"one down, one unreachable", []*Client{mustClient(t, down.URL()), mustClient(t, closedURL(t))}, x402.HealthDown, x402.HealthDown},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			fo := NewFailover(tt.members...)
			h, err := fo.Health(context.Background())
			if err != nil {
				t.Fatal(err)
			}
			if h.Status != tt.wantStatus {
				t.Fatalf("status = %s, want %s", h.Status, tt.wantStatus)
			}
			i := slices.IndexFunc(h.Networks, func(n x402.NetworkHealth) bool { return n.Network == mainnet })
			if i < 0 || h.Networks[i].Status != tt.wantMainnet {
				t.Fatalf("networks = %+v, want %s %s", h.Networks, mainnet, tt.wantMainnet)
			}
			members := fo.HealthByMember(context.Background())
			if len(members) != len(tt.members) {
				t.Fatalf("member health has %d entries, want %d", len(members), len(tt.members))
			}
			for j, m := range members {
				if m.Facilitator != tt.members[j].BaseURL() {
					t.Fatalf("member %d is %s, want %s", j, m.Facilitator, tt.members[j].BaseURL())
				}
			}
		})
	}
	_, err := NewFailover(mustClient(t, closedURL(t))).Health(context.Background())
	if fe := failureOf(t, err); fe.Kind != x402.FailureUnreachable {
		t.Fatalf("no member answering is unreachable, got %v", err)
	}
}

func TestFailoverUnderConcurrentLoad(t *testing.T) {
	clock := newTestClock()
	var flaky atomic.Int64
	first := newFakeFacilitator(t, permit2Supported(mainnet), func(f *fakeFacilitator) {
		f.verify = func(w http.ResponseWriter, _ *http.Request, _ []byte) {
			if flaky.Add(1)%3 == 0 {
				dropConnection(w)
				return
			}
			writeJSON(w, http.StatusOK, x402.VerifyResponse{IsValid: true, Payer: payer})
		}
	})
	second := newFakeFacilitator(t, erc2612Supported(walletB, mainnet))
	third := newFakeFacilitator(t, permit2Supported(mainnet))
	opts := []Option{WithClock(clock.Now), WithSupportedTTL(time.Second), WithRetries(0, 0)}
	fo := NewFailover(mustClient(t, first.URL(), opts...), mustClient(t, second.URL(), opts...), mustClient(t, third.URL(), opts...))

	const workers, rounds = 32, 25
	var wg sync.WaitGroup
	errs := make(chan error, workers*rounds)
	for w := range workers {
		wg.Go(func() {
			ctx := context.Background()
			for i := range rounds {
				var err error
				switch (w + i) % 5 {
				case 0:
					var r x402.VerifyResponse
					if r, err = fo.Verify(ctx, permit2Request(mainnet)); err == nil && !r.IsValid {
						err = errors.New("permit2 verify not valid")
					}
				case 1:
					var r x402.SettleResponse
					if r, err = fo.Settle(ctx, permit2Request(mainnet)); err == nil && r.Transaction != txHash {
						err = fmt.Errorf("permit2 settle transaction %q", r.Transaction)
					}
				case 2:
					_, err = fo.Settle(ctx, erc2612Request(mainnet, walletB))
				case 3:
					var s x402.SupportedResponse
					if s, err = fo.Supported(ctx); err == nil {
						s.Kinds[0].Network = "scribbled" // callers own their copy
					}
				case 4:
					_, err = fo.Health(ctx)
					clock.Advance(300 * time.Millisecond)
				}
				if err != nil {
					errs <- err
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	if v, st := second.verifyCalls.Load(), second.settleCalls.Load(); v != 0 || st != workers*rounds/5 {
		t.Fatalf("the erc2612-only member got %d verify and %d settle, want 0 and exactly the %d erc2612 settlements",
			v, st, workers*rounds/5)
	}
	if third.verifyCalls.Load() == 0 {
		t.Fatal("the dropped verifications of the first member should have failed over to the third")
	}
	if s, _ := fo.Supported(context.Background()); s.Kinds[0].Network != mainnet {
		t.Fatalf("the cache was modified through a returned copy: %+v", s.Kinds[0])
	}
}

// A member that answers no_available_wallets sent nothing: the payment is not kept with it, and the next
// compatible member is asked, in the same call and when the payment is presented again. With no other member
// that can take it, the answer is the member's, and the payment stays free to go to whichever member has a
// wallet when presented again. A payment whose earlier /settle may have reached the member stays with it,
// whatever it answers now.
func TestFailoverMovesOnFromAMemberThatSentNothingForWantOfAWallet(t *testing.T) {
	noWallet := func(w http.ResponseWriter, _ *http.Request, _ []byte) {
		writeJSON(w, http.StatusOK, x402.SettleResponse{Success: false, ErrorReason: x402.ReasonNoAvailableWallets,
			ErrorMessage: x402.MessageNoAvailableWallets, Network: mainnet, Payer: payer})
	}
	ctx := context.Background()
	t.Run("another member has a wallet", func(t *testing.T) {
		a := newFakeFacilitator(t, permit2Supported(mainnet), func(f *fakeFacilitator) { f.settle = noWallet })
		b := newFakeFacilitator(t, permit2Supported(mainnet))
		fo := NewFailover(mustClient(t, a.URL()), mustClient(t, b.URL()))
		req := permit2Request(mainnet)
		req.PaymentPayload.Payload.Permit2Authorization.Deadline = strconv.FormatInt(time.Now().Add(time.Minute).Unix(), 10)
		for range 2 {
			res, err := fo.SettleDetailed(ctx, req)
			if err != nil || !res.Response.Success || res.Facilitator != b.URL() {
				t.Fatalf("settled = %+v, %v; want B's settlement", res, err)
			}
		}
		if a.settleCalls.Load() != 1 || b.settleCalls.Load() != 2 {
			t.Errorf("settlements a=%d b=%d; want A asked once, then the payment kept with B, which settled it", a.settleCalls.Load(), b.settleCalls.Load())
		}
	})
	t.Run("no other member can take it", func(t *testing.T) {
		a := newFakeFacilitator(t, erc2612Supported(walletA, mainnet), func(f *fakeFacilitator) { f.settle = noWallet })
		b := newFakeFacilitator(t, erc2612Supported(walletB, mainnet))
		fo := NewFailover(mustClient(t, a.URL()), mustClient(t, b.URL()))
		req := erc2612Request(mainnet, walletA)
		req.PaymentPayload.Payload.Authorization.ValidBefore = strconv.FormatInt(time.Now().Add(time.Minute).Unix(), 10)
		res, err := fo.SettleDetailed(ctx, req)
		if err != nil || res.Response.ErrorReason != x402.ReasonNoAvailableWallets || res.Facilitator != a.URL() {
			t.Fatalf("settled = %+v, %v; want A's no_available_wallets", res, err)
		}
		if got := fo.stickyMember(stickyKey(req)); got != nil || b.settleCalls.Load() != 0 {
			t.Errorf("the payment is kept with %v, B asked %d times; want it kept with nobody, B (not its spender's owner) never asked",
				got, b.settleCalls.Load())
		}
	})
	t.Run("its earlier settlement may have reached the member", func(t *testing.T) {
		var lost atomic.Bool
		lost.Store(true)
		a := newFakeFacilitator(t, permit2Supported(mainnet), func(f *fakeFacilitator) {
			f.settle = func(w http.ResponseWriter, r *http.Request, body []byte) {
				if lost.Load() {
					dropConnection(w)
					return
				}
				noWallet(w, r, body)
			}
		})
		b := newFakeFacilitator(t, permit2Supported(mainnet))
		fo := NewFailover(mustClient(t, a.URL()), mustClient(t, b.URL()))
		req := permit2Request(mainnet)
		req.PaymentPayload.Payload.Permit2Authorization.Deadline = strconv.FormatInt(time.Now().Add(time.Minute).Unix(), 10)
		if _, err := fo.Settle(ctx, req); !x402.IsUnreachable(err) {
			t.Fatalf("first settlement, A's answer lost: %v; want unreachable", err)
		}
		lost.Store(false)
		for range 2 {
			if res, err := fo.SettleDetailed(ctx, req); err != nil || res.Response.ErrorReason != x402.ReasonNoAvailableWallets || res.Facilitator != a.URL() {
				t.Fatalf("presented again = %+v, %v; want A's no_available_wallets", res, err)
			}
		}
		if b.settleCalls.Load() != 0 {
			t.Errorf("B was asked to settle %d times a payment that may have settled at A; want never", b.settleCalls.Load())
		}
	})
}

// refusing is a /settle that refuses every payment for reason, naming no transaction.
func refusing(reason string) func(*fakeFacilitator) {
	return func(f *fakeFacilitator) {
		f.settle = func(w http.ResponseWriter, r *http.Request, body []byte) {
			var req x402.SettleRequest
			_ = json.Unmarshal(body, &req)
			writeJSON(w, http.StatusOK, x402.SettleResponse{Success: false, Network: req.PaymentRequirements.Network,
				Payer: payer, ErrorReason: reason, ErrorMessage: "refused: " + reason})
		}
	}
}

// The memory of which member a payment's /settle was sent to is the process's: a gateway that restarts, or
// another gateway of a cluster, routes a payment that the second member settled (its answer lost) to the first,
// which never saw it and refuses it for its spent nonce (or, past the deadline, its expired authorization). The
// other members are asked then, and the one whose journal knows the payment answers for it. A refusal for
// another reason is the answer, and nobody else is asked; nor does a member that refuses too change it.
func TestFailoverAsksTheOtherMembersWhenOneFindsThePaymentsNonceSpent(t *testing.T) {
	tests := []struct {
		name      string
		aReason   string
		b         func(*fakeFacilitator) // B's /settle; nil: B settled the payment and answers success
		sticky    bool                   // the payment was sent to A before, in this process
		wantB     int64                  // /settle calls B gets
		wantOK    bool                   // B's success is the answer
		wantFirst string                 // else the answer's reason
	}{
		{name: "permit2 nonce spent", aReason: x402.ReasonPermit2InvalidNonce, wantB: 1, wantOK: true},
		{name: "eip3009 or erc2612 nonce used", aReason: x402.ReasonNonceAlreadyUsed, wantB: 1, wantOK: true},
		{name: "permit2 deadline passed", aReason: x402.ReasonPermit2DeadlineExpired, wantB: 1, wantOK: true},
		{name: "remembered with A, which refuses it", aReason: x402.ReasonPermit2InvalidNonce, sticky: true, wantB: 1, wantOK: true},
		{name: "B refuses it too", aReason: x402.ReasonPermit2InvalidNonce, b: refusing(x402.ReasonPermit2InvalidNonce), wantB: 1,
			wantFirst: x402.ReasonPermit2InvalidNonce},
		{name: "B does not answer", aReason: x402.ReasonPermit2InvalidNonce, b: func(f *fakeFacilitator) {
			f.settle = func(w http.ResponseWriter, _ *http.Request, _ []byte) { dropConnection(w) }
		}, wantB: 1, wantFirst: x402.ReasonPermit2InvalidNonce},
		{name: "insufficient funds", aReason: x402.ReasonPermit2InsufficientBalance, wantB: 0, wantFirst: x402.ReasonPermit2InsufficientBalance},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			a := newFakeFacilitator(t, permit2Supported(mainnet), refusing(tt.aReason))
			var setup []func(*fakeFacilitator)
			if tt.b != nil {
				setup = append(setup, tt.b)
			}
			b := newFakeFacilitator(t, permit2Supported(mainnet), setup...)
			fo := NewFailover(mustClient(t, a.URL()), mustClient(t, b.URL()))
			fo.now = newTestClock().Now // before the fixture's deadline
			req := permit2Request(mainnet)
			if tt.sticky {
				now := fo.now()
				fo.sticky.put(stickyKey(req), a.URL(), stickyUntil(req, now), now)
			}

			res, err := fo.SettleDetailed(context.Background(), req)
			if err != nil {
				t.Fatalf("settle: %v", err)
			}
			if n := b.settleCalls.Load(); n != tt.wantB {
				t.Errorf("B was asked to settle %d times; want %d", n, tt.wantB)
			}
			if n := a.settleCalls.Load(); n != 1 {
				t.Errorf("A was asked to settle %d times; want once", n)
			}
			if tt.wantOK {
				if !res.Response.Success || res.Facilitator != b.URL() {
					t.Fatalf("answer %+v from %s; want B's settlement", res.Response, res.Facilitator)
				}
				// Presented again, it goes to B, whose journal knows it, and to nobody else.
				if _, err := fo.SettleDetailed(context.Background(), req); err != nil {
					t.Fatal(err)
				}
				if na, nb := a.settleCalls.Load(), b.settleCalls.Load(); na != 1 || nb != 2 {
					t.Errorf("presented again: A asked %d times, B %d; want 1 and 2 (B alone the second time)", na, nb)
				}
				return
			}
			if res.Response.Success || res.Response.ErrorReason != tt.wantFirst || res.Facilitator != a.URL() {
				t.Fatalf("answer %+v from %s; want A's refusal %s", res.Response, res.Facilitator, tt.wantFirst)
			}
		})
	}
}

// A member that answers it sent nothing (an x402_facilitator whose chain refused the transaction: 503, "sent":
// false) did not settle the payment: the next member is asked, and the payment is kept with the one that settles
// it. Every member saying so is an error that says nothing was sent.
func TestFailoverMovesOnFromAMemberThatSaysItSentNothing(t *testing.T) {
	sentNothing := func(w http.ResponseWriter, _ *http.Request, _ []byte) {
		writeRaw(w, http.StatusServiceUnavailable, `{"error":"node refused the settlement transaction; nothing was sent","sent":false}`)
	}
	ctx := context.Background()
	req := permit2Request(mainnet)
	req.PaymentPayload.Payload.Permit2Authorization.Deadline = strconv.FormatInt(time.Now().Add(time.Minute).Unix(), 10)
	t.Run("another member settles it", func(t *testing.T) {
		a := newFakeFacilitator(t, permit2Supported(mainnet), func(f *fakeFacilitator) { f.settle = sentNothing })
		b := newFakeFacilitator(t, permit2Supported(mainnet))
		fo := NewFailover(mustClient(t, a.URL()), mustClient(t, b.URL()))
		for range 2 {
			if res, err := fo.SettleDetailed(ctx, req); err != nil || !res.Response.Success || res.Facilitator != b.URL() {
				t.Fatalf("settled = %+v, %v; want B's settlement", res, err)
			}
		}
		if a.settleCalls.Load() != 1 || b.settleCalls.Load() != 2 {
			t.Errorf("settlements a=%d b=%d; want A asked once, then the payment kept with B", a.settleCalls.Load(), b.settleCalls.Load())
		}
	})
	t.Run("every member sent nothing", func(t *testing.T) {
		a := newFakeFacilitator(t, permit2Supported(mainnet), func(f *fakeFacilitator) { f.settle = sentNothing })
		b := newFakeFacilitator(t, permit2Supported(mainnet), func(f *fakeFacilitator) { f.settle = sentNothing })
		fo := NewFailover(mustClient(t, a.URL()), mustClient(t, b.URL()))
		_, err := fo.SettleDetailed(ctx, req)
		if !errors.Is(err, ErrNotSent) || !x402.IsUnreachable(err) {
			t.Fatalf("settled: %v; want unreachable, nothing sent", err)
		}
		if got := fo.stickyMember(stickyKey(req)); got != nil {
			t.Errorf("the payment is kept with %v; want nobody, nothing of it was sent", got)
		}
	})
}
