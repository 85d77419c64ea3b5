package e2e

import (
	"context"
	"math/big"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/x402-gateway/caddy-x402/x402"
)

// The cluster through PgBouncer: the three gateways reach their journal through a PgBouncer of the test's own in
// transaction pooling mode (clusterSetup.pgbouncer), whose eight server connections their transactions share.

// TestClusterThroughPgBouncerServesEachPaymentOnceWhenAllThreeGatewaysGetIt fans 200 distinct payments of six
// payers out to the three gateways, each payment presented to all three at the same moment, eight payments at a
// time, the load starting as soon as the wallet leases are shared out. Every payment is answered 200 by exactly
// one gateway and refused by the other two with 402 payment_already_used; on chain, one transfer of the price to
// the seller per payment, the one its 200 named, the seller's balance moved by exactly 200 x the price and each
// payer's by its own payments; once drained, no journal record is left pending. On a store that prepares its
// statements, the gateways stop at start: "prepared statement ... already exists (SQLSTATE 42P05)".
func TestClusterThroughPgBouncerServesEachPaymentOnceWhenAllThreeGatewaysGetIt(t *testing.T) {
	c := startClusterWith(t, clusterSetup{payers: 6, pgbouncer: true})
	const n, atOnce = 200, 8
	payments := c.signMany(n)
	before, firstBlock := c.balances(), c.dev.head()
	start := time.Now()
	c.fanOutEach(payments, atOnce)
	elapsed := time.Since(start)
	t.Logf("%d payments, each to the %d gateways at once, %d at a time, through PgBouncer in %v (%.0f/s): %s", n, clusterGateways,
		atOnce, elapsed.Round(10*time.Millisecond), float64(n)/elapsed.Seconds(), describeCounts(countAnswers(payments, nil)))

	var wrong []string
	for _, p := range payments {
		for _, a := range p.answers {
			if a.status != http.StatusOK && !(a.status == http.StatusPaymentRequired && strings.HasPrefix(a.text, x402.ReasonPaymentAlreadyUsed)) {
				wrong = append(wrong, p.String())
				break
			}
		}
	}
	listFirst(t, "payments got an answer other than 200 or 402 payment_already_used", wrong, n)
	c.checkAccounts(payments, before, firstBlock)
	c.drain(new(big.Int).Add(before.seller, big.NewInt(n*clusterPrice)))
	if logins := strings.Count(c.bouncer.Log(), "login attempt"); logins < clusterGateways {
		t.Errorf("PgBouncer logged %d client logins, want at least one per gateway: the gateways did not go through it", logins)
	}
	for _, g := range c.gates {
		g.proc.stop()
	}
}

// fanOutEach presents each payment to every gateway at the same moment, atOnce payments at a time, once each.
func (c *cluster) fanOutEach(payments []*clusterPayment, atOnce int) {
	queue := make(chan *clusterPayment)
	var workers sync.WaitGroup
	for range atOnce {
		workers.Go(func() {
			for p := range queue {
				var wg sync.WaitGroup
				begin := make(chan struct{})
				for g := range c.gates {
					wg.Go(func() {
						<-begin
						ctx, cancel := context.WithTimeout(context.Background(), clusterRequestTimeout)
						defer cancel()
						c.present(ctx, p, g)
					})
				}
				close(begin)
				wg.Wait()
			}
		})
	}
	for _, p := range payments {
		queue <- p
	}
	close(queue)
	workers.Wait()
}

// TestClusterPostgreSQLRestartMidLoadThroughPgBouncerLosesAndDoublesNothing is
// TestClusterPostgreSQLRestartMidLoadLosesAndDoublesNothing with the gateways behind a PgBouncer in transaction
// mode, which stays up while PostgreSQL behind it stops for three seconds and starts again: what PgBouncer
// answers meanwhile (a server connection lost, "server login has been failing") is an unavailable database to
// the gateways, answered 502 or 503, never a refusal; every payment ends with exactly one 200, the seller's
// balance moved by exactly 200s x the price and each payer's by its own; and, once drained, nothing is pending.
func TestClusterPostgreSQLRestartMidLoadThroughPgBouncerLosesAndDoublesNothing(t *testing.T) {
	postgresOutageMidLoad(t, clusterSetup{payers: 6, pgbouncer: true}, 3*time.Second)
}
