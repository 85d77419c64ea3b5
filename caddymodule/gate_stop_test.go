package caddymodule_test

import (
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"

	"github.com/x402-gateway/caddy-x402/x402"
)

// Caddy's Stop does not wait for the requests of the servers it shuts down unless the process exits (a stop
// through the API in process, a reload to a config without this journal). A paid request still at work then
// writes its served mark after its response is out: the journal must still be open for it, or the payment buys
// its response again after the next start. Here the upstream holds a `settle async` request while Caddy stops;
// the response then goes out, and after a start on the same journal the payment is refused as used.
func TestAPaymentServedWhileCaddyStopsStaysServedAfterTheNextStart(t *testing.T) {
	up := newTestUpstream(t)
	s := gateSetup{gate: "\t\tsettle async\n", site: "reverse_proxy " + up.Addr}
	env := newGateEnv(t, s)
	payer := env.c.Payers[0]
	env.approvePermit2(payer)
	h := env.permit2Header("/", payer)

	entered, release := up.hold()
	answer := env.getAsync("/", x402.HeaderPaymentSignature, h)
	<-entered
	stopped := make(chan error, 1)
	go func() { stopped <- caddy.Stop() }()
	time.Sleep(300 * time.Millisecond) // Stop has closed what it closes without waiting
	release()
	if a := <-answer; a.status != http.StatusOK {
		t.Fatalf("the request at work while Caddy stopped = %d %q; want 200", a.status, a.body)
	}
	if err := <-stopped; err != nil {
		t.Fatalf("stopping Caddy: %v", err)
	}
	up.unhold()

	env.reload(s) // a start on the same journal
	again := env.get("/", x402.HeaderPaymentSignature, h)
	if again.status != http.StatusPaymentRequired || !strings.Contains(requiredError(t, again), x402.ReasonPaymentAlreadyUsed) {
		t.Fatalf("the payment presented after the restart = %d %q; want 402 %s (it bought its response before the stop)",
			again.status, again.body, x402.ReasonPaymentAlreadyUsed)
	}
	if n := up.calls.Load(); n != 1 {
		t.Fatalf("the upstream served %d times, want once", n)
	}
}
