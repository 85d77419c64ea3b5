package gate_test

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"io"
	"math/big"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ethereum/go-ethereum/accounts"
	"github.com/ethereum/go-ethereum/common/hexutil"
	"github.com/ethereum/go-ethereum/crypto"

	"github.com/x402-gateway/caddy-x402/chain/chaintest"
	"github.com/x402-gateway/caddy-x402/chain/contracts"
	"github.com/x402-gateway/caddy-x402/chain/journal"
	"github.com/x402-gateway/caddy-x402/gate"
	"github.com/x402-gateway/caddy-x402/x402"
)

// shiftClock is a gate clock the test moves ahead.
type shiftClock struct{ ahead atomic.Int64 }

func (c *shiftClock) now() time.Time          { return time.Now().Add(time.Duration(c.ahead.Load())) }
func (c *shiftClock) advance(d time.Duration) { c.ahead.Add(int64(d)) }

// challenge is the sign-in-with-x declaration of the gate's 402 for the resource.
func (e *env) challenge() x402.SignInWithXDeclaration {
	e.t.Helper()
	a := e.get()
	pr, err := x402.DecodePaymentRequired(a.header.Get(x402.HeaderPaymentRequired))
	if err != nil {
		e.t.Fatalf("decoding PAYMENT-REQUIRED of %d %q: %v", a.status, a.body, err)
	}
	var decl x402.SignInWithXDeclaration
	if err := json.Unmarshal(pr.Extensions[x402.ExtensionSignInWithX], &decl); err != nil || len(decl.SupportedChains) == 0 {
		e.t.Fatalf("the 402 declares sign-in-with-x as %s (%v), want a challenge", pr.Extensions[x402.ExtensionSignInWithX], err)
	}
	return decl
}

// signInAs answers a challenge as signer, in the name of address (signer's own where ""), after edit changes the
// fields signed, as the SDK's client does (createSIWxPayload): the header value.
func signInAs(t *testing.T, decl x402.SignInWithXDeclaration, signer *chaintest.Account, edit func(*x402.SignInWithX)) string {
	t.Helper()
	info := decl.Info
	s := x402.SignInWithX{Domain: info.Domain, Address: signer.Address.Hex(), URI: info.URI, Version: info.Version,
		ChainID: decl.SupportedChains[0].ChainID, Type: decl.SupportedChains[0].Type, Nonce: info.Nonce, IssuedAt: info.IssuedAt,
		ExpirationTime: info.ExpirationTime, Resources: info.Resources}
	if edit != nil {
		edit(&s)
	}
	msg, err := s.Message(s.Address)
	if err != nil {
		t.Fatal(err)
	}
	sig, err := crypto.Sign(accounts.TextHash([]byte(msg)), signer.Key)
	if err != nil {
		t.Fatal(err)
	}
	sig[64] += 27
	if s.Signature == "" {
		s.Signature = hexutil.Encode(sig)
	}
	h, err := x402.EncodeSignInWithX(s)
	if err != nil {
		t.Fatal(err)
	}
	return h
}

// signIn asks the gate for a challenge and answers it as payer.
func (e *env) signIn(payer *chaintest.Account) answer {
	e.t.Helper()
	return e.get(x402.HeaderSignInWithX, signInAs(e.t, e.challenge(), payer, nil))
}

// settlementTxs is how many transactions the engine's wallets have sent.
func settlementTxs(c *chaintest.Chain) uint64 {
	var n uint64
	for _, w := range c.Wallets {
		n += c.TxCount(w.Address)
	}
	return n
}

// refusedSignIn fails the test unless a is the gate's 402 naming reason, with a challenge to answer again.
func refusedSignIn(t *testing.T, a answer, reason string) {
	t.Helper()
	if a.status != http.StatusPaymentRequired {
		t.Fatalf("sign-in = %d %q, want 402 naming %s", a.status, a.body, reason)
	}
	pr, err := x402.DecodePaymentRequired(a.header.Get(x402.HeaderPaymentRequired))
	if err != nil || !strings.Contains(pr.Error, reason) || pr.Extensions[x402.ExtensionSignInWithX] == nil || len(pr.Accepts) == 0 {
		t.Fatalf("the refusal says %q with extensions %s (%v), want it to name %s, a fresh challenge and what to pay", pr.Error, pr.Extensions, err, reason)
	}
}

func TestAGateWithAccessServesAPayerThatPaidBySignatureAloneWithinTheGrant(t *testing.T) {
	clock := &shiftClock{}
	access := &gate.Access{For: time.Hour, Requests: 100}
	gws := gateways(t, setup{config: func(c *gate.Config) { c.Access, c.Now = access, clock.now }}, 2)
	payer := gws[0].c.Payers[0]

	refusedSignIn(t, gws[0].signIn(payer), x402.SignInWithXNoGrant)
	before, txs := gws[0].balances(payer), settlementTxs(gws[0].c)
	if a := gws[0].get(x402.HeaderPaymentSignature, gws[0].permit2(payer)); a.status != http.StatusOK {
		t.Fatalf("the payment = %d %q, want 200", a.status, a.body)
	}
	if lost, gained := gws[0].paid(payer, before); lost.Int64() != price || gained.Int64() != price {
		t.Fatalf("the payer lost %s and the seller gained %s, want %d", lost, gained, price)
	}
	txs++
	// 100 requests by signature alone: half at each gateway of the cluster, the last 40 after the second
	// gateway's gate was made anew on its journal (a restart of the gate), with no transaction sent.
	for i := 0; i < 100; i++ {
		gw := gws[i%2]
		if i == 60 {
			gws[1].startGate()
		}
		if a := gw.signIn(payer); a.status != http.StatusOK || a.body != "paid content" {
			t.Fatalf("sign-in %d at gateway %d = %d %q, want the resource", i, i%2, a.status, a.body)
		}
	}
	if got := gws[0].served.Load() + gws[1].served.Load(); got != 101 {
		t.Errorf("the upstreams ran %d times, want 101 (one paid, 100 signed in)", got)
	}
	if lost, gained := gws[0].paid(payer, before); lost.Int64() != price || gained.Int64() != price {
		t.Errorf("after 100 sign-ins the payer lost %s and the seller gained %s, want %d: one payment", lost, gained, price)
	}
	if got := settlementTxs(gws[0].c); got != txs {
		t.Errorf("the engines sent %d transactions, want %d: a sign-in sends none", got, txs)
	}
	refusedSignIn(t, gws[1].signIn(payer), x402.SignInWithXGrantUsedUp)

	// Paying again buys a new grant; once it ends the sign-in is refused, and the route is 402 again.
	if a := gws[1].get(x402.HeaderPaymentSignature, gws[1].permit2(payer)); a.status != http.StatusOK {
		t.Fatalf("the second payment = %d %q, want 200", a.status, a.body)
	}
	if a := gws[0].signIn(payer); a.status != http.StatusOK {
		t.Fatalf("a sign-in after paying again = %d %q, want 200", a.status, a.body)
	}
	clock.advance(time.Hour + time.Second)
	refusedSignIn(t, gws[0].signIn(payer), x402.SignInWithXGrantExpired)
	if a := gws[1].get(); a.status != http.StatusPaymentRequired {
		t.Fatalf("after the grant = %d, want 402", a.status)
	}
	if lost, _ := gws[0].paid(payer, before); lost.Int64() != 2*price {
		t.Errorf("the payer lost %s for two payments, want %d", lost, 2*price)
	}
}

func TestASignInForAnotherDomainURIChainPayerOrNonceIsRefusedAndChangesNothing(t *testing.T) {
	clock := &shiftClock{}
	e := newEnv(t, setup{config: func(c *gate.Config) {
		c.Access, c.Now = &gate.Access{For: time.Hour, Requests: 10}, clock.now
	}})
	payer, other := e.c.Payers[0], e.c.Payers[1]
	if a := e.get(x402.HeaderPaymentSignature, e.permit2(payer)); a.status != http.StatusOK {
		t.Fatalf("the payment = %d %q, want 200", a.status, a.body)
	}
	before, served := e.balances(payer), e.served.Load()
	replayed := signInAs(t, e.challenge(), payer, nil)
	if a := e.get(x402.HeaderSignInWithX, replayed); a.status != http.StatusOK {
		t.Fatalf("the first sign-in = %d %q, want 200", a.status, a.body)
	}
	served++
	grant := func() journal.Grant {
		t.Helper()
		var key string
		g, ok, err := e.store.(journal.Access).AccessGrant(context.Background(), "the test route\n/report\n"+strings.ToLower(payer.Address.Hex()))
		if err != nil || !ok {
			t.Fatalf("the payer's grant %q: %v, %v", key, ok, err)
		}
		return g
	}
	if g := grant(); g.Uses != 9 {
		t.Fatalf("after one sign-in the grant has %d uses, want 9", g.Uses)
	}
	past := func(d time.Duration) string { return clock.now().Add(d).UTC().Format("2006-01-02T15:04:05.000Z") }
	for _, c := range []struct {
		name   string
		header func() string
		reason string
	}{
		{"replayed", func() string { return replayed }, x402.SignInWithXNonce},
		{"another domain", func() string {
			return signInAs(t, e.challenge(), payer, func(s *x402.SignInWithX) { s.Domain = "evil.example" })
		}, x402.SignInWithXDomainMismatch},
		{"another uri", func() string {
			return signInAs(t, e.challenge(), payer, func(s *x402.SignInWithX) { s.URI = strings.Replace(s.URI, "/report", "/other", 1) })
		}, x402.SignInWithXURIMismatch},
		{"another chain", func() string {
			return signInAs(t, e.challenge(), payer, func(s *x402.SignInWithX) { s.ChainID = "eip155:1" })
		}, x402.SignInWithXChainMismatch},
		{"expired", func() string {
			return signInAs(t, e.challenge(), payer, func(s *x402.SignInWithX) { s.ExpirationTime = past(-time.Second) })
		}, x402.SignInWithXExpired},
		{"issued too long ago", func() string {
			return signInAs(t, e.challenge(), payer, func(s *x402.SignInWithX) { s.IssuedAt = past(-6 * time.Minute) })
		}, x402.SignInWithXTooOld},
		{"another payer, unpaid", func() string { return signInAs(t, e.challenge(), other, nil) }, x402.SignInWithXNoGrant},
		{"another payer's grant", func() string {
			return signInAs(t, e.challenge(), other, func(s *x402.SignInWithX) { s.Address = payer.Address.Hex() })
		}, x402.SignInWithXSignature},
		{"forged", func() string {
			return signInAs(t, e.challenge(), payer, func(s *x402.SignInWithX) { s.Signature = "0x" + strings.Repeat("11", 65) })
		}, x402.SignInWithXSignature},
		{"oversized", func() string {
			doc := `{"domain":"x","signature":"0x` + strings.Repeat("ab", 9<<10) + `"}`
			return base64.StdEncoding.EncodeToString([]byte(doc))
		}, x402.SignInWithXHeaderMalformed},
		{"not base64", func() string { return "%%%" }, x402.SignInWithXHeaderMalformed},
	} {
		t.Run(c.name, func(t *testing.T) {
			refusedSignIn(t, e.get(x402.HeaderSignInWithX, c.header()), c.reason)
		})
	}
	if got := e.served.Load(); got != served {
		t.Errorf("the upstream ran %d times for refused sign-ins", got-served)
	}
	if g := grant(); g.Uses != 9 {
		t.Errorf("refused sign-ins left the grant with %d uses, want 9: nothing changes", g.Uses)
	}
	if lost, gained := e.paid(payer, before); lost.Sign() != 0 || gained.Sign() != 0 {
		t.Errorf("refused sign-ins moved %s from the payer and %s to the seller, want nothing", lost, gained)
	}
	// The payer still signs in after all of that.
	if a := e.signIn(payer); a.status != http.StatusOK {
		t.Fatalf("a good sign-in after the refusals = %d %q, want 200", a.status, a.body)
	}
}

func TestAGateWithAccessRefusesSettleAsyncAndBadGrants(t *testing.T) {
	for _, c := range []struct {
		name   string
		settle string
		access gate.Access
		says   string
	}{
		{"async", gate.SettleAsync, gate.Access{For: time.Hour}, "settle async"},
		{"no time", gate.SettleAfter, gate.Access{}, "positive time"},
		{"negative requests", gate.SettleAfter, gate.Access{For: time.Hour, Requests: -1}, "requests"},
		{"relative path", gate.SettleAfter, gate.Access{For: time.Hour, Paths: []string{"reports/*"}}, "start with '/'"},
		{"star inside", gate.SettleAfter, gate.Access{For: time.Hour, Paths: []string{"/a/*/b"}}, "only at its end"},
	} {
		t.Run(c.name, func(t *testing.T) {
			e := newEnv(t, setup{noGate: true})
			cfg := e.cfg
			cfg.Settle, cfg.Access = c.settle, &c.access
			_, err := gate.New(cfg, e.fac, e.store, "test")
			if err == nil || !strings.Contains(err.Error(), c.says) {
				t.Fatalf("gate.New = %v, want an error saying %q", err, c.says)
			}
		})
	}
	// Terms that depend on the request (the stop's review: a cheap query's payment granted the dear one, tenant A's
	// payment tenant B's page): refused.
	e := newEnv(t, setup{noGate: true})
	cfg := e.cfg
	cfg.Access = &gate.Access{For: time.Hour}
	cfg.OffersFor = func(*http.Request) ([]gate.Offer, error) { return cfg.Offers, nil }
	if _, err := gate.New(cfg, e.fac, e.store, "test"); err == nil || !strings.Contains(err.Error(), "depends on the request") {
		t.Fatalf("gate.New with access and per-request terms = %v, want an error saying the terms depend on the request", err)
	}
}

// A contract wallet signs in as its payments are checked: its owner's signature of the message is the wallet's by
// ERC-1271, asked of the chain through the embedded facilitator; its owner signing in its own name is another
// payer, who bought nothing.
func TestAContractWalletThatPaidSignsInWithItsOwnersSignature(t *testing.T) {
	e := newEnv(t, setup{config: func(c *gate.Config) { c.Access = &gate.Access{For: time.Hour} }})
	owner := chaintest.DeriveAccount("siwx wallet owner", 0)
	account := contracts.SmartWalletAccount{Owner: owner.Address, Token: e.c.Token, Spender: contracts.Permit2Address, Salt: big.NewInt(7)}
	wallet := e.c.CreateSmartWallet(e.c.DeploySmartWalletFactory(), account)
	// The wallet's grant, as its payment's settlement writes it (paying from a contract wallet is chain's to test).
	if err := e.store.(journal.Access).GrantAccess(context.Background(), "the test route\n/report\n"+strings.ToLower(wallet.Hex()),
		journal.ID{1}, time.Now().Add(time.Hour), 0); err != nil {
		t.Fatal(err)
	}
	asWallet := func(s *x402.SignInWithX) { s.Address = wallet.Hex() }
	if a := e.get(x402.HeaderSignInWithX, signInAs(t, e.challenge(), owner, asWallet)); a.status != http.StatusOK {
		t.Fatalf("the wallet's sign-in by its owner = %d %q, want 200", a.status, a.body)
	}
	stranger := chaintest.DeriveAccount("siwx stranger", 0)
	refusedSignIn(t, e.get(x402.HeaderSignInWithX, signInAs(t, e.challenge(), stranger, asWallet)), x402.SignInWithXSignature)
	refusedSignIn(t, e.get(x402.HeaderSignInWithX, signInAs(t, e.challenge(), owner, nil)), x402.SignInWithXNoGrant)
}

// A payment grants access once its settlement succeeded, whatever settles it (before the upstream, after it, an
// upto payment for what the upstream named); one the upstream failed, charged nothing, grants nothing.
func TestEverySettlementThatSucceededGrantsAccessAndNoneThatFailedDoes(t *testing.T) {
	for _, c := range []struct{ name, settle, scheme string }{
		{"settle before", gate.SettleBefore, ""},
		{"settle after", gate.SettleAfter, ""},
		{"upto", gate.SettleAfter, x402.SchemeUpto},
	} {
		t.Run(c.name, func(t *testing.T) {
			e := newEnv(t, setup{settle: c.settle, scheme: c.scheme, override: func(*http.Request) string { return `{"amount":"4000"}` },
				config: func(cfg *gate.Config) { cfg.Access = &gate.Access{For: time.Hour, Requests: 2} }})
			payer := e.c.Payers[0]
			before := e.balances(payer)
			if c.settle == gate.SettleAfter {
				e.failing.Store(true)
				if a := e.get(x402.HeaderPaymentSignature, e.permit2(payer)); a.status != http.StatusServiceUnavailable {
					t.Fatalf("a payment the upstream failed = %d %q, want its 503", a.status, a.body)
				}
				refusedSignIn(t, e.signIn(payer), x402.SignInWithXNoGrant)
				e.failing.Store(false)
			}
			if a := e.get(x402.HeaderPaymentSignature, e.permit2(payer)); a.status != http.StatusOK {
				t.Fatalf("the payment = %d %q, want 200", a.status, a.body)
			}
			for i := 0; i < 2; i++ {
				if a := e.signIn(payer); a.status != http.StatusOK {
					t.Fatalf("sign-in %d = %d %q, want 200", i, a.status, a.body)
				}
			}
			refusedSignIn(t, e.signIn(payer), x402.SignInWithXGrantUsedUp)
			want := int64(price)
			if c.scheme == x402.SchemeUpto {
				want = 4000
			}
			if lost, gained := e.paid(payer, before); lost.Int64() != want || gained.Int64() != want {
				t.Errorf("the payer lost %s and the seller gained %s, want %d once", lost, gained, want)
			}
		})
	}
}

// The upstream never sees a SIGN-IN-WITH-X header: not of a sign-in it serves, nor of a paid request that carried
// one too (judged as a payment, its sign-in not spent, and good for minutes to whoever reads it).
func TestTheUpstreamIsNeverHandedASignIn(t *testing.T) {
	var seen atomic.Int64
	e := newEnv(t, setup{
		config: func(c *gate.Config) { c.Access = &gate.Access{For: time.Hour} },
		upstream: gate.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
			if r.Header.Get(x402.HeaderSignInWithX) != "" {
				seen.Add(1)
			}
			_, err := w.Write([]byte("paid content"))
			return err
		}),
	})
	payer := e.c.Payers[0]
	unspent := signInAs(t, e.challenge(), payer, nil)
	if a := e.get(x402.HeaderPaymentSignature, e.permit2(payer), x402.HeaderSignInWithX, unspent); a.status != http.StatusOK {
		t.Fatalf("a payment carrying a sign-in = %d %q, want 200", a.status, a.body)
	}
	if a := e.signIn(payer); a.status != http.StatusOK {
		t.Fatalf("the sign-in = %d %q, want 200", a.status, a.body)
	}
	if n := seen.Load(); n != 0 {
		t.Fatalf("the upstream was handed %d SIGN-IN-WITH-X headers, want none", n)
	}
	// The sign-in the paid request carried was never spent: its payer may still use it, the upstream could not.
	if a := e.get(x402.HeaderSignInWithX, unspent); a.status != http.StatusOK {
		t.Fatalf("the unspent sign-in = %d %q, want 200", a.status, a.body)
	}
}

// One sign-in presented at once to two gateways of a cluster behind one name (a load balancer's) is served once:
// its nonce is spent in the shared journal by the first, and the other is refused as replayed.
func TestOneSignInPresentedToTwoGatewaysAtOnceIsServedOnce(t *testing.T) {
	gws := gateways(t, setup{config: func(c *gate.Config) { c.Access = &gate.Access{For: time.Hour} }}, 2)
	payer := gws[0].c.Payers[0]
	if a := gws[0].get(x402.HeaderPaymentSignature, gws[0].permit2(payer)); a.status != http.StatusOK {
		t.Fatalf("the payment = %d %q, want 200", a.status, a.body)
	}
	const host = "shop.example"
	ask := func(gw *env, headers ...string) (*http.Response, string) {
		t.Helper()
		req, err := http.NewRequest(http.MethodGet, gw.srv.URL+"/report", nil)
		if err != nil {
			t.Fatal(err)
		}
		req.Host = host
		for i := 0; i+1 < len(headers); i += 2 {
			req.Header.Set(headers[i], headers[i+1])
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp, string(b)
	}
	for round := 0; round < 5; round++ {
		resp, _ := ask(gws[0])
		pr, err := x402.DecodePaymentRequired(resp.Header.Get(x402.HeaderPaymentRequired))
		if err != nil {
			t.Fatal(err)
		}
		var decl x402.SignInWithXDeclaration
		if err := json.Unmarshal(pr.Extensions[x402.ExtensionSignInWithX], &decl); err != nil {
			t.Fatal(err)
		}
		header := signInAs(t, decl, payer, nil)
		served := make(chan bool, 2)
		for _, gw := range gws {
			go func() {
				resp, _ := ask(gw, x402.HeaderSignInWithX, header)
				served <- resp.StatusCode == http.StatusOK
			}()
		}
		n := 0
		for range gws {
			if <-served {
				n++
			}
		}
		if n != 1 {
			t.Fatalf("round %d: one sign-in served %d times by two gateways, want once", round, n)
		}
	}
	if got := gws[0].served.Load() + gws[1].served.Load(); got != 6 {
		t.Errorf("the upstreams ran %d times, want 6 (one paid, five signed in)", got)
	}
}

// With paths, a grant covers the paths named, whatever path the payment was for, and no other.
func TestAGrantOfPathsCoversThePathsNamedAndNoOther(t *testing.T) {
	e := newEnv(t, setup{config: func(c *gate.Config) { c.Access = &gate.Access{For: time.Hour, Paths: []string{"/rep*"}} }})
	payer := e.c.Payers[0]
	if a := e.get(x402.HeaderPaymentSignature, e.permit2(payer)); a.status != http.StatusOK {
		t.Fatalf("the payment = %d %q, want 200", a.status, a.body)
	}
	if a := e.signIn(payer); a.status != http.StatusOK {
		t.Fatalf("a sign-in for a path granted = %d %q, want 200", a.status, a.body)
	}
	// A reload that grants other paths: the grant stands (it is the route's), but this path is no longer covered.
	e.cfg.Access = &gate.Access{For: time.Hour, Paths: []string{"/elsewhere/*"}}
	e.startGate()
	refusedSignIn(t, e.signIn(payer), x402.SignInWithXPathNotGranted)
}

// access and payment_identifier declare their extensions side by side in one 402, and a HEAD request signs in as
// a GET does (one use of the grant), its challenge the same resource's.
func TestAccessBesidePaymentIdentifierAndAHeadSignIn(t *testing.T) {
	e := newEnv(t, setup{config: func(c *gate.Config) {
		c.Access, c.PaymentIdentifier = &gate.Access{For: time.Hour, Requests: 1}, gate.PaymentIdentifierOptional
	}})
	pr, err := x402.DecodePaymentRequired(e.get().header.Get(x402.HeaderPaymentRequired))
	if err != nil || pr.Extensions[x402.ExtensionSignInWithX] == nil || pr.Extensions[x402.ExtensionPaymentIdentifier] == nil {
		t.Fatalf("the 402 declares %v (%v), want sign-in-with-x and payment-identifier", pr.Extensions, err)
	}
	payer := e.c.Payers[0]
	if a := e.get(x402.HeaderPaymentSignature, e.permit2Named(payer, namedBy("pay_0123456789abcdef0123"))); a.status != http.StatusOK {
		t.Fatalf("a named payment = %d %q, want 200", a.status, a.body)
	}
	req, err := http.NewRequest(http.MethodHead, e.srv.URL+"/report", nil)
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set(x402.HeaderSignInWithX, signInAs(t, e.challenge(), payer, nil))
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("a HEAD sign-in = %d, want 200", resp.StatusCode)
	}
	refusedSignIn(t, e.signIn(payer), x402.SignInWithXGrantUsedUp)
}

// fetch requests path of the env's server with the given headers (name, value pairs).
func (e *env) fetch(path string, headers ...string) answer {
	e.t.Helper()
	req, err := http.NewRequest(http.MethodGet, e.srv.URL+path, nil)
	if err != nil {
		e.t.Fatal(err)
	}
	for i := 0; i+1 < len(headers); i += 2 {
		req.Header.Set(headers[i], headers[i+1])
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		e.t.Fatal(err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		e.t.Fatal(err)
	}
	return answer{resp.StatusCode, resp.Header, string(body)}
}

// A sign-in whose fields hold a NUL, a control character or text that is not UTF-8, or a request path that is
// not, is refused as malformed (or judged on its path as any other), never handed to the journal: PostgreSQL's
// text holds neither, and the refusal of its write read as an unreachable journal (503) to a client that wrote
// nothing wrong but its header.
func TestASignInWithANulOrBadUTF8IsRefusedAsMalformedNotAsAnUnreachableJournal(t *testing.T) {
	gws := gateways(t, setup{config: func(c *gate.Config) { c.Access = &gate.Access{For: time.Hour} }}, 1)
	e := gws[0]
	payer := e.c.Payers[0]
	if a := e.get(x402.HeaderPaymentSignature, e.permit2(payer)); a.status != http.StatusOK {
		t.Fatalf("the payment = %d %q, want 200", a.status, a.body)
	}
	inNonce := func(text string) func() string {
		return func() string {
			b, _ := base64.StdEncoding.DecodeString(signInAs(t, e.challenge(), payer, nil))
			return base64.StdEncoding.EncodeToString([]byte(strings.Replace(string(b), `"nonce":"`, `"nonce":"`+text, 1)))
		}
	}
	for _, c := range []struct {
		name   string
		header func() string
	}{
		{"a NUL in the nonce, signed", func() string {
			return signInAs(t, e.challenge(), payer, func(s *x402.SignInWithX) { s.Nonce += "\x00" })
		}},
		{"a newline in the nonce, signed", func() string {
			return signInAs(t, e.challenge(), payer, func(s *x402.SignInWithX) { s.Nonce += "\nIssued At: 2020-01-01T00:00:00Z" })
		}},
		{"a NUL in the statement, signed", func() string {
			return signInAs(t, e.challenge(), payer, func(s *x402.SignInWithX) { st := "hi\x00"; s.Statement = &st })
		}},
		{"bad UTF-8 in the nonce", inNonce("\xff")},
		{"a lone surrogate in the nonce", inNonce(`\ud800`)},
		{"an escaped NUL in the nonce", inNonce(`\u0000`)},
	} {
		t.Run(c.name, func(t *testing.T) {
			refusedSignIn(t, e.get(x402.HeaderSignInWithX, c.header()), x402.SignInWithXHeaderMalformed)
		})
	}
	// A request path that is not UTF-8 (or holds a NUL) is judged as any other: no grant there.
	for _, p := range []string{"/report%ff", "/report%00"} {
		a := e.fetch(p)
		pr, err := x402.DecodePaymentRequired(a.header.Get(x402.HeaderPaymentRequired))
		if err != nil {
			t.Fatalf("GET %s = %d %q: %v", p, a.status, a.body, err)
		}
		var decl x402.SignInWithXDeclaration
		if err := json.Unmarshal(pr.Extensions[x402.ExtensionSignInWithX], &decl); err != nil {
			t.Fatal(err)
		}
		refusedSignIn(t, e.fetch(p, x402.HeaderSignInWithX, signInAs(t, decl, payer, nil)), x402.SignInWithXNoGrant)
	}
	if a := e.signIn(payer); a.status != http.StatusOK {
		t.Fatalf("a good sign-in after the refusals = %d %q, want 200", a.status, a.body)
	}
}

// A payment whose first response was not delivered (its upstream failed after it settled, its client went) and
// that is served when presented again grants access as its first presentation would have: the payer paid once,
// and is served once, and its grant is written once, whichever presentation delivered.
func TestAPaymentServedWhenPresentedAgainGrantsAccessOnce(t *testing.T) {
	var runs atomic.Int64
	flaky := gate.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
		if runs.Add(1) == 1 {
			w.WriteHeader(http.StatusBadGateway)
			return nil
		}
		_, err := w.Write([]byte("paid content"))
		return err
	})
	e := newEnv(t, setup{settle: gate.SettleBefore, upstream: flaky, config: func(c *gate.Config) {
		c.Access = &gate.Access{For: time.Hour, Requests: 3}
	}})
	payer := e.c.Payers[0]
	header, before := e.permit2(payer), e.balances(payer)
	if a := e.get(x402.HeaderPaymentSignature, header); a.status != http.StatusBadGateway {
		t.Fatalf("the first presentation = %d %q, want the upstream's 502", a.status, a.body)
	}
	if a := e.get(x402.HeaderPaymentSignature, header); a.status != http.StatusOK || a.body != "paid content" {
		t.Fatalf("the payment presented again = %d %q, want the resource", a.status, a.body)
	}
	if a := e.get(x402.HeaderPaymentSignature, header); a.status != http.StatusPaymentRequired {
		t.Fatalf("the payment presented a third time = %d %q, want 402: served", a.status, a.body)
	}
	if lost, gained := e.paid(payer, before); lost.Int64() != price || gained.Int64() != price {
		t.Fatalf("the payer lost %s and the seller gained %s, want %d once", lost, gained, price)
	}
	for i := range 3 {
		if a := e.signIn(payer); a.status != http.StatusOK {
			t.Fatalf("sign-in %d after the payment was served on its second presentation = %d %q, want 200", i, a.status, a.body)
		}
	}
	refusedSignIn(t, e.signIn(payer), x402.SignInWithXGrantUsedUp)
}

// A grant named on two routes is sold on either and honoured on both: a payment on one signs its payer in on the
// other, with no transaction, on another gateway of the cluster. A route that does not name it (the same route
// after a reload that drops the name) honours none of it.
func TestANamedGrantBoughtOnOneRouteSignsInOnAnotherThatNamesIt(t *testing.T) {
	named := func(route string) setup {
		return setup{config: func(c *gate.Config) {
			c.Route, c.Access = route, &gate.Access{For: time.Hour, Requests: 2, Grant: "members"}
		}}
	}
	otherPayee := named("another tenant's route")
	tenant := otherPayee.config
	otherPayee.config = func(c *gate.Config) {
		tenant(c)
		for i := range c.Offers {
			c.Offers[i].PayTo = "0x000000000000000000000000000000000000dEaD"
		}
	}
	gws := gatewaysOf(t, []setup{named("the selling route"), named("the honouring route"), otherPayee})
	payer := gws[0].c.Payers[0]
	before := gws[0].balances(payer)
	if a := gws[0].get(x402.HeaderPaymentSignature, gws[0].permit2(payer)); a.status != http.StatusOK {
		t.Fatalf("the payment on the selling route = %d %q, want 200", a.status, a.body)
	}
	txs := settlementTxs(gws[0].c)
	if a := gws[1].signIn(payer); a.status != http.StatusOK || a.body != "paid content" {
		t.Fatalf("a sign-in on the route honouring the grant = %d %q, want the resource", a.status, a.body)
	}
	if got := settlementTxs(gws[0].c); got != txs {
		t.Errorf("the sign-in sent %d transactions, want none", got-txs)
	}
	// A route of another payee naming a grant alike (another site of the same journal) honours none of it.
	refusedSignIn(t, gws[2].signIn(payer), x402.SignInWithXNoGrant)
	if lost, gained := gws[0].paid(payer, before); lost.Int64() != price || gained.Int64() != price {
		t.Errorf("the payer lost %s and the seller gained %s, want %d once", lost, gained, price)
	}
	// The honouring route, reloaded without the grant's name, honours none of it.
	gws[1].cfg.Access = &gate.Access{For: time.Hour, Requests: 2}
	gws[1].startGate()
	refusedSignIn(t, gws[1].signIn(payer), x402.SignInWithXNoGrant)
	// The grant's one request left still signs in where it is named.
	if a := gws[0].signIn(payer); a.status != http.StatusOK {
		t.Fatalf("the second sign-in on the selling route = %d %q, want 200", a.status, a.body)
	}
	refusedSignIn(t, gws[0].signIn(payer), x402.SignInWithXGrantUsedUp)
}

func TestABadGrantNameIsRefused(t *testing.T) {
	for _, name := range []string{"has space", "new\nline", strings.Repeat("g", 65), "ünï"} {
		if err := gate.CheckAccess(&gate.Access{For: time.Hour, Grant: name}, gate.SettleAfter); err == nil || !strings.Contains(err.Error(), "grant") {
			t.Errorf("CheckAccess of grant %q = %v, want it refused naming the grant", name, err)
		}
	}
	if err := gate.CheckAccess(&gate.Access{For: time.Hour, Grant: "members.gold-1_x"}, gate.SettleAfter); err != nil {
		t.Errorf("CheckAccess of a good grant name: %v", err)
	}
}

// signInOnlyRefused checks a sign-in-only route's 402: the challenge, no way to pay, and reason in its error.
func signInOnlyRefused(t *testing.T, a answer, reason string) {
	t.Helper()
	if a.status != http.StatusPaymentRequired {
		t.Fatalf("sign-in-only answer = %d %q, want 402 naming %s", a.status, a.body, reason)
	}
	pr, err := x402.DecodePaymentRequired(a.header.Get(x402.HeaderPaymentRequired))
	if err != nil || !strings.Contains(pr.Error, reason) || pr.Extensions[x402.ExtensionSignInWithX] == nil || pr.Accepts == nil || len(pr.Accepts) != 0 {
		t.Fatalf("the 402 says %q with accepts %v and extensions %s (%v), want it to name %s, the challenge and accepts []", pr.Error, pr.Accepts, pr.Extensions, err, reason)
	}
	if !strings.Contains(a.body, `"accepts":[]`) {
		t.Errorf("the 402's body %q lists no empty accepts", a.body)
	}
}

func TestASignInOnlyRouteSellsNothingAndHonoursTheGrantBoughtOnAnother(t *testing.T) {
	selling := setup{config: func(c *gate.Config) {
		c.Route, c.Access = "the selling route", &gate.Access{For: time.Hour, Requests: 2, Grant: "members"}
	}}
	signInOnly := setup{config: func(c *gate.Config) {
		c.Route, c.Access, c.SignInOnly = "the sign-in-only route", &gate.Access{For: time.Hour, Requests: 2, Grant: "members"}, true
	}}
	gws := gatewaysOf(t, []setup{selling, signInOnly})
	payer := gws[0].c.Payers[0]
	before := gws[0].balances(payer)
	txs := settlementTxs(gws[0].c)

	// Without a grant: the challenge, nothing to pay, and why.
	signInOnlyRefused(t, gws[1].get(), x402.HeaderSignInWithX)
	signInOnlyRefused(t, gws[1].signIn(payer), x402.SignInWithXNoGrant)
	if a := gws[1].get("Accept", "text/html"); a.status != http.StatusPaymentRequired {
		t.Errorf("a browser's request of the sign-in-only route = %d %q, want 402", a.status, a.body)
	}
	// A payment presented to it is refused: nothing verified, settled or served.
	signInOnlyRefused(t, gws[1].get(x402.HeaderPaymentSignature, gws[0].permit2(payer)), "sells nothing")
	if got := settlementTxs(gws[0].c); got != txs {
		t.Fatalf("the payment presented to the sign-in-only route sent %d transactions, want none", got-txs)
	}

	if a := gws[0].get(x402.HeaderPaymentSignature, gws[0].permit2(payer)); a.status != http.StatusOK {
		t.Fatalf("the payment on the selling route = %d %q, want 200", a.status, a.body)
	}
	txs = settlementTxs(gws[0].c)
	if a := gws[1].signIn(payer); a.status != http.StatusOK || a.body != "paid content" {
		t.Fatalf("a sign-in on the sign-in-only route = %d %q, want the resource", a.status, a.body)
	}
	if got := settlementTxs(gws[0].c); got != txs {
		t.Errorf("the sign-in sent %d transactions, want none", got-txs)
	}
	// It spent one request of the grant: one is left, on either route, then none.
	if a := gws[0].signIn(payer); a.status != http.StatusOK {
		t.Fatalf("the second sign-in on the selling route = %d %q, want 200", a.status, a.body)
	}
	signInOnlyRefused(t, gws[1].signIn(payer), x402.SignInWithXGrantUsedUp)
	if lost, gained := gws[0].paid(payer, before); lost.Int64() != price || gained.Int64() != price {
		t.Errorf("the payer lost %s and the seller gained %s, want %d once", lost, gained, price)
	}
}

func TestASignInOnlyGateNeedsAGrantNameAndAPayee(t *testing.T) {
	cfg := gate.Config{SignInOnly: true, Offers: []gate.Offer{{PayTo: "0x000000000000000000000000000000000000dEaD"}}}
	if err := gate.CheckSignInOnly(cfg); err == nil || !strings.Contains(err.Error(), "grant") {
		t.Errorf("a sign-in-only gate without access = %v, want it refused naming the grant", err)
	}
	cfg.Access = &gate.Access{For: time.Hour}
	if err := gate.CheckSignInOnly(cfg); err == nil || !strings.Contains(err.Error(), "grant") {
		t.Errorf("a sign-in-only gate without a grant name = %v, want it refused naming the grant", err)
	}
	cfg.Access.Grant = "members"
	if err := gate.CheckSignInOnly(cfg); err != nil {
		t.Errorf("a good sign-in-only gate: %v", err)
	}
	cfg.Offers[0].PayTo = ""
	if err := gate.CheckSignInOnly(cfg); err == nil || !strings.Contains(err.Error(), "pay_to") {
		t.Errorf("a sign-in-only gate without pay_to = %v, want it refused naming pay_to", err)
	}
}
