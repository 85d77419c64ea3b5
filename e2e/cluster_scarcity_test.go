package e2e

import (
	"math/big"
	"strings"
	"testing"
	"time"

	"github.com/x402-gateway/caddy-x402/x402"
)

// The cluster when wallets are scarce: fewer settlement wallets than a gateway's share would want, or fewer than
// gateways. A gateway that holds no free wallet when a payment it served must settle hands the settlement to
// one that does, through the journal; a payer is told no_available_wallets only when the whole cluster's wallets
// stayed busy.

// scarcityPayments is the number of payments of a fan-out run: the figure.
const scarcityPayments = 200

// handoffTaken is what a gateway logs when it takes a settlement another handed off.
const handoffTaken = "took a settlement another instance handed off"

// TestClusterOfFourWalletsSettlesEveryPaymentFannedOutToThreeGateways: three gateways share four wallets (the
// dev chain's 0-3), and the load starts as soon as each gateway answers its paid route, while the wallets are
// still being shared out. 200 distinct payments, each sent to all three gateways at once, 8 payments at a time:
// every payment is answered 200 in its fan-out by exactly one gateway, none is refused no_available_wallets,
// and the chain shows exactly one transfer of the price per payment.
func TestClusterOfFourWalletsSettlesEveryPaymentFannedOutToThreeGateways(t *testing.T) {
	fanOutUnderScarcity(t, 4, false)
}

// TestClusterOfTwoWalletsSettlesEveryPaymentFannedOutToThreeGateways is the fan-out with two wallets for three
// gateways: one gateway holds none, and the payments it holds settle through the two that do.
func TestClusterOfTwoWalletsSettlesEveryPaymentFannedOutToThreeGateways(t *testing.T) {
	fanOutUnderScarcity(t, 2, false)
}

// TestClusterOfTwoWalletsThroughPgBouncerSettlesEveryPaymentFannedOutToThreeGateways is the fan-out with two
// wallets, the gateways reaching their journal through PgBouncer in transaction mode: the hand-off needs no
// session of the database's (it is found by reading the journal, and moved by conditional updates).
func TestClusterOfTwoWalletsThroughPgBouncerSettlesEveryPaymentFannedOutToThreeGateways(t *testing.T) {
	fanOutUnderScarcity(t, 2, true)
}

func fanOutUnderScarcity(t *testing.T, wallets int, pgbouncer bool) {
	c := startClusterWith(t, clusterSetup{payers: 8, wallets: wallets, noLeaseWait: true, pgbouncer: pgbouncer})
	payments := c.signMany(scarcityPayments)
	before, firstBlock := c.balances(), c.dev.head()
	start := time.Now()
	c.fanOutEach(payments, 8)
	elapsed := time.Since(start)
	t.Logf("%d payments, each sent to the %d gateways at once, 8 at a time, in %v: %s", len(payments), clusterGateways,
		elapsed.Round(10*time.Millisecond), describeCounts(countAnswers(payments, nil)))
	t.Logf("the gateways logged %s", c.logged(handoffTaken, "no instance sharing the journal took"))
	if wallets < clusterGateways && strings.HasPrefix(c.logged(handoffTaken), "0×") {
		t.Errorf("no settlement was handed off, with %d wallets for %d gateways: one holds none, and the payments it holds must settle through the others", wallets, clusterGateways)
	}

	var without, refused []string
	for _, p := range payments {
		if p.paid == 0 {
			without = append(without, p.String())
		}
		for _, a := range p.answers {
			if strings.HasPrefix(a.text, x402.ReasonNoAvailableWallets) || strings.Contains(a.text, x402.MessageNoAvailableWallets) {
				refused = append(refused, p.String())
				break
			}
		}
	}
	listFirst(t, "payments got no 200 from any gateway of their fan-out", without, len(payments))
	listFirst(t, "payments were refused for want of a wallet", refused, len(payments))

	// A payment whose fan-out ended without a final answer (a settlement still pending) is presented again
	// until it has one: it must then be the 200 it paid for, once.
	for _, p := range payments {
		if p.paid == 0 && p.refused == "" {
			c.settle(p, 0, clusterRetryFor)
		}
	}
	c.checkAccounts(payments, before, firstBlock)
	c.drain(new(big.Int).Add(before.seller, big.NewInt(int64(scarcityPayments*clusterPrice))))
	for _, g := range c.gates {
		g.proc.stop()
	}
}
