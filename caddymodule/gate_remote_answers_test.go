package caddymodule_test

import (
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/ethereum/go-ethereum/common"

	"github.com/x402-gateway/caddy-x402/chain/chaintest"
	"github.com/x402-gateway/caddy-x402/x402"
)

// scriptedFacilitator is a remote facilitator whose /settle answers as a script says, the first time it is
// asked about a payment; /supported, /verify and every later /settle go to a real engine (with its journal),
// whose settlement is the truth the script's answer may or may not tell.
type scriptedFacilitator struct {
	engine string

	mu     sync.Mutex
	script func(w http.ResponseWriter, r *http.Request, body []byte, forward func() (int, []byte)) // nil: forward
}

func (f *scriptedFacilitator) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	body, _ := io.ReadAll(r.Body)
	forward := func() (int, []byte) {
		status, answer, err := forwardTo(f.engine, r, body)
		if err != nil {
			return http.StatusBadGateway, []byte(`{"error":"engine unreachable"}`)
		}
		return status, answer
	}
	var script func(http.ResponseWriter, *http.Request, []byte, func() (int, []byte))
	if r.URL.Path == "/settle" {
		f.mu.Lock()
		script, f.script = f.script, nil
		f.mu.Unlock()
	}
	if script != nil {
		script(w, r, body, forward)
		return
	}
	status, answer := forward()
	writeAnswer(w, status, answer)
}

func (f *scriptedFacilitator) next(script func(w http.ResponseWriter, r *http.Request, body []byte, forward func() (int, []byte))) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.script = script
}

// rewritten forwards the settlement and answers it with one field of the engine's answer changed.
func rewritten(edit func(*x402.SettleResponse)) func(http.ResponseWriter, *http.Request, []byte, func() (int, []byte)) {
	return func(w http.ResponseWriter, _ *http.Request, _ []byte, forward func() (int, []byte)) {
		_, answer := forward()
		var resp x402.SettleResponse
		_ = json.Unmarshal(answer, &resp)
		edit(&resp)
		gateWriteJSON(w, http.StatusOK, resp)
	}
}

// hangUpOn closes the caller's connection without an answer.
func hangUpOn(w http.ResponseWriter) {
	if hj, ok := w.(http.Hijacker); ok {
		if conn, _, err := hj.Hijack(); err == nil {
			_ = conn.Close()
		}
	}
}

// A gate settles through a remote facilitator that answers /settle in every way a remote can. For each: the
// gate's status, whether the resource was served, and what the same payment gets when presented again (when
// the remote answers truthfully). A payment that may have settled is never answered with an offer to pay again:
// an answer that is no proof of settlement (no transaction, another network or payer), or no answer at all, is
// 502 "may have settled", and the payment presented again is served once it has settled, paid once.
func TestAGateReadsEveryWayARemoteFacilitatorCanAnswerASettlement(t *testing.T) {
	c := chaintest.New(t, chaintest.WithHTTP())
	t.Cleanup(commitPending(t, c))
	engine := newRemoteFacilitatorOf(t, c, c.Wallets[:2], 20*time.Second)
	remote := &scriptedFacilitator{engine: engine.URL}
	elsewhere := serveTest(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		gateWriteJSON(w, http.StatusOK, x402.SettleResponse{Success: true, Transaction: "0x" + strings.Repeat("ab", 32), Network: x402.EIP155(c.ChainID.Uint64())})
	}))
	env := startGateOn(t, c, gateSetup{facURL: serveTest(t, remote), gate: "\t\tfacilitator_timeout 1s\n"})
	const (
		served  = iota // 200, the content
		unknown        // 502, "may have settled"
		refused        // 402 with the refusal
	)
	rows := []struct {
		name    string
		script  func(http.ResponseWriter, *http.Request, []byte, func() (int, []byte))
		want    int
		settled bool // the script let the engine settle the payment
		again   int  // the same payment presented again, the remote now truthful
	}{
		{"success, well formed", nil, served, true, refused /* already bought its response */},
		{"success naming another network", rewritten(func(r *x402.SettleResponse) { r.Network = "eip155:1" }), unknown, true, served},
		{"success naming another payer", rewritten(func(r *x402.SettleResponse) { r.Payer = c.Payers[1].Address.Hex() }), unknown, true, served},
		{"success naming no transaction", rewritten(func(r *x402.SettleResponse) { r.Transaction = "" }), unknown, true, served},
		{"success for another amount", rewritten(func(r *x402.SettleResponse) { r.Amount = "1" }), unknown, true, served},
		// A facilitator keeps the transaction's hash on every failure after it broadcast: that transaction may
		// still mine (here it did), so the payment's outcome is unknown, whatever the reason says.
		{"failure naming the transaction it sent, its receipt not seen", rewritten(func(r *x402.SettleResponse) {
			r.Success, r.ErrorReason, r.ErrorMessage = false, x402.ReasonFailedToGetReceipt, "scripted: no receipt in time"
		}), unknown, true, served},
		{"unexpected failure naming the transaction it sent", rewritten(func(r *x402.SettleResponse) {
			r.Success, r.ErrorReason, r.ErrorMessage = false, x402.ReasonUnexpectedSettleError, "scripted: the node went away while waiting"
		}), unknown, true, served},
		{"refusal", func(w http.ResponseWriter, _ *http.Request, _ []byte, _ func() (int, []byte)) {
			gateWriteJSON(w, http.StatusOK, x402.SettleResponse{Success: false, Network: env.net, ErrorReason: x402.ReasonInsufficientFunds, ErrorMessage: "scripted refusal"})
		}, refused, false, served},
		// No wallet free to send it: the spec says retry in 1 to 2 seconds; nothing was sent, the payment stays
		// good, and a 402 would have the payer pay again for it.
		{"no settlement wallet free right now", func(w http.ResponseWriter, _ *http.Request, _ []byte, _ func() (int, []byte)) {
			gateWriteJSON(w, http.StatusOK, x402.SettleResponse{Success: false, Network: env.net, ErrorReason: x402.ReasonNoAvailableWallets,
				ErrorMessage: x402.MessageNoAvailableWallets + "; retry in 1 to 2 seconds"})
		}, unknown, false, served},
		{"5xx", func(w http.ResponseWriter, _ *http.Request, _ []byte, _ func() (int, []byte)) {
			http.Error(w, "overloaded", http.StatusServiceUnavailable)
		}, unknown, false, served},
		{"timeout before it acted", func(_ http.ResponseWriter, r *http.Request, _ []byte, _ func() (int, []byte)) {
			<-r.Context().Done()
		}, unknown, false, served},
		{"timeout after it settled", func(_ http.ResponseWriter, r *http.Request, _ []byte, forward func() (int, []byte)) {
			forward()
			<-r.Context().Done()
		}, unknown, true, served},
		{"connection cut after it settled", func(w http.ResponseWriter, _ *http.Request, _ []byte, forward func() (int, []byte)) {
			forward()
			hangUpOn(w)
		}, unknown, true, served},
		{"redirect to another host", func(w http.ResponseWriter, r *http.Request, _ []byte, _ func() (int, []byte)) {
			http.Redirect(w, r, elsewhere+"/settle", http.StatusTemporaryRedirect)
		}, unknown, false, served},
		{"garbage", func(w http.ResponseWriter, _ *http.Request, _ []byte, forward func() (int, []byte)) {
			forward()
			w.Header().Set("Content-Type", "application/json")
			_, _ = w.Write([]byte(`{"success": tru`))
		}, unknown, true, served},
		{"oversized", func(w http.ResponseWriter, _ *http.Request, _ []byte, forward func() (int, []byte)) {
			forward()
			w.Header().Set("Content-Type", "application/json")
			_, _ = w.Write([]byte(`{"success":true,"transaction":"` + strings.Repeat("0", 2<<20) + `"}`))
		}, unknown, true, served},
	}
	payer := c.Payers[0]
	env.approvePermit2(payer)
	for _, row := range rows {
		t.Run(row.name, func(t *testing.T) {
			env.t = t
			before := env.balances(payer)
			header := env.permit2Header("/", payer)
			remote.next(row.script)
			first := env.get("/", x402.HeaderPaymentSignature, header)
			check := func(when string, a gateAnswer, want int) {
				t.Helper()
				switch want {
				case served:
					if a.status != http.StatusOK || a.body != "paid content" {
						t.Errorf("%s: %d %.200q; want 200 with the content", when, a.status, a.body)
					}
				case unknown:
					if a.status != http.StatusBadGateway || !strings.Contains(a.body, "may have settled") || strings.Contains(a.body, "paid content") {
						t.Errorf("%s: %d %.300q; want 502 saying the payment may have settled, nothing served", when, a.status, a.body)
					}
				case refused:
					if a.status != http.StatusPaymentRequired || strings.Contains(a.body, "paid content") {
						t.Errorf("%s: %d %.200q; want 402, nothing served", when, a.status, a.body)
					}
				}
			}
			check("first presentation", first, row.want)
			if row.script != nil && strings.HasPrefix(row.name, "no settlement wallet") && first.header.Get("Retry-After") != "2" {
				t.Errorf("first presentation: Retry-After %q; want 2 (the spec's retry after 1 to 2 seconds)", first.header.Get("Retry-After"))
			}
			if row.settled {
				env.waitPaid(payer, before, 1)
			}
			again := env.get("/", x402.HeaderPaymentSignature, header)
			check("presented again", again, row.again)
			if row.again == served || row.settled {
				env.waitPaid(payer, before, 1)
			}
			env.assertPaid(payer, before, 1)
		})
	}
}

// A remote facilitator's no_available_wallets says nothing was sent, and the gate answers 502 "present the same
// payment again". The record says so too: the payment presented again is a fresh settlement, not a resend of
// one that may have reached the facilitator, so a refusal then (here the payer's funds went elsewhere meanwhile)
// is final, 402 with the facilitator's reason, not 502 "it may have settled, check the chain" for ever.
func TestAPaymentNoWalletCouldSendIsRefusedAsSuchWhenPresentedAgain(t *testing.T) {
	c := chaintest.New(t, chaintest.WithHTTP())
	t.Cleanup(commitPending(t, c))
	engine := newRemoteFacilitatorOf(t, c, c.Wallets[:2], 20*time.Second)
	remote := &scriptedFacilitator{engine: engine.URL}
	env := startGateOn(t, c, gateSetup{facURL: serveTest(t, remote)})
	payer := c.Payers[0]
	env.approvePermit2(payer)
	header := env.permit2Header("/", payer)
	remote.next(func(w http.ResponseWriter, _ *http.Request, _ []byte, _ func() (int, []byte)) {
		gateWriteJSON(w, http.StatusOK, x402.SettleResponse{Success: false, ErrorReason: x402.ReasonNoAvailableWallets,
			ErrorMessage: "scripted: every wallet is busy; retry in 1 to 2 seconds", Network: env.net, Payer: payer.Address.Hex()})
	})
	if a := env.get("/", x402.HeaderPaymentSignature, header); a.status != http.StatusBadGateway || a.header.Get("Retry-After") == "" {
		t.Fatalf("the payment no wallet could send = %d %q, want 502 with Retry-After", a.status, a.body)
	}
	// The payer's funds go elsewhere meanwhile: the facilitator now refuses the payment, before sending anything.
	c.TransferToken(payer, common.HexToAddress("0xd1a1d1a1d1a1d1a1d1a1d1a1d1a1d1a1d1a1d1a1"), c.TokenBalance(payer.Address))
	a := env.get("/", x402.HeaderPaymentSignature, header)
	if a.status != http.StatusPaymentRequired {
		t.Errorf("presented again after the facilitator sent nothing and now refuses it = %d %q; want 402 with the refusal", a.status, a.body)
	}
}

// A payment whose settlement sent nothing (no wallet was free) or was refused is settled afresh when presented
// again, and that settlement is recorded as requested before it is sent: if its answer is lost (the remote
// settled it and the connection was cut), the payment presented again is a resend, and a refusal then ("nonce
// already used", from a facilitator that settled it and keeps no journal) is no final answer, 502, never a 402
// telling the payer to pay again. The record is the journal's on disk, read by a Caddy started again; settle
// before and after alike.
func TestAPaymentSettledAfreshWhenPresentedAgainIsRecordedAsRequestedBeforeItIsSent(t *testing.T) {
	noWallet := func(w http.ResponseWriter, _ *http.Request, _ []byte, _ func() (int, []byte)) {
		gateWriteJSON(w, http.StatusOK, x402.SettleResponse{Success: false, ErrorReason: x402.ReasonNoAvailableWallets,
			ErrorMessage: "scripted: every wallet is busy; retry in 1 to 2 seconds"})
	}
	refusal := func(w http.ResponseWriter, _ *http.Request, _ []byte, _ func() (int, []byte)) {
		gateWriteJSON(w, http.StatusOK, x402.SettleResponse{Success: false, ErrorReason: x402.ReasonInsufficientFunds,
			ErrorMessage: "scripted: the payer's balance is short"})
	}
	for _, first := range []struct {
		name   string
		script func(http.ResponseWriter, *http.Request, []byte, func() (int, []byte))
		status int
	}{{"no wallet free", noWallet, http.StatusBadGateway}, {"refused", refusal, http.StatusPaymentRequired}} {
		for _, mode := range []string{"before", "after"} {
			t.Run(first.name+", settle "+mode, func(t *testing.T) {
				c := chaintest.New(t, chaintest.WithHTTP())
				t.Cleanup(commitPending(t, c))
				engine := newRemoteFacilitatorOf(t, c, c.Wallets[:2], 20*time.Second)
				remote := &scriptedFacilitator{engine: engine.URL}
				setup := gateSetup{facURL: serveTest(t, remote), gate: "\t\tsettle " + mode + "\n"}
				env := startGateOn(t, c, setup)
				payer := c.Payers[0]
				env.approvePermit2(payer)
				before := env.balances(payer)
				header := env.permit2Header("/", payer)

				remote.next(first.script)
				if a := env.get("/", x402.HeaderPaymentSignature, header); a.status != first.status {
					t.Fatalf("first presentation = %d %q, want %d", a.status, a.body, first.status)
				}
				// Caddy stops (its journal closes) and starts again on the same bbolt file.
				if err := caddy.Stop(); err != nil {
					t.Fatalf("stopping Caddy: %v", err)
				}
				http.DefaultClient.CloseIdleConnections()
				env.srv.load(env.caddyfile(setup))

				remote.next(func(w http.ResponseWriter, _ *http.Request, _ []byte, forward func() (int, []byte)) {
					forward()
					hangUpOn(w)
				})
				if a := env.get("/", x402.HeaderPaymentSignature, header); a.status != http.StatusBadGateway || !strings.Contains(a.body, "may have settled") {
					t.Fatalf("presented again, settled there and its answer lost = %d %q; want 502, it may have settled", a.status, a.body)
				}
				env.waitPaid(payer, before, 1)
				remote.next(func(w http.ResponseWriter, _ *http.Request, _ []byte, _ func() (int, []byte)) {
					gateWriteJSON(w, http.StatusOK, x402.SettleResponse{Success: false, ErrorReason: x402.ReasonPermit2InvalidNonce,
						ErrorMessage: "scripted: the Permit2 nonce was already used", Network: env.net, Payer: payer.Address.Hex()})
				})
				if a := env.get("/", x402.HeaderPaymentSignature, header); a.status != http.StatusBadGateway || !strings.Contains(a.body, "may have settled") {
					t.Errorf("presented again, refused as spent by the settlement whose answer was lost = %d %.200q; want 502, it may have settled", a.status, a.body)
				}
				if a := env.get("/", x402.HeaderPaymentSignature, header); a.status != http.StatusOK || a.body != "paid content" {
					t.Errorf("presented again, the facilitator answering from its journal = %d %.200q; want 200 with the content", a.status, a.body)
				}
				if a := env.get("/", x402.HeaderPaymentSignature, header); a.status != http.StatusPaymentRequired {
					t.Errorf("presented once more after it bought its response = %d %.200q; want 402", a.status, a.body)
				}
				env.assertPaid(payer, before, 1)
			})
		}
	}
}
