package caddymodule_test

import (
	"context"
	"net"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/caddyserver/caddy/v2"

	"github.com/x402-gateway/caddy-x402/chain/devchain"
	"github.com/x402-gateway/caddy-x402/chain/journal"
	"github.com/x402-gateway/caddy-x402/chain/journal/pgtest"
	"github.com/x402-gateway/caddy-x402/x402"
)

func TestAGateOnAPostgresJournalKeepsItsPaymentsInTheDatabase(t *testing.T) {
	dsn := pgtest.Shared(t)
	t.Setenv("X402_TEST_JOURNAL_DSN", dsn)
	d := startDevchainCommand(t, "--listen", "127.0.0.1:0")
	srv := startCaddy(t, `{
	x402 {
		dev_chain {
			rpc `+d.facts.RPC+`
		}
		journal {env.X402_TEST_JOURNAL_DSN}
	}
}

{{ADDR}} {
	x402 $0.01 {
		pay_to `+devchainSeller.Hex()+`
	}
	respond "paid"
}`)
	resp, settled := payDevchainRoute(t, d.facts.RPC, srv.URL+"/")

	// What the gate and its engine recorded is in the database, final, with the transaction, the gate's record
	// marked served; the gate's in-flight mark is gone.
	st, err := journal.OpenPostgres(context.Background(), dsn, journal.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	recs, err := st.Pending(context.Background())
	if err != nil || len(recs) != 0 {
		t.Fatalf("records left pending: %d, %v; want none", len(recs), err)
	}
	if n, err := st.Count(context.Background()); err != nil || n != 2 {
		t.Fatalf("the database holds %d records (%v); want 2: the gate's and the engine's", n, err)
	}
	if !strings.EqualFold(settled.Payer, devchain.PayerAddress.Hex()) {
		t.Errorf("settled payer %s, want %s", settled.Payer, devchain.PayerAddress.Hex())
	}
	// Presented again, the payment buys nothing: the served mark in the database says so.
	again, err := http.NewRequest(http.MethodGet, srv.URL+"/", nil)
	if err != nil {
		t.Fatal(err)
	}
	again.Header.Set(x402.HeaderPaymentSignature, resp.Request.Header.Get(x402.HeaderPaymentSignature))
	if again.Header.Get(x402.HeaderPaymentSignature) == "" {
		t.Fatal("the paid request carried no PAYMENT-SIGNATURE to present again")
	}
	r2, err := http.DefaultClient.Do(again)
	if err != nil {
		t.Fatal(err)
	}
	r2.Body.Close()
	if r2.StatusCode != http.StatusPaymentRequired {
		t.Errorf("the payment presented again = %d, want 402", r2.StatusCode)
	}
}

func TestAPostgresJournalThatCannotBeReachedStopsCaddyWithAnErrorHidingThePassword(t *testing.T) {
	caddyMu.Lock()
	defer caddyMu.Unlock()
	closed := freePortOf(t)
	cfg := adaptCaddyfile(t, `{
	x402 {
		dev_chain {
			listen 127.0.0.1:`+freePortOf(t)+`
		}
		journal postgres://x402:s3cret-pw@127.0.0.1:`+closed+`/x402?sslmode=disable&connect_timeout=2
	}
}

http://127.0.0.1:`+freePortOf(t)+` {
	x402 $0.01 {
		pay_to `+devchainSeller.Hex()+`
	}
	respond "paid"
}
`, t.TempDir())
	err := caddy.Load(cfg, true)
	_ = caddy.Stop()
	if err == nil {
		t.Fatal("Caddy started with a journal database that does not answer")
	}
	if strings.Contains(err.Error(), "s3cret-pw") {
		t.Fatalf("the error shows the database password: %v", err)
	}
	if !strings.Contains(err.Error(), "settlement journal postgres://x402:xxxxx@127.0.0.1:"+closed) {
		t.Fatalf("the error %q does not name the journal (password hidden)", err)
	}
}

func TestValidatingAPostgresJournalConnectsToNoDatabase(t *testing.T) {
	db, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	var accepted atomic.Int64
	go func() {
		for {
			c, err := db.Accept()
			if err != nil {
				return
			}
			accepted.Add(1)
			c.Close()
		}
	}()
	cfg := adaptCaddyfile(t, `{
	x402 {
		dev_chain {
			listen 127.0.0.1:`+freePortOf(t)+`
		}
		journal postgres://x402:pw@`+db.Addr().String()+`/x402?sslmode=disable
	}
}

http://127.0.0.1:`+freePortOf(t)+` {
	x402 $0.01 {
		pay_to `+devchainSeller.Hex()+`
	}
	respond "paid"
}`, t.TempDir())
	if err := caddy.Validate(mustConfig(t, cfg)); err != nil {
		t.Fatalf("caddy.Validate: %v", err)
	}
	if n := accepted.Load(); n != 0 {
		t.Fatalf("validation made %d connections to the journal's database, want none", n)
	}
}
