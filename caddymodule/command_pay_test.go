package caddymodule

import (
	"math/big"
	"strings"
	"testing"
	"time"

	"github.com/ethereum/go-ethereum/common"

	"github.com/x402-gateway/caddy-x402/chain/contracts"
	"github.com/x402-gateway/caddy-x402/x402"
)

// onlyPermit2 makes the fixture offer its permit2 requirement alone, changed by change.
func (fx *payFixture) onlyPermit2(change func(*x402.PaymentRequirements)) {
	req := fx.required.Accepts[0]
	change(&req)
	fx.required.Accepts = []x402.PaymentRequirements{req}
}

// assertNothingSent checks that the server saw no payment and no balance moved.
func (fx *payFixture) assertNothingSent(payer common.Address, payerBefore, sellerBefore *big.Int) {
	fx.t.Helper()
	if payments, _, _ := fx.seen(); len(payments) != 0 {
		fx.t.Errorf("the server got %d payments, want none", len(payments))
	}
	if a, s := fx.balances(payer); a.Cmp(payerBefore) != 0 || s.Cmp(sellerBefore) != 0 {
		fx.t.Errorf("balances moved: payer %s -> %s, seller %s -> %s", payerBefore, a, sellerBefore, s)
	}
}

func TestPaySignsNothingAboveMaxAndAtMostTenCentsWithoutIt(t *testing.T) {
	fx := newPayFixture(t, x402.Version2)
	payer := fx.c.Payers[0]
	fx.c.Approve(payer, contracts.Permit2Address, big.NewInt(1_000_000))
	payerBefore, sellerBefore := fx.balances(payer.Address)
	key := accountHex(payer)

	for _, tc := range []struct {
		name string
		args []string
		want []string
	}{
		{"a raw --max below the price", []string{"--max", "9999"}, []string{"asks 10000 (0.01 tokens)", "over --max of 9999 (0.009999 tokens)", "not signed"}},
		{"a dollar --max below the price", []string{"--max", "$0.009"}, []string{"asks 10000 (0.01 tokens)", "over --max of $0.009 (9000 raw units)"}},
		{"no --rpc and no --max", []string{"--rpc", ""}, []string{"without --max", "$0.10", "give --max in raw units", "asks 10000"}},
		{"no --rpc and a dollar --max", []string{"--rpc", "", "--max", "$1"}, []string{"--max $1 is a dollar amount", "give --max in raw units"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			args := append([]string{"pay", "--key", key, "--rpc", fx.c.RPCURL}, tc.args...)
			for _, mode := range []string{"", "--sign-only"} {
				a := append(append([]string(nil), args...), fx.url)
				if mode != "" {
					a = append([]string{a[0], mode}, a[1:]...)
				}
				stdout, _, err := runX402(t, "", a...)
				if err == nil {
					t.Fatalf("pay %s signed a payment over its --max: %s", strings.Join(a[1:], " "), stdout)
				}
				for _, w := range tc.want {
					if !strings.Contains(err.Error(), w) {
						t.Errorf("error %q does not say %q", err, w)
					}
				}
				if strings.Contains(stdout, "PAYMENT") {
					t.Errorf("pay printed a payment: %s", stdout)
				}
			}
			fx.assertNothingSent(payer.Address, payerBefore, sellerBefore)
		})
	}

	// Eleven cents is over the default, and paid when --max says so.
	fx.onlyPermit2(func(r *x402.PaymentRequirements) { r.Amount = "110000" })
	_, _, err := runX402(t, "", "pay", "--key", key, "--rpc", fx.c.RPCURL, fx.url)
	if err == nil || !strings.Contains(err.Error(), "asks 110000 (0.11 tokens)") || !strings.Contains(err.Error(), "over the default --max of $0.10 (100000 raw units)") {
		t.Fatalf("pay of $0.11 without --max: %v; want a refusal naming the default of $0.10", err)
	}
	fx.assertNothingSent(payer.Address, payerBefore, sellerBefore)
	if stdout, stderr, err := runX402(t, "", "pay", "--key", key, "--rpc", fx.c.RPCURL, "--max", "$0.11", fx.url); err != nil {
		t.Fatalf("pay --max $0.11 of $0.11: %v\n%s\n%s", err, stdout, stderr)
	}
	if a, s := fx.balances(payer.Address); new(big.Int).Sub(payerBefore, a).Int64() != 110000 || new(big.Int).Sub(s, sellerBefore).Int64() != 110000 {
		t.Errorf("payer %s -> %s, seller %s -> %s; want 110000 moved", payerBefore, a, sellerBefore, s)
	}
}

func TestPayRefusesAPermit2OfferNamingContractsOtherThanTheCanonicalOnes(t *testing.T) {
	hostile := "0xbadbadbadbadbadbadbadbadbadbadbadbadbad0"
	for _, tc := range []struct {
		name   string
		change func(*x402.PaymentRequirements)
		want   string
	}{
		{"a proxy of the server's choosing", func(r *x402.PaymentRequirements) { r.Extra.X402Permit2ProxyAddress = hostile }, "requirements.extra.x402Permit2ProxyAddress is " + common.HexToAddress(hostile).Hex()},
		{"a Permit2 of the server's choosing", func(r *x402.PaymentRequirements) { r.Extra.Permit2Address = hostile }, "requirements.extra.permit2Address is " + common.HexToAddress(hostile).Hex()},
	} {
		t.Run(tc.name, func(t *testing.T) {
			fx := newPayFixture(t, x402.Version2)
			payer := fx.c.PayerNoGas // not approved: the payment would carry a sponsoring permit for "Permit2"
			payerBefore, sellerBefore := fx.balances(payer.Address)
			fx.onlyPermit2(tc.change)
			for _, mode := range []string{"", "--sign-only"} {
				args := []string{"pay", "--key", accountHex(payer), "--rpc", fx.c.RPCURL, fx.url}
				if mode != "" {
					args = append([]string{"pay", mode}, args[1:]...)
				}
				stdout, _, err := runX402(t, "", args...)
				if err == nil || !strings.Contains(err.Error(), tc.want) || !strings.Contains(err.Error(), "not signed") {
					t.Fatalf("pay %s of an offer naming %s: %v (%s); want a refusal saying %q", mode, hostile, err, stdout, tc.want)
				}
			}
			fx.assertNothingSent(payer.Address, payerBefore, sellerBefore)
			if a := fx.c.Allowance(payer.Address, common.HexToAddress(hostile)); a.Sign() != 0 {
				t.Errorf("the hostile address may move %s of the payer's tokens", a)
			}
		})
	}
}

func TestPaySignsAPaymentValidAtMostMaxValidityAndRefusesOneThatNeverExpires(t *testing.T) {
	fx := newPayFixture(t, x402.Version2)
	payer := fx.c.Payers[1]
	fx.c.Approve(payer, contracts.Permit2Address, big.NewInt(commandPrice))
	// signedAt is the time a payment is dated from: the later of the chain's head and the wall clock (a block
	// may be sealed, and the clock cross a second, while pay runs).
	signedAt := func() int64 { return max(int64(fx.c.HeadTime()), time.Now().Unix()) }
	// deadline is how long past the time it was signed at the payment pay signs is valid, or the nearest to
	// want of the values the signing window allows.
	var want int64
	deadline := func(args ...string) (int64, string) {
		t.Helper()
		from := signedAt()
		stdout, stderr, err := runX402(t, "", append([]string{"pay", "--sign-only", "--key", accountHex(payer), "--rpc", fx.c.RPCURL}, append(args, fx.url)...)...)
		if err != nil {
			t.Fatalf("pay --sign-only %v: %v\n%s", args, err, stderr)
		}
		p, err := x402.DecodePaymentPayload(strings.TrimSpace(stdout))
		if err != nil {
			t.Fatal(err)
		}
		d, _ := new(big.Int).SetString(p.Payload.Permit2Authorization.Deadline, 10)
		to := signedAt()
		if got := d.Int64() - want; got >= from && got <= to {
			return want, stderr
		}
		return d.Int64() - to, stderr
	}

	fx.onlyPermit2(func(r *x402.PaymentRequirements) { r.MaxTimeoutSeconds = 100_000_000_000 })
	want = 600
	if got, stderr := deadline(); got != 600 || !strings.Contains(stderr, "the server asks for a payment valid 100000000000 s; signed valid for 10m0s") {
		t.Errorf("a 402 asking 10^11 s got a payment valid %d s after the chain's time, want 600 (the default cap), and a note:\n%s", got, stderr)
	}
	want = 120
	if got, _ := deadline("--max-validity", "2m"); got != 120 {
		t.Errorf("--max-validity 2m signed a payment valid %d s, want 120", got)
	}

	fx.onlyPermit2(func(r *x402.PaymentRequirements) { r.MaxTimeoutSeconds = 9223372036854775807 })
	stdout, _, err := runX402(t, "", "pay", "--key", accountHex(payer), "--rpc", fx.c.RPCURL, fx.url)
	if err == nil || !strings.Contains(err.Error(), "requirements.maxTimeoutSeconds") || !strings.Contains(err.Error(), "never expire") {
		t.Fatalf("pay of a 402 asking 2^63-1 s: %v (%s); want a refusal naming requirements.maxTimeoutSeconds", err, stdout)
	}
	if payments, _, _ := fx.seen(); len(payments) != 0 {
		t.Errorf("the server got %d payments, want none", len(payments))
	}
}
