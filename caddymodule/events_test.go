package caddymodule_test

import (
	"context"
	"net/http"
	"strings"
	"sync"
	"testing"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/ethereum/go-ethereum/common"

	"github.com/x402-gateway/caddy-x402/chain/chaintest"
	"github.com/x402-gateway/caddy-x402/x402"
)

func init() { caddy.RegisterModule(eventRecorder{}) }

// eventRecorder is an `events` handler that keeps what it is told.
type eventRecorder struct{}

type recordedEvent struct {
	name, origin string
	data         map[string]any
}

var recorded struct {
	sync.Mutex
	events []recordedEvent
}

func (eventRecorder) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{ID: "events.handlers.x402_test_recorder", New: func() caddy.Module { return new(eventRecorder) }}
}

func (*eventRecorder) UnmarshalCaddyfile(d *caddyfile.Dispenser) error { d.Next(); return nil }

func (*eventRecorder) Handle(_ context.Context, e caddy.Event) error {
	recorded.Lock()
	defer recorded.Unlock()
	origin := ""
	if e.Origin() != nil {
		origin = string(e.Origin().CaddyModule().ID)
	}
	recorded.events = append(recorded.events, recordedEvent{e.Name(), origin, e.Data})
	return nil
}

// takeEvents returns the events recorded since the last call.
func takeEvents() []recordedEvent {
	recorded.Lock()
	defer recorded.Unlock()
	ev := recorded.events
	recorded.events = nil
	return ev
}

// The gate reports payments through Caddy's events app: an `events` subscriber hears payment_verified and
// payment_settled (with the payer, the amount and the transaction) for a paid request, and payment_failed with
// the reason for the same payment presented again; an unpaid request is no payment event.
func TestTheGateEmitsPaymentEventsThatEventsSubscribersReceive(t *testing.T) {
	c := chaintest.New(t, chaintest.WithHTTP())
	t.Cleanup(commitPending(t, c))
	env := &gateEnv{t: t, c: c, payTo: common.HexToAddress("0x5e11e75e11e75e11e75e11e75e11e75e11e75e1"), net: x402.EIP155(c.ChainID.Uint64())}
	cf := strings.Replace(env.caddyfile(gateSetup{}), "{\n", "{\n\tevents {\n\t\ton payment_verified x402_test_recorder\n\t\ton payment_settled x402_test_recorder\n\t\ton payment_failed x402_test_recorder\n\t\ton payment_pending x402_test_recorder\n\t}\n", 1)
	env.srv = startCaddy(t, cf)
	takeEvents()

	if a := env.get("/"); a.status != http.StatusPaymentRequired {
		t.Fatalf("unpaid GET = %d, want 402", a.status)
	}
	if ev := takeEvents(); len(ev) != 0 {
		t.Errorf("an unpaid request was reported as %+v, want no payment event", ev)
	}

	payer := c.Payers[0]
	env.approvePermit2(payer)
	header := env.permit2Header("/", payer)
	a := env.get("/", x402.HeaderPaymentSignature, header)
	if a.status != http.StatusOK {
		t.Fatalf("paid GET = %d %q, want 200", a.status, a.body)
	}
	tx := settleResponse(t, a).Transaction
	ev := takeEvents()
	if len(ev) != 2 || ev[0].name != "payment_verified" || ev[1].name != "payment_settled" {
		t.Fatalf("a paid request was reported as %+v, want payment_verified then payment_settled", ev)
	}
	settled := ev[1]
	if settled.origin != "http.handlers.x402" || !strings.EqualFold(settled.data["payer"].(string), payer.Address.Hex()) ||
		settled.data["amount"] != "10000" || settled.data["transaction"] != tx || settled.data["network"] != env.net {
		t.Errorf("payment_settled = %+v, want origin http.handlers.x402, payer %s, amount 10000, transaction %s on %s",
			settled, payer.Address.Hex(), tx, env.net)
	}

	if a := env.get("/", x402.HeaderPaymentSignature, header); a.status == http.StatusOK {
		t.Fatalf("the same payment presented again was served: %d", a.status)
	}
	ev = takeEvents()
	if len(ev) != 1 || ev[0].name != "payment_failed" || ev[0].data["reason"] == "" || ev[0].data["reason"] == nil {
		t.Errorf("a payment presented again was reported as %+v, want one payment_failed naming the reason", ev)
	}
}

// With handle_errors in the site, a gate's 502 (here: the facilitator gone before /verify) is handed to it as an
// error, so the site's own error page answers with the gate's status; without, the gate's JSON body answers
// (the 502 tests of edges_test.go).
func TestAGates502GoesToHandleErrorsWhenTheSiteHasThem(t *testing.T) {
	c := chaintest.New(t, chaintest.WithHTTP())
	t.Cleanup(commitPending(t, c))
	remote := newRemoteFacilitator(t, c, 2, 0)
	env := startGateOn(t, c, gateSetup{facURL: remote.URL,
		site: "respond \"paid content\"\n\thandle_errors {\n\t\trespond \"the site's own error page: {err.status_code}\" {err.status_code}\n\t}"})
	payer := c.Payers[0]
	env.approvePermit2(payer)
	header := env.permit2Header("/", payer)
	remote.srv.Close()
	a := env.get("/", x402.HeaderPaymentSignature, header)
	if a.status != http.StatusBadGateway || a.body != "the site's own error page: 502" {
		t.Fatalf("paid GET with the facilitator gone = %d %q, want 502 from handle_errors", a.status, a.body)
	}
}
