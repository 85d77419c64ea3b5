package caddymodule_test

import (
	"context"
	"math/big"
	"net/http"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/ethereum/go-ethereum/common"

	"github.com/x402-gateway/caddy-x402/caddymodule"
	"github.com/x402-gateway/caddy-x402/chain"
	"github.com/x402-gateway/caddy-x402/chain/chaintest"
	"github.com/x402-gateway/caddy-x402/chain/journal"
	"github.com/x402-gateway/caddy-x402/internal/racepass"
	"github.com/x402-gateway/caddy-x402/x402"
)

// A reload that changes the price or the recipient leaves no gate offering the terms an async payment was
// served under. The payment is still settled, through a gate whose facilitator settles on its network, for the
// amount and to the recipient the payer signed: each exactly once, and the backlog drains.
func TestServedAsyncPaymentsSettleUnderTheirOwnTermsAfterAReloadChangesPriceAndRecipient(t *testing.T) {
	env := newGateEnv(t, gateSetup{remote: true, gate: "\t\tsettle async\n"})
	newPayTo := common.HexToAddress("0xb0b0b0b0b0b0b0b0b0b0b0b0b0b0b0b0b0b0b0b0")
	const newPrice = 2 * gatePrice
	payers := env.c.Payers[:3]
	type paid struct {
		payer  *chaintest.Account
		before *big.Int
		payTo  common.Address
		amount int64
		p      x402.PaymentPayload
	}
	var payments []paid
	for _, payer := range payers {
		env.approvePermit2(payer)
	}
	sellerBefore, newPayToBefore := env.c.TokenBalance(env.payTo), env.c.TokenBalance(newPayTo)
	resume := sync.OnceFunc(caddymodule.PauseBackgroundSettlement())
	t.Cleanup(resume)

	for i, terms := range []struct {
		gate   string
		payTo  common.Address
		amount int64
	}{
		{"\t\tsettle async\n", env.payTo, gatePrice},
		{"\t\tsettle async\n\t\tamount 20000\n", env.payTo, newPrice},
		{"\t\tsettle async\n\t\tamount 20000\n\t\tpay_to " + newPayTo.Hex() + "\n", newPayTo, newPrice},
	} {
		if i > 0 {
			env.reload(gateSetup{remote: true, gate: terms.gate})
		}
		rq := env.requirement("/", x402.TransferPermit2)
		if rq.Amount != big.NewInt(terms.amount).String() || !x402.SameAddress(rq.PayTo, terms.payTo.Hex()) {
			t.Fatalf("offer %d: %s to %s, want %d to %s", i, rq.Amount, rq.PayTo, terms.amount, terms.payTo.Hex())
		}
		payer := payers[i]
		p := env.signPermit2(payer, rq)
		before := env.c.TokenBalance(payer.Address)
		a := env.get("/", x402.HeaderPaymentSignature, gateEncode(t, p))
		if resp := settleResponse(t, a); a.status != http.StatusOK || resp.ErrorReason != x402.ReasonSettlementPending {
			t.Fatalf("payment %d: %d %+v, want served with settlement_pending", i, a.status, resp)
		}
		payments = append(payments, paid{payer, before, terms.payTo, terms.amount, p})
	}
	waitBacklog(t, 3)

	resume()
	waitBacklog(t, 0)
	for i, pm := range payments {
		rec := env.gateRecord(pm.p)
		if rec.State != journal.StateFinal || rec.Response == nil || !rec.Response.Success {
			t.Errorf("payment %d: its journal record is %s with %+v, want final and settled", i, rec.State, rec.Response)
		}
		if got := new(big.Int).Sub(pm.before, env.c.TokenBalance(pm.payer.Address)); got.Cmp(big.NewInt(pm.amount)) != 0 {
			t.Errorf("payment %d: the payer paid %s, want the %d it was served for", i, got, pm.amount)
		}
		if n := env.c.CountTokenTransfers(pm.payer.Address, pm.payTo); n != 1 {
			t.Errorf("payment %d: %d transfers to the recipient it was served for, want 1", i, n)
		}
	}
	if got := new(big.Int).Sub(env.c.TokenBalance(env.payTo), sellerBefore); got.Cmp(big.NewInt(gatePrice+newPrice)) != 0 {
		t.Errorf("the first recipient received %s, want %d (the payments served before the recipient changed)", got, gatePrice+newPrice)
	}
	if got := new(big.Int).Sub(env.c.TokenBalance(newPayTo), newPayToBefore); got.Cmp(big.NewInt(newPrice)) != 0 {
		t.Errorf("the new recipient received %s, want %d", got, newPrice)
	}
}

// When no configured gate's facilitator settles on the network of a served async payment any more, the payment
// cannot be settled; once its authorization has expired it is finished: final and failed in the journal, out of
// the backlog, and no longer held against its payer, whose next payment is served at once.
func TestAServedAsyncPaymentNoFacilitatorSettlesIsFinishedOnceItsAuthorizationExpires(t *testing.T) {
	racepass.Once(t, "its time is the wait for a deadline over a minute away (83 s); the background settlement that finishes the "+
		"payment, and the reloads around it, run under -race in the package's other settle async tests")
	// A deadline as soon as settle async serves a payment before settling it (a minute past the time its
	// settlement could be mined at, by the gate's clock with a remote facilitator), and a few seconds more.
	const gate = "\t\tsettle async\n\t\tmax_timeout 2m\n"
	env := newGateEnv(t, gateSetup{remote: true, gate: gate})
	payer := env.c.Payers[0]
	env.approvePermit2(payer)
	before := env.balances(payer)
	resume := sync.OnceFunc(caddymodule.PauseBackgroundSettlement())
	t.Cleanup(resume)

	soon := big.NewInt(max(int64(env.c.HeadTime())+1, time.Now().Unix()) + 60 + 5)
	p, err := chain.SignPermit2Payment(payer.Key, env.requirement("/", x402.TransferPermit2), env.c.ChainID,
		chain.Permit2Options{Now: env.chainNow(), Deadline: soon})
	if err != nil {
		t.Fatal(err)
	}
	if a := env.get("/", x402.HeaderPaymentSignature, gateEncode(t, p)); a.status != http.StatusOK || settleResponse(t, a).ErrorReason != x402.ReasonSettlementPending {
		t.Fatalf("the payment: %d %q, want served before it settles", a.status, a.body)
	}
	// The gate now takes payments on another network only, through the same facilitator.
	env.reload(gateSetup{remote: true, gate: gate + "\t\tnetwork eip155:1\n"})
	resume()
	waitBacklog(t, 1) // waiting for a facilitator of its network, not given up before its deadline

	deadline := p.Payload.Deadline()
	for limit := time.Now().Add(time.Until(deadline) + 45*time.Second); ; time.Sleep(100 * time.Millisecond) {
		if rec := env.gateRecord(p); rec.State == journal.StateFinal {
			if time.Now().Before(deadline) {
				t.Fatalf("the payment was finished at %s, before its deadline %s", time.Now(), deadline)
			}
			if rec.Response == nil || rec.Response.Success || rec.Response.ErrorReason != x402.ReasonPermit2DeadlineExpired {
				t.Fatalf("the finished payment's answer is %+v, want failed with %s", rec.Response, x402.ReasonPermit2DeadlineExpired)
			}
			break
		}
		if time.Now().After(limit) {
			t.Fatalf("the payment is still not final %s after its deadline", time.Since(deadline).Round(time.Second))
		}
	}
	waitBacklog(t, 0)
	if got := env.remote.settles.Load(); got != 0 {
		t.Errorf("the facilitator was asked to settle %d times, want 0", got)
	}
	env.assertPaid(payer, before, 0)

	// Back on the network: the payer owes nothing, so the next payment is served without waiting for the first.
	env.reload(gateSetup{remote: true, gate: gate})
	env.c.Commit() // no block for a minute: bring chain time, which the payer signs by, up to now
	next := env.getAsync("/", x402.HeaderPaymentSignature, env.permit2Header("/", payer))
	select {
	case a := <-next:
		if resp := settleResponse(t, a); a.status != http.StatusOK || resp.ErrorReason != x402.ReasonSettlementPending {
			t.Fatalf("the payer's next payment: %d %+v, want served at once with settlement_pending", a.status, resp)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the payer's next payment waits for the finished one to settle")
	}
	env.waitPaid(payer, before, 1)
}

// Without an embedded engine the gate prunes its journal itself: a final record goes ten minutes past its
// payment's deadline, and not before, however long ago it became final.
func TestARemoteGatePrunesFinalRecordsOnlyPastTheirDeadline(t *testing.T) {
	// The route allows deadlines up to two hours away (a facilitator refuses one past maxTimeoutSeconds).
	env := newGateEnv(t, gateSetup{remote: true, gate: "\t\tmax_timeout 2h\n"})
	payer := env.c.Payers[0]
	env.approvePermit2(payer)
	rq := env.requirement("/", x402.TransferPermit2)
	now := env.chainNow()
	var soon, late x402.PaymentPayload
	for _, p := range []struct {
		payload *x402.PaymentPayload
		in      time.Duration
	}{{&soon, 5 * time.Minute}, {&late, time.Hour}} {
		var err error
		*p.payload, err = chain.SignPermit2Payment(payer.Key, rq, env.c.ChainID,
			chain.Permit2Options{Now: now, Deadline: big.NewInt(now.Add(p.in).Unix())})
		if err != nil {
			t.Fatal(err)
		}
	}
	for _, p := range []x402.PaymentPayload{soon, late} {
		if a := env.get("/", x402.HeaderPaymentSignature, gateEncode(t, p)); a.status != http.StatusOK {
			t.Fatalf("paying: %d %q", a.status, a.body)
		}
		if rec := env.gateRecord(p); rec.State != journal.StateFinal || !rec.Deadline.Equal(p.Payload.Deadline()) {
			t.Fatalf("the gate's record is %s with deadline %s, want final with the payment's deadline %s", rec.State, rec.Deadline, p.Payload.Deadline())
		}
	}

	for _, step := range []struct {
		at         time.Time
		soon, late bool // kept
	}{
		{time.Now(), true, true},
		{soon.Payload.Deadline().Add(9 * time.Minute), true, true},
		{soon.Payload.Deadline().Add(11 * time.Minute), false, true},
		{late.Payload.Deadline().Add(11 * time.Minute), false, false},
	} {
		if _, err := caddymodule.PruneGateJournals(step.at); err != nil {
			t.Fatalf("pruning at %s: %v", step.at, err)
		}
		for _, c := range []struct {
			name string
			p    x402.PaymentPayload
			kept bool
		}{{"the payment due soon", soon, step.soon}, {"the payment due in an hour", late, step.late}} {
			if _, ok := env.gateRecordIfAny(c.p); ok != c.kept {
				t.Errorf("after pruning as at %s, the record of %s (deadline %s) is kept = %v, want %v",
					step.at.Format(time.TimeOnly), c.name, c.p.Payload.Deadline().Format(time.TimeOnly), ok, c.kept)
			}
		}
	}
}

// At start, a gate with a remote facilitator prunes the final records past their deadline that the journal
// holds; with an embedded engine it leaves pruning to the engine, which keeps final records a day.
func TestAtStartAGatePrunesExpiredRecordsOnlyWhenNoEngineDoes(t *testing.T) {
	for _, kind := range facilitatorKinds {
		t.Run(kind.name, func(t *testing.T) {
			env := newStoppedGateEnv(t)
			journalPath := filepath.Join(t.TempDir(), "journal.db")
			id := journal.PaymentID(env.net, "gate/permit2", env.c.Token.Hex(), env.c.Payers[0].Address.Hex(), "1")
			// A payment settled an hour ago, whose authorization expired an hour ago.
			hourAgo := time.Now().Add(-time.Hour)
			store, err := journal.OpenBolt(journalPath, journal.Options{Clock: func() time.Time { return hourAgo }})
			if err != nil {
				t.Fatal(err)
			}
			ctx := context.Background()
			_, claimed, err := store.Claim(ctx, journal.Record{ID: id, Network: env.net, Deadline: hourAgo, Owner: "earlier-process"})
			if err == nil && claimed {
				_, err = store.Update(ctx, id, func(r *journal.Record) error {
					r.State, r.Response = journal.StateFinal, &x402.SettleResponse{Success: true, Network: env.net}
					return nil
				})
			}
			if cerr := store.Close(); err == nil {
				err = cerr
			}
			if err != nil || !claimed {
				t.Fatalf("writing the journal: claimed %v, %v", claimed, err)
			}

			env.srv = startCaddy(t, env.caddyfile(gateSetup{remote: kind.remote, journal: journalPath}))
			store2, _, err := x402App(t).SettlementJournal()
			if err != nil {
				t.Fatal(err)
			}
			if !kind.remote {
				time.Sleep(300 * time.Millisecond)
				if _, ok, err := store2.Get(ctx, id); !ok || err != nil {
					t.Fatalf("with an embedded engine the record an hour final is gone (%v): the gate pruned the engine's journal", err)
				}
				return
			}
			for limit := time.Now().Add(5 * time.Second); ; time.Sleep(20 * time.Millisecond) {
				if _, ok, err := store2.Get(ctx, id); err == nil && !ok {
					break
				}
				if time.Now().After(limit) {
					t.Fatal("the final record an hour past its deadline is still in the journal 5s after the start")
				}
			}
		})
	}
}

// gateRecord returns the gate's journal record of a permit2 payment.
func (env *gateEnv) gateRecord(p x402.PaymentPayload) journal.Record {
	env.t.Helper()
	rec, ok := env.gateRecordIfAny(p)
	if !ok {
		env.t.Fatalf("the journal holds no record of the payment of %s", p.Payload.Permit2Authorization.From)
	}
	return rec
}

func (env *gateEnv) gateRecordIfAny(p x402.PaymentPayload) (journal.Record, bool) {
	env.t.Helper()
	store, _, err := x402App(env.t).SettlementJournal()
	if err != nil {
		env.t.Fatal(err)
	}
	auth := p.Payload.Permit2Authorization
	rec, ok, err := store.Get(context.Background(), journal.PaymentID(env.net, "gate/permit2", p.Accepted.Asset, auth.From, auth.Nonce))
	if err != nil {
		env.t.Fatal(err)
	}
	return rec, ok
}
