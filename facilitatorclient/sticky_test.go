package facilitatorclient

import (
	"context"
	"net/http"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/x402-gateway/caddy-x402/x402"
)

// A payment is remembered with its member past its deadline, for a day: past the deadline it cannot settle
// anywhere, and only the member that may have settled it can say whether it did. A payment naming no deadline
// is remembered from its maxTimeoutSeconds; none longer than maxStickyFor.
func TestAPaymentStaysWithItsMemberADayPastItsDeadline(t *testing.T) {
	now := time.Unix(1_800_000_000, 0)
	req := permit2Request(mainnet)
	req.PaymentPayload.Payload.Permit2Authorization.Deadline = strconv.FormatInt(now.Add(time.Minute).Unix(), 10)
	if got, want := stickyUntil(req, now), now.Add(time.Minute+stickyPastDeadline); !got.Equal(want) {
		t.Errorf("until = %s, want a day past the deadline, %s", got, want)
	}
	never := req
	never.PaymentPayload.Payload = x402.ExactEVMPayload{Permit2Authorization: &x402.Permit2Authorization{From: payer, Nonce: "1",
		Deadline: "115792089237316195423570985008687907853269984665640564039457584007913129639935"}}
	if got := stickyUntil(never, now); !got.Equal(now.Add(maxStickyFor)) {
		t.Errorf("until of a payment that never expires = %s, want %s", got, now.Add(maxStickyFor))
	}

	var s stickyPayments
	a, b := "http://a", "http://b"
	key := stickyKey(req)
	s.put(key, a, stickyUntil(req, now), now)
	for _, at := range []time.Duration{0, time.Minute + time.Second, time.Hour, stickyPastDeadline} {
		if got := s.get(key, now.Add(at)); len(got) != 1 || got[0] != a {
			t.Errorf("%s later: member %q, want a", at, got)
		}
	}
	if got := s.get(key, now.Add(time.Minute+stickyPastDeadline)); got != nil || s.size() != 0 {
		t.Errorf("a day past the deadline: member %q, %d remembered; want forgotten", got, s.size())
	}
	// Sent to another member too (by another set), both are remembered, the last sent to last.
	s.put(key, a, stickyUntil(req, now), now)
	s.put(key, b, stickyUntil(req, now), now)
	s.put(key, a, stickyUntil(req, now), now)
	if got := s.get(key, now); len(got) != 2 || got[0] != b || got[1] != a {
		t.Errorf("members %q, want b then a", got)
	}
}

// The payments remembered are bounded: past maxSticky the one sent the longest ago is forgotten, in constant
// time, and those that ran out are forgotten as new ones come.
func TestStickyPaymentsForgetTheEarliestSentPastTheirBound(t *testing.T) {
	now := time.Unix(1_800_000_000, 0)
	var s stickyPayments
	c := "http://a"
	start := time.Now()
	for i := range maxSticky + 10 {
		s.put("k"+strconv.Itoa(i), c, now.Add(time.Hour), now)
	}
	if took := time.Since(start); took > 10*time.Second {
		t.Errorf("%d puts took %s; want each in constant time", maxSticky+10, took)
	}
	if n := s.size(); n != maxSticky {
		t.Fatalf("%d remembered, want the bound %d", n, maxSticky)
	}
	for i := range 10 {
		if s.get("k"+strconv.Itoa(i), now) != nil {
			t.Fatalf("payment %d, among the earliest sent, is still remembered past the bound", i)
		}
	}
	if s.get("k10", now) == nil || s.get("k"+strconv.Itoa(maxSticky+9), now) == nil {
		t.Fatal("a payment within the bound was forgotten")
	}
	// An hour later every payment has run out: the next put forgets them all.
	s.put("late", c, now.Add(2*time.Hour), now.Add(time.Hour))
	if n := s.size(); n != 1 {
		t.Fatalf("%d remembered after all ran out, want 1", n)
	}
}

// Failover sets that share their memory keep a payment with the member it was sent to: a set built anew (a
// reload) asks that member alone, whatever its order. A set that sends it on to a member of its own (a
// middleware of the same process) keeps it with that member, and the first set with its own.
func TestFailoverSetsSharingTheirMemoryKeepAPaymentWithItsMember(t *testing.T) {
	req := permit2Request(mainnet)
	req.PaymentPayload.Payload.Permit2Authorization.Deadline = strconv.FormatInt(time.Now().Add(time.Minute).Unix(), 10)
	var lost atomic.Bool
	lost.Store(true)
	a := newFakeFacilitator(t, permit2Supported(mainnet), func(f *fakeFacilitator) {
		f.settle = func(w http.ResponseWriter, _ *http.Request, _ []byte) {
			if lost.Load() {
				dropConnection(w)
				return
			}
			writeJSON(w, http.StatusOK, x402.SettleResponse{Success: true, Transaction: txHash, Network: mainnet, Payer: payer})
		}
	})
	b := newFakeFacilitator(t, permit2Supported(mainnet))
	memory := NewSentPayments()
	if _, err := NewFailoverSharing(memory, mustClient(t, a.URL()), mustClient(t, b.URL())).Settle(context.Background(), req); !x402.IsUnreachable(err) {
		t.Fatalf("first settlement, A's answer lost: %v, want unreachable", err)
	}
	lost.Store(false)

	// A set built anew, B first: the payment goes to A all the same.
	if resp, err := NewFailoverSharing(memory, mustClient(t, b.URL()), mustClient(t, a.URL())).Settle(context.Background(), req); err != nil || !resp.Success {
		t.Fatalf("settled again through a new set = %+v, %v; want A's settlement", resp, err)
	}
	if n := b.settleCalls.Load(); n != 0 {
		t.Errorf("B was asked to settle %d times; want never", n)
	}

	// Another set of the process sends it to a member of its own: each set keeps it with its member.
	c := newFakeFacilitator(t, permit2Supported(mainnet))
	d := newFakeFacilitator(t, permit2Supported(mainnet))
	inner := NewFailoverSharing(memory, mustClient(t, c.URL()), mustClient(t, d.URL()))
	if _, err := inner.Settle(context.Background(), req); err != nil {
		t.Fatal(err)
	}
	if got := NewFailoverSharing(memory, mustClient(t, b.URL()), mustClient(t, a.URL())).stickyMember(stickyKey(req)); got == nil || got.base != a.URL() {
		t.Errorf("the first set's member = %v, want A", got)
	}
	if got := NewFailoverSharing(memory, mustClient(t, d.URL()), mustClient(t, c.URL())).stickyMember(stickyKey(req)); got == nil || got.base != c.URL() {
		t.Errorf("the other set's member = %v, want C", got)
	}
}

// The memory names a payment by what it signs, not by its payer and nonce alone. An erc2612 nonce is the token's
// nonces(payer), a small counter: it stays the same after a settlement refused (nothing spent it), and is the same
// number in every token. The payer's next erc2612 payment, with the same token nonce and a permit to another
// member's wallet (the gate's offers rotate the spender over every member's signers), goes to the owner of that
// wallet, not to the member that refused the first: that one cannot spend the permit.
func TestAnERC2612PaymentReusingARefusedPaymentsTokenNonceGoesToTheOwnerOfItsSpender(t *testing.T) {
	deadline := strconv.FormatInt(time.Now().Add(time.Minute).Unix(), 10)
	a := newFakeFacilitator(t, erc2612Supported(walletA, mainnet), func(f *fakeFacilitator) {
		f.settle = func(w http.ResponseWriter, _ *http.Request, _ []byte) {
			writeJSON(w, http.StatusOK, x402.SettleResponse{Success: false, ErrorReason: x402.ReasonInsufficientFunds,
				ErrorMessage: "scripted: the payer's balance is short", Network: mainnet, Payer: payer})
		}
	})
	b := newFakeFacilitator(t, erc2612Supported(walletB, mainnet))
	fo := NewFailover(mustClient(t, a.URL()), mustClient(t, b.URL()))
	ctx := context.Background()

	first := erc2612Request(mainnet, strings.ToLower(walletA))
	first.PaymentPayload.Payload.Authorization.ValidBefore = deadline
	if resp, err := fo.Settle(ctx, first); err != nil || resp.Success {
		t.Fatalf("the first payment, to A's wallet: %+v, %v; want A's refusal", resp, err)
	}
	// The payer tops up and pays again: the token nonce is unchanged (nothing spent it), the permit names B's wallet.
	second := erc2612Request(mainnet, strings.ToLower(walletB))
	second.PaymentPayload.Payload.Authorization.ValidBefore = deadline
	resp, err := fo.Settle(ctx, second)
	if a.settleCalls.Load() != 1 || b.settleCalls.Load() != 1 || err != nil || !resp.Success {
		t.Errorf("the second payment, to B's wallet, with the same token nonce: %+v, %v; settlements a=%d b=%d, want it settled by B alone",
			resp, err, a.settleCalls.Load(), b.settleCalls.Load())
	}
}

// The memory knows a payment by what its payer signed, in every transfer method and scheme: presented again with
// its signature or addresses spelled otherwise, or with what the payer did not sign changed (the resource, the
// extensions, an upto payment's charge), it is the same payment and goes to the member it was sent to; with any
// signed field changed, or another token, it is another payment, whatever its payer and nonce.
func TestTheMemoryKnowsAPaymentByWhatItsPayerSigned(t *testing.T) {
	eip3009 := func() x402.VerifyRequest {
		req := erc2612Request(mainnet, payTo)
		req.PaymentRequirements.Extra.AssetTransferMethod = x402.TransferEIP3009
		req.PaymentPayload.Accepted = req.PaymentRequirements
		req.PaymentPayload.Payload.Authorization.Nonce = "0x" + strings.Repeat("5a", 32)
		return req
	}
	upto := func() x402.VerifyRequest {
		req := permit2Request(mainnet)
		req.PaymentRequirements.Scheme, req.PaymentPayload.Accepted.Scheme = x402.SchemeUpto, x402.SchemeUpto
		req.PaymentPayload.Payload.Permit2Authorization.Witness.Facilitator = walletA
		return req
	}
	type edit func(*x402.VerifyRequest)
	sameSigned := map[string]edit{
		"signature in capitals": func(r *x402.VerifyRequest) {
			r.PaymentPayload.Payload.Signature = "0x" + strings.ToUpper(r.PaymentPayload.Payload.Signature[2:])
		},
		"another signature": func(r *x402.VerifyRequest) { r.PaymentPayload.Payload.Signature = "0x" + strings.Repeat("11", 65) },
		"payer in lower case": func(r *x402.VerifyRequest) {
			if a := r.PaymentPayload.Payload.Authorization; a != nil {
				a.From = strings.ToLower(a.From)
			} else {
				r.PaymentPayload.Payload.Permit2Authorization.From = strings.ToLower(payer)
			}
		},
		"another resource": func(r *x402.VerifyRequest) {
			r.PaymentPayload.Resource = &x402.ResourceInfo{URL: "https://api.example.com/other"}
		},
		"no extensions":         func(r *x402.VerifyRequest) { r.PaymentPayload.Extensions = nil },
		"another charge":        func(r *x402.VerifyRequest) { r.PaymentRequirements.Amount = "1" },
		"another timeout":       func(r *x402.VerifyRequest) { r.PaymentRequirements.MaxTimeoutSeconds = 600 },
		"asset in lower case":   func(r *x402.VerifyRequest) { r.PaymentRequirements.Asset = strings.ToLower(token) },
		"another payment shape": func(r *x402.VerifyRequest) { r.PaymentPayload.X402Version, r.X402Version = 1, 1 },
	}
	authorization := map[string]edit{
		"another recipient or spender": func(r *x402.VerifyRequest) { r.PaymentPayload.Payload.Authorization.To = walletB },
		"another value":                func(r *x402.VerifyRequest) { r.PaymentPayload.Payload.Authorization.Value = "10001" },
		"another validAfter":           func(r *x402.VerifyRequest) { r.PaymentPayload.Payload.Authorization.ValidAfter = "1" },
		"another validBefore":          func(r *x402.VerifyRequest) { r.PaymentPayload.Payload.Authorization.ValidBefore = "1767225661" },
		"another token":                func(r *x402.VerifyRequest) { r.PaymentRequirements.Asset = walletB },
	}
	permit2 := map[string]edit{
		"another token":      func(r *x402.VerifyRequest) { r.PaymentPayload.Payload.Permit2Authorization.Permitted.Token = walletB },
		"another amount":     func(r *x402.VerifyRequest) { r.PaymentPayload.Payload.Permit2Authorization.Permitted.Amount = "10001" },
		"another spender":    func(r *x402.VerifyRequest) { r.PaymentPayload.Payload.Permit2Authorization.Spender = walletB },
		"another deadline":   func(r *x402.VerifyRequest) { r.PaymentPayload.Payload.Permit2Authorization.Deadline = "1767225661" },
		"another recipient":  func(r *x402.VerifyRequest) { r.PaymentPayload.Payload.Permit2Authorization.Witness.To = walletB },
		"another validAfter": func(r *x402.VerifyRequest) { r.PaymentPayload.Payload.Permit2Authorization.Witness.ValidAfter = "1" },
		"another facilitator": func(r *x402.VerifyRequest) {
			r.PaymentPayload.Payload.Permit2Authorization.Witness.Facilitator = walletB
		},
		"another network": func(r *x402.VerifyRequest) { r.PaymentRequirements.Network = testnet },
		"another method":  func(r *x402.VerifyRequest) { r.PaymentRequirements.Extra.AssetTransferMethod = x402.TransferERC2612 },
		"another nonce":   func(r *x402.VerifyRequest) { r.PaymentPayload.Payload.Permit2Authorization.Nonce = "7" },
		"another payer":   func(r *x402.VerifyRequest) { r.PaymentPayload.Payload.Permit2Authorization.From = walletB },
		"an empty witness": func(r *x402.VerifyRequest) {
			r.PaymentPayload.Payload.Permit2Authorization.Witness = x402.Permit2Witness{}
		},
	}
	for _, m := range []struct {
		name    string
		payment func() x402.VerifyRequest
		other   map[string]edit
	}{
		{"erc2612", func() x402.VerifyRequest { return erc2612Request(mainnet, walletA) }, authorization},
		{"eip3009", eip3009, authorization},
		{"permit2", func() x402.VerifyRequest { return permit2Request(mainnet) }, permit2},
		{"upto", upto, permit2},
	} {
		key := stickyKey(m.payment())
		if key == "" {
			t.Fatalf("%s: no key", m.name)
		}
		for name, e := range sameSigned {
			req := m.payment()
			e(&req)
			if stickyKey(req) != key {
				t.Errorf("%s, %s: another key; want the same payment's", m.name, name)
			}
		}
		for name, e := range m.other {
			req := m.payment()
			e(&req)
			if stickyKey(req) == key {
				t.Errorf("%s, %s: the same key; want another payment's", m.name, name)
			}
		}
	}
}
