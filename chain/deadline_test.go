package chain_test

import (
	"math/big"
	"strings"
	"testing"
	"time"

	"github.com/x402-gateway/caddy-x402/chain"
	"github.com/x402-gateway/caddy-x402/x402"
)

// TestAPaymentWhoseDeadlineLiesBeyondMaxTimeoutSecondsIsRefused: the resource server asked for a payment that
// expires within maxTimeoutSeconds; a deadline further than that plus the network's clock skew past chain time
// is refused at verification and at settlement, with nothing sent, and one within them passes. Requirements
// without a positive maxTimeoutSeconds are refused as invalid.
func TestAPaymentWhoseDeadlineLiesBeyondMaxTimeoutSecondsIsRefused(t *testing.T) {
	const skew = 20 * time.Second
	fx := newFixture(t, fixtureOpts{tune: func(_ *fixture, nc *chain.NetworkConfig) { nc.DeadlineSkew = skew }})
	payer := fx.c.Payers[0]
	fx.approvePermit2(payer)
	sent := func() (n uint64) {
		for _, w := range fx.c.Wallets {
			n += fx.c.TxCount(w.Address)
		}
		return n
	}
	for _, method := range []string{x402.TransferPermit2, x402.TransferERC2612} {
		for _, c := range []struct {
			name  string
			after time.Duration // the deadline past chain time, beyond maxTimeoutSeconds
			valid bool
		}{
			{"within the skew", skew / 2, true},
			{"a day beyond", 24 * time.Hour, false},
			{"just past the skew", skew + 5*time.Second, false},
		} {
			t.Run(method+", "+c.name, func(t *testing.T) {
				rq := fx.requirements(method)
				now := fx.chainNow()
				deadline := big.NewInt(now.Unix() + rq.MaxTimeoutSeconds + int64(c.after/time.Second))
				var req x402.VerifyRequest
				if method == x402.TransferPermit2 {
					req = fx.permit2(payer, rq, chain.Permit2Options{Now: now, Deadline: deadline})
				} else {
					req = fx.erc2612(payer, rq, chain.ERC2612Options{Now: now, Deadline: deadline})
				}
				v := fx.verify(req)
				if !c.valid {
					before := sent()
					if v.IsValid || v.InvalidReason != x402.ReasonValidBefore || !strings.Contains(v.InvalidMessage, "maxTimeoutSeconds") {
						t.Fatalf("verify = %+v; want %s naming maxTimeoutSeconds", v, x402.ReasonValidBefore)
					}
					s := fx.settle(req)
					if s.Success || s.ErrorReason != x402.ReasonValidBefore || s.Transaction != "" {
						t.Fatalf("settle = %+v; want %s with nothing sent", s, x402.ReasonValidBefore)
					}
					if n := sent() - before; n != 0 {
						t.Fatalf("the wallets sent %d transactions for a refused payment", n)
					}
					return
				}
				if !v.IsValid {
					t.Fatalf("verify = %+v; want valid (the deadline is within maxTimeoutSeconds and the skew)", v)
				}
				if s := fx.settle(req); !s.Success {
					t.Fatalf("settle = %+v; want settled", s)
				}
			})
		}
	}
	rq := fx.requirements(x402.TransferPermit2)
	req := fx.permit2(payer, rq, chain.Permit2Options{})
	req.PaymentRequirements.MaxTimeoutSeconds = 0
	if v := fx.verify(req); v.IsValid || v.InvalidReason != x402.ReasonInvalidPaymentRequirements {
		t.Fatalf("verify of requirements without maxTimeoutSeconds = %+v; want %s", v, x402.ReasonInvalidPaymentRequirements)
	}
}
