package chain_test

import (
	"context"
	"encoding/json"
	"fmt"
	"math/big"
	"sync"
	"testing"
	"time"

	"github.com/ethereum/go-ethereum/common/hexutil"

	"github.com/x402-gateway/caddy-x402/chain"
	"github.com/x402-gateway/caddy-x402/chain/chaintest"
	"github.com/x402-gateway/caddy-x402/chain/contracts"
	"github.com/x402-gateway/caddy-x402/chain/journal"
	"github.com/x402-gateway/caddy-x402/chain/journal/pgtest"
	"github.com/x402-gateway/caddy-x402/x402"
)

// The receiver's /settle actions (claim, settle, refund), as the SDK's server sends them, against the engine on
// the simulated chain with the real escrow.

// wire is the channel's configuration as the wire spells it.
func (b *batchRoute) wire() x402.ChannelConfig {
	return x402.ChannelConfig{Payer: b.cfg.Payer.Hex(), PayerAuthorizer: b.cfg.PayerAuthorizer.Hex(), Receiver: b.cfg.Receiver.Hex(),
		ReceiverAuthorizer: b.cfg.ReceiverAuthorizer.Hex(), Token: b.cfg.Token.Hex(), WithdrawDelay: int64(b.cfg.WithdrawDelay),
		Salt: hexutil.Encode(b.cfg.Salt[:])}
}

// claimOf is a claim of total under the voucher for ceiling signed by signer.
func (b *batchRoute) claimOf(signer *chaintest.Account, ceiling, total int64) x402.BatchVoucherClaim {
	return x402.BatchVoucherClaim{Voucher: x402.BatchClaimedVoucher{Channel: b.wire(), MaxClaimableAmount: fmt.Sprint(ceiling)},
		Signature: hexutil.Encode(b.c.SignVoucher(signer, b.id, big.NewInt(ceiling))), TotalClaimed: fmt.Sprint(total)}
}

// action is the /settle body of a receiver's action with payload pl, as the SDK's server builds it (requirements
// with amount 0, no timeout, an empty extra), decoded by the facilitator server's decoder.
func (b *batchRoute) action(t *testing.T, pl x402.BatchPayload) x402.BatchRequest {
	t.Helper()
	rq := map[string]any{"scheme": x402.SchemeBatchSettlement, "network": b.fx.net, "asset": b.token.Hex(), "amount": "0",
		"payTo": b.receiver.Address.Hex(), "maxTimeoutSeconds": 0, "extra": map[string]any{}}
	body, err := json.Marshal(map[string]any{"x402Version": 2, "paymentPayload": map[string]any{"x402Version": 2, "accepted": rq, "payload": pl},
		"paymentRequirements": rq})
	if err != nil {
		t.Fatal(err)
	}
	req, err := x402.DecodeBatchSettleRequest(body)
	if err != nil {
		t.Fatalf("the facilitator server's decoder refuses the action: %v\n%s", err, body)
	}
	return req
}

// refundOf is a refund of amount at nonce, with the payer's voucher for cumulative signed by signer, claiming
// claims first.
func (b *batchRoute) refundOf(signer *chaintest.Account, cumulative, amount, nonce int64, claims ...x402.BatchVoucherClaim) x402.BatchPayload {
	w := b.wire()
	return x402.BatchPayload{Type: x402.BatchRefund, ChannelConfig: &w, Amount: fmt.Sprint(amount), RefundNonce: fmt.Sprint(nonce),
		Claims: append([]x402.BatchVoucherClaim{}, claims...),
		Voucher: &x402.BatchVoucherFields{ChannelID: b.id.Hex(), MaxClaimableAmount: fmt.Sprint(cumulative),
			Signature: hexutil.Encode(b.c.SignVoucher(signer, b.id, big.NewInt(cumulative)))}}
}

func (b *batchRoute) settleOf() x402.BatchPayload {
	return x402.BatchPayload{Type: x402.BatchSettle, Receiver: b.receiver.Address.Hex(), Token: b.token.Hex()}
}

func (b *batchRoute) balances(t *testing.T) (payer, receiver int64) {
	t.Helper()
	return b.c.BalanceOf(b.token, b.payer.Address).Int64(), b.c.BalanceOf(b.token, b.receiver.Address).Int64()
}

// actionRoute is a batch route whose engine holds the receiver authorizer's key (it signs what the server leaves
// unsigned) and claims only when asked, on journal j.
func actionRoute(t *testing.T, j journal.Store) *batchRoute {
	return newBatchRoute(t, fixtureOpts{journal: j, autoCommit: 5 * time.Millisecond, receiptTimeout: 30 * time.Second,
		tune: func(_ *fixture, nc *chain.NetworkConfig) {
			claimsWhenAsked(nc, chaintest.DeriveAccount("authorizer", 0))
		}})
}

func TestBatchServerClaimsSettlesAndRefundsThroughTheEngineEachOnceBalancesExact(t *testing.T) {
	b := actionRoute(t, boltJournal(t))
	payer0, _ := b.balances(t)
	b.deposit(t, 10*batchPrice)
	sent := b.sentBy(t, b.c.Wallets)

	// The server claims the seven vouchers it was paid, leaving the claim's signature to the facilitator.
	claim := b.action(t, x402.BatchPayload{Type: x402.BatchClaim, Claims: []x402.BatchVoucherClaim{b.claimOf(b.payer, 7*batchPrice, 7*batchPrice)}})
	first := settleBatch(t, b.fx.f, claim)
	if !first.Success || first.Transaction == "" || first.Amount != fmt.Sprint(7*batchPrice) {
		t.Fatalf("claim: %+v", first)
	}
	if _, claimed := b.channelOnChain(t); claimed != 7*batchPrice {
		t.Fatalf("the channel's total claimed is %d, want %d", claimed, 7*batchPrice)
	}
	// Presented again (the server's answer was lost): answered from the record, nothing sent.
	if again := settleBatch(t, b.fx.f, claim); !again.Success || again.Transaction != first.Transaction {
		t.Fatalf("the claim presented again: %+v, want the first answer %s", again, first.Transaction)
	}
	// settle pays the receiver what was claimed; again, from its record.
	st := settleBatch(t, b.fx.f, b.action(t, b.settleOf()))
	if !st.Success || st.Transaction == "" || st.Amount != fmt.Sprint(7*batchPrice) {
		t.Fatalf("settle: %+v", st)
	}
	if again := settleBatch(t, b.fx.f, b.action(t, b.settleOf())); !again.Success || again.Transaction != st.Transaction {
		t.Fatalf("the settle presented again: %+v, want %s", again, st.Transaction)
	}
	// The payer's refund of the rest, enriched by the server: its claim is the one mined already.
	refund := b.action(t, b.refundOf(b.payer, 7*batchPrice, 3*batchPrice, 0, b.claimOf(b.payer, 7*batchPrice, 7*batchPrice)))
	rf := settleBatch(t, b.fx.f, refund)
	if !rf.Success || rf.Amount != fmt.Sprint(3*batchPrice) || rf.Extra == nil || rf.Extra.ChannelState == nil ||
		rf.Extra.ChannelState.Balance != fmt.Sprint(7*batchPrice) || rf.Extra.ChannelState.RefundNonce != "1" {
		t.Fatalf("refund: %+v (extra %+v)", rf, rf.Extra)
	}
	if again := settleBatch(t, b.fx.f, refund); !again.Success || again.Transaction != rf.Transaction || again.Amount != rf.Amount {
		t.Fatalf("the refund presented again: %+v, want %s", again, rf.Transaction)
	}
	payer, receiver := b.balances(t)
	if payer != payer0-7*batchPrice || receiver != 7*batchPrice {
		t.Fatalf("the payer holds %d (want %d) and the receiver %d (want %d)", payer, payer0-7*batchPrice, receiver, 7*batchPrice)
	}
	if got := b.sentBy(t, b.c.Wallets) - sent; got != 3 {
		t.Fatalf("the actions sent %d transactions, want 3 (claim, settle, refund)", got)
	}
}

func TestBatchActionRefusalsSendNothing(t *testing.T) {
	b := actionRoute(t, boltJournal(t))
	b.deposit(t, 10*batchPrice)
	stranger := chaintest.DeriveAccount("stranger", 0)
	// Claimed to 2 already: a claim at or below it would send a transaction that claims nothing.
	if resp := settleBatch(t, b.fx.f, b.action(t, x402.BatchPayload{Type: x402.BatchClaim, Claims: []x402.BatchVoucherClaim{b.claimOf(b.payer, 2*batchPrice, 2*batchPrice)}})); !resp.Success {
		t.Fatalf("the first claim: %+v", resp)
	}
	// A route whose engine holds no authorizer key.
	keyless := b.engine(t, boltJournal(t), b.c.Wallets[len(b.c.Wallets)-1:], false, 5*time.Second)
	claimOf := func(c ...x402.BatchVoucherClaim) x402.BatchPayload {
		return x402.BatchPayload{Type: x402.BatchClaim, Claims: c}
	}
	for _, tc := range []struct {
		name   string
		f      *chain.Facilitator
		pl     x402.BatchPayload
		reason string
	}{
		{"a claim over more than its voucher allows", nil, claimOf(b.claimOf(b.payer, 3*batchPrice, 4*batchPrice)), x402.ReasonBatchChargeExceedsSignedCumulative},
		{"a claim of a voucher another key signed", nil, claimOf(b.claimOf(stranger, 3*batchPrice, 3*batchPrice)), x402.ReasonBatchInvalidVoucherSignature},
		{"a claim above the deposit", nil, claimOf(b.claimOf(b.payer, 11*batchPrice, 11*batchPrice)), x402.ReasonBatchClaimSimulationFailed},
		{"a claim nobody signed, to a facilitator without the authorizer's key", keyless, claimOf(b.claimOf(b.payer, 3*batchPrice, 3*batchPrice)), x402.ReasonBatchAuthorizerNotConfigured},
		{"a settle with nothing claimed", nil, x402.BatchPayload{Type: x402.BatchSettle, Receiver: stranger.Address.Hex(), Token: b.token.Hex()}, x402.ReasonBatchNothingToSettle},
		{"a refund signed by another payer", nil, b.refundOf(stranger, 0, batchPrice, 0), x402.ReasonBatchInvalidVoucherSignature},
		{"a refund at a nonce not the channel's next", nil, b.refundOf(b.payer, 0, batchPrice, 1), x402.ReasonBatchRefundPayload},
		{"a refund whose claims take all the deposit", nil, b.refundOf(b.payer, 10*batchPrice, batchPrice, 0, b.claimOf(b.payer, 10*batchPrice, 10*batchPrice)), x402.ReasonBatchRefundNoBalance},
		{"a refund whose claim is of another channel's voucher", nil, b.refundOf(b.payer, 0, batchPrice, 0, b.ofPayer(1).claimOf(b.c.Payers[1], batchPrice, batchPrice)), x402.ReasonBatchChannelIDMismatch},
		{"a refund of no amount", nil, b.refundOf(b.payer, 0, 0, 0), x402.ReasonBatchRefundAmountInvalid},
		{"a claim of nothing more than is claimed", nil, claimOf(b.claimOf(b.payer, 3*batchPrice, 2*batchPrice)), x402.ReasonBatchCumulativeBelowClaimed},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := tc.f
			if f == nil {
				f = b.fx.f
			}
			sent := b.sentBy(t, b.c.Wallets)
			payer, receiver := b.balances(t)
			resp := settleBatch(t, f, b.action(t, tc.pl))
			if resp.Success || resp.ErrorReason != tc.reason || resp.Transaction != "" {
				t.Fatalf("%+v, want refused with %s and no transaction", resp, tc.reason)
			}
			if got := b.sentBy(t, b.c.Wallets) - sent; got != 0 {
				t.Fatalf("a refused action sent %d transactions", got)
			}
			if p, r := b.balances(t); p != payer || r != receiver {
				t.Fatalf("balances moved: payer %d -> %d, receiver %d -> %d", payer, p, receiver, r)
			}
		})
	}
}

func TestBatchRefundThatWouldLeaveVouchersAcceptedHereUnclaimedIsRefused(t *testing.T) {
	b := actionRoute(t, boltJournal(t))
	b.deposit(t, 10*batchPrice)
	for i := int64(1); i <= 4; i++ {
		if resp := settleBatch(t, b.fx.f, b.voucher(b.rq, i*batchPrice)); !resp.Success {
			t.Fatalf("voucher %d: %+v", i, resp)
		}
	}
	sent := b.sentBy(t, b.c.Wallets)
	// The payer's refund carrying an older voucher: the four responses served would go unpaid.
	resp := settleBatch(t, b.fx.f, b.action(t, b.refundOf(b.payer, 2*batchPrice, 8*batchPrice, 0, b.claimOf(b.payer, 2*batchPrice, 2*batchPrice))))
	if resp.Success || resp.ErrorReason != x402.ReasonBatchCumulativeAmountMismatch {
		t.Fatalf("a refund below what was accepted: %+v", resp)
	}
	if got := b.sentBy(t, b.c.Wallets) - sent; got != 0 {
		t.Fatalf("sent %d transactions", got)
	}
	// Claiming what was accepted, it goes, and returns exactly the rest.
	payer0, _ := b.balances(t)
	resp = settleBatch(t, b.fx.f, b.action(t, b.refundOf(b.payer, 4*batchPrice, 6*batchPrice, 0, b.claimOf(b.payer, 4*batchPrice, 4*batchPrice))))
	if !resp.Success || resp.Amount != fmt.Sprint(6*batchPrice) {
		t.Fatalf("the refund claiming what was accepted: %+v", resp)
	}
	if payer, _ := b.balances(t); payer != payer0+6*batchPrice {
		t.Fatalf("the payer holds %d, want %d", payer, payer0+6*batchPrice)
	}
	// The journal's row follows the chain: no voucher is taken above what is left.
	if row := b.row(t, b.fx.journal); row.Deposit.Int64() != 4*batchPrice || row.Claimed.Int64() != 4*batchPrice {
		t.Fatalf("row after the refund: deposit %s, claimed %s", row.Deposit, row.Claimed)
	}
	if resp := settleBatch(t, b.fx.f, b.voucher(b.rq, 5*batchPrice)); resp.Success {
		t.Fatalf("a voucher above what the refund left was accepted: %+v", resp)
	}
}

func TestBatchClaimAndRefundRacingOnOneChannelNeitherRevertsAndTheTokensAddUp(t *testing.T) {
	for round := range 8 {
		t.Run(fmt.Sprint(round), func(t *testing.T) {
			// A block every 300ms: both actions are simulated and sent within one block unless one waits for the
			// other's receipt.
			b := newBatchRoute(t, fixtureOpts{journal: boltJournal(t), autoCommit: 300 * time.Millisecond, receiptTimeout: 30 * time.Second,
				tune: func(_ *fixture, nc *chain.NetworkConfig) {
					claimsWhenAsked(nc, chaintest.DeriveAccount("authorizer", 0))
				}})
			payer0, _ := b.balances(t)
			b.deposit(t, 10*batchPrice)
			sent := b.sentBy(t, b.c.Wallets)
			// The claim takes the channel to 6; the refund claims it to 3 and asks for all the rest.
			claim := b.action(t, x402.BatchPayload{Type: x402.BatchClaim, Claims: []x402.BatchVoucherClaim{b.claimOf(b.payer, 6*batchPrice, 6*batchPrice)}})
			refund := b.action(t, b.refundOf(b.payer, 3*batchPrice, 7*batchPrice, 0, b.claimOf(b.payer, 3*batchPrice, 3*batchPrice)))
			var wg sync.WaitGroup
			var rc, rr x402.BatchSettleResponse
			wg.Add(2)
			go func() { defer wg.Done(); rc, _ = b.fx.f.SettleBatch(context.Background(), claim) }()
			go func() { defer wg.Done(); rr, _ = b.fx.f.SettleBatch(context.Background(), refund) }()
			wg.Wait()
			if !rr.Success {
				t.Fatalf("the refund: %+v", rr)
			}
			_, claimed := b.channelOnChain(t)
			want := int64(1)
			switch {
			case rc.Success: // the claim first: the refund returned what it left
				want = 2
				if claimed != 6*batchPrice || rr.Amount != fmt.Sprint(4*batchPrice) {
					t.Fatalf("claim first: claimed %d, refunded %s", claimed, rr.Amount)
				}
			case rc.ErrorReason == x402.ReasonBatchClaimSimulationFailed: // the refund first: the claim is refused unsent
				if claimed != 3*batchPrice || rr.Amount != fmt.Sprint(7*batchPrice) {
					t.Fatalf("refund first: claimed %d, refunded %s", claimed, rr.Amount)
				}
			default:
				t.Fatalf("the claim: %+v", rc)
			}
			if got := b.sentBy(t, b.c.Wallets) - sent; got != uint64(want) {
				t.Fatalf("sent %d transactions, want %d (nothing that reverts)", got, want)
			}
			balance, _ := b.channelOnChain(t)
			if payer, _ := b.balances(t); payer+balance != payer0 {
				t.Fatalf("the payer holds %d and the channel %d: %d went missing of %d", payer, balance, payer0-payer-balance, payer0)
			}
		})
	}
}

func TestBatchClaimWhileTheChannelsDepositIsInFlightIsRefusedUnsentThenGoesOnceMined(t *testing.T) {
	b := newBatchRoute(t, fixtureOpts{journal: boltJournal(t), receiptTimeout: 100 * time.Millisecond,
		tune: func(_ *fixture, nc *chain.NetworkConfig) {
			claimsWhenAsked(nc, chaintest.DeriveAccount("authorizer", 0))
		}})
	b.deposit(t, 2*batchPrice)
	// A top-up through the engine, broadcast and not mined.
	if resp := settleBatch(t, b.fx.f, b.depositRequest(t, 8*batchPrice)); resp.Success || resp.ErrorReason != x402.ReasonSettlementPending {
		t.Fatalf("the top-up, not mined: %+v", resp)
	}
	sent := b.sentBy(t, b.c.Wallets)
	claim := b.action(t, x402.BatchPayload{Type: x402.BatchClaim, Claims: []x402.BatchVoucherClaim{b.claimOf(b.payer, 5*batchPrice, 5*batchPrice)}})
	if resp := settleBatch(t, b.fx.f, claim); resp.Success || resp.ErrorReason != x402.ReasonBatchClaimSimulationFailed {
		t.Fatalf("a claim above the deposit mined: %+v", resp)
	}
	if got := b.sentBy(t, b.c.Wallets) - sent; got != 0 {
		t.Fatalf("sent %d transactions", got)
	}
	b.c.Commit()
	stop := b.c.AutoCommit(5 * time.Millisecond)
	defer stop()
	var resp x402.BatchSettleResponse
	for range 50 {
		if resp = settleBatch(t, b.fx.f, claim); resp.ErrorReason != x402.ReasonSettlementPending {
			break
		}
	}
	if !resp.Success {
		t.Fatalf("the claim once the top-up mined: %+v", resp)
	}
	if _, claimed := b.channelOnChain(t); claimed != 5*batchPrice {
		t.Fatalf("claimed %d, want %d", claimed, 5*batchPrice)
	}
}

func TestBatchActionBroadcastByAProcessGoneBeforeItWasMinedIsAnsweredOnceByTheNext(t *testing.T) {
	dsn := pgtest.Shared(t)
	b := newBatchRoute(t, fixtureOpts{journal: openPostgres(t, dsn), wallets: 2})
	b.deposit(t, 10*batchPrice)
	wallets := b.c.Wallets[:2]
	sent := b.sentBy(t, wallets)
	claim := b.action(t, x402.BatchPayload{Type: x402.BatchClaim, Claims: []x402.BatchVoucherClaim{b.claimOf(b.payer, 4*batchPrice, 4*batchPrice)}})
	// A process sends the claim and is gone before it is mined.
	first := b.engine(t, openPostgres(t, dsn), wallets, true, 50*time.Millisecond)
	resp := settleLeased(first, claim)
	if resp.ErrorReason != x402.ReasonSettlementPending || resp.Transaction == "" {
		t.Fatalf("the claim, not mined: %+v", resp)
	}
	first.Close()
	// The next process is given the same claim: it finds the transaction, sends nothing, answers once mined.
	next := b.engine(t, openPostgres(t, dsn), wallets, true, 5*time.Second)
	stop := b.c.AutoCommit(5 * time.Millisecond)
	defer stop()
	again := settleBatch(t, next, claim)
	if !again.Success || again.Transaction != resp.Transaction {
		t.Fatalf("the claim presented to the next process: %+v, want success of %s", again, resp.Transaction)
	}
	if got := b.sentBy(t, wallets) - sent; got != 1 {
		t.Fatalf("the processes sent %d transactions, want 1", got)
	}
	if _, claimed := b.channelOnChain(t); claimed != 4*batchPrice {
		t.Fatalf("claimed %d, want %d", claimed, 4*batchPrice)
	}
}

func TestBatchClaimAndRefundRacingOnOneChannelAtTwoGatewaysOfOnePostgresNeitherReverts(t *testing.T) {
	dsn := pgtest.Shared(t)
	for round := range 5 {
		t.Run(fmt.Sprint(round), func(t *testing.T) {
			// A block every 300ms: both actions are simulated and sent within one block unless one waits for the
			// other's receipt.
			b := newBatchRoute(t, fixtureOpts{journal: openPostgres(t, dsn), wallets: 3, autoCommit: 300 * time.Millisecond, receiptTimeout: 30 * time.Second})
			payer0, _ := b.balances(t)
			b.deposit(t, 10*batchPrice)
			// Every process is configured with the same wallets, and leases its share.
			wallets := b.c.Wallets[:3]
			gwA := b.engine(t, openPostgres(t, dsn), wallets, true, 30*time.Second)
			gwB := b.engine(t, openPostgres(t, dsn), wallets, true, 30*time.Second)
			sent := b.sentBy(t, wallets)
			// Each gateway has its wallet before the race (a claim above the deposit is refused after it took one).
			above := b.action(t, x402.BatchPayload{Type: x402.BatchClaim, Claims: []x402.BatchVoucherClaim{b.claimOf(b.payer, 11*batchPrice, 11*batchPrice)}})
			for _, gw := range []*chain.Facilitator{gwA, gwB} {
				if resp := settleLeased(gw, above); resp.ErrorReason != x402.ReasonBatchClaimSimulationFailed {
					t.Fatalf("warming up: %+v", resp)
				}
			}
			claim := b.action(t, x402.BatchPayload{Type: x402.BatchClaim, Claims: []x402.BatchVoucherClaim{b.claimOf(b.payer, 6*batchPrice, 6*batchPrice)}})
			refund := b.action(t, b.refundOf(b.payer, 3*batchPrice, 7*batchPrice, 0, b.claimOf(b.payer, 3*batchPrice, 3*batchPrice)))
			var wg sync.WaitGroup
			var rc, rr x402.BatchSettleResponse
			wg.Add(2)
			go func() { defer wg.Done(); rc = settleLeased(gwA, claim) }()
			go func() { defer wg.Done(); rr = settleLeased(gwB, refund) }()
			wg.Wait()
			if !rr.Success {
				t.Fatalf("the refund: %+v", rr)
			}
			want := uint64(1)
			if rc.Success {
				want = 2
			} else if rc.ErrorReason != x402.ReasonBatchClaimSimulationFailed {
				t.Fatalf("the claim: %+v", rc)
			}
			if got := b.sentBy(t, wallets) - sent; got != want {
				t.Fatalf("sent %d transactions, want %d (nothing that reverts); claim %+v", got, want, rc)
			}
			balance, claimed := b.channelOnChain(t)
			payer, receiver := b.balances(t)
			if payer+balance != payer0 || receiver != 0 || claimed != balance {
				t.Fatalf("payer %d, channel balance %d claimed %d: the payer started with %d", payer, balance, claimed, payer0)
			}
		})
	}
}

// settleLeased settles req at f, asking again while f has not leased its settlement wallet yet (the processes
// sharing a journal share the wallets out as they start).
func settleLeased(f *chain.Facilitator, req x402.BatchRequest) x402.BatchSettleResponse {
	var resp x402.BatchSettleResponse
	for range 40 {
		var err error
		if resp, err = f.SettleBatch(context.Background(), req); err != nil || resp.ErrorReason != x402.ReasonNoAvailableWallets {
			break
		}
		time.Sleep(250 * time.Millisecond)
	}
	return resp
}

func TestBatchRefundVerifiedAsTheSDKsServerAsksTellsTheChannelAndRefusesAnotherPayers(t *testing.T) {
	b := actionRoute(t, boltJournal(t))
	b.deposit(t, 10*batchPrice)
	refund := func(signer *chaintest.Account, cumulative int64) x402.BatchRequest {
		req := b.voucher(b.rq, cumulative)
		req.PaymentPayload.Payload.Type = x402.BatchRefund
		req.PaymentPayload.Payload.Voucher.Signature = hexutil.Encode(b.c.SignVoucher(signer, b.id, big.NewInt(cumulative)))
		return req
	}
	// The server keeps the charges (nothing accepted here): the payer's voucher at what it was charged is valid,
	// and the answer tells the channel as the chain has it, its refund nonce too.
	v, err := b.fx.f.VerifyBatch(context.Background(), refund(b.payer, 3*batchPrice))
	if err != nil || !v.IsValid {
		t.Fatalf("the payer's refund: %+v, %v", v, err)
	}
	var st x402.BatchChannelState
	if err := json.Unmarshal(v.Extra, &st); err != nil || st.Balance != fmt.Sprint(10*batchPrice) || st.TotalClaimed != "0" || st.RefundNonce != "0" || st.ChannelID != b.id.Hex() {
		t.Fatalf("the refund's verification tells %s (%v)", v.Extra, err)
	}
	for _, tc := range []struct {
		name       string
		signer     *chaintest.Account
		cumulative int64
		reason     string
	}{
		{"signed by another payer", chaintest.DeriveAccount("stranger", 0), 3 * batchPrice, x402.ReasonBatchInvalidVoucherSignature},
		{"above the deposit", b.payer, 11 * batchPrice, x402.ReasonBatchCumulativeExceedsBalance},
	} {
		if v, err := b.fx.f.VerifyBatch(context.Background(), refund(tc.signer, tc.cumulative)); err != nil || v.IsValid || v.InvalidReason != tc.reason {
			t.Errorf("a refund %s: %+v, %v; want %s", tc.name, v, err, tc.reason)
		}
	}
	// Once this engine accepted vouchers on the channel, the refund's voucher must be the last of them.
	for i := int64(1); i <= 2; i++ {
		if resp := settleBatch(t, b.fx.f, b.voucher(b.rq, i*batchPrice)); !resp.Success {
			t.Fatalf("voucher %d: %+v", i, resp)
		}
	}
	if v, _ := b.fx.f.VerifyBatch(context.Background(), refund(b.payer, batchPrice)); v.IsValid || v.InvalidReason != x402.ReasonBatchCumulativeAmountMismatch {
		t.Errorf("a refund below the vouchers accepted here: %+v", v)
	}
	if v, _ := b.fx.f.VerifyBatch(context.Background(), refund(b.payer, 2*batchPrice)); !v.IsValid {
		t.Errorf("a refund at the last voucher accepted here: %+v", v)
	}
}

// payerRefund is the payer's own refund request at cumulative (the voucher it was last charged), signed by
// signer, to the route: what a client sends the route's server.
func (b *batchRoute) payerRefund(signer *chaintest.Account, cumulative int64) x402.BatchRequest {
	req := b.voucher(b.rq, cumulative)
	req.PaymentPayload.Payload.Type = x402.BatchRefund
	req.PaymentPayload.Payload.Voucher.Signature = hexutil.Encode(b.c.SignVoucher(signer, b.id, big.NewInt(cumulative)))
	return req
}

func TestBatchPayersRefundToTheEngineReturnsExactlyWhatWasNotChargedOnce(t *testing.T) {
	b := actionRoute(t, boltJournal(t))
	payer0, _ := b.balances(t)
	b.deposit(t, 10*batchPrice)
	for i := int64(1); i <= 3; i++ {
		if resp := settleBatch(t, b.fx.f, b.voucher(b.rq, i*batchPrice)); !resp.Success {
			t.Fatalf("voucher %d: %+v", i, resp)
		}
	}
	sent := b.sentBy(t, b.c.Wallets)
	for _, tc := range []struct {
		name   string
		req    x402.BatchRequest
		reason string
	}{
		{"signed by another payer", b.payerRefund(chaintest.DeriveAccount("stranger", 0), 3*batchPrice), x402.ReasonBatchInvalidVoucherSignature},
		{"at a voucher below the last one charged", b.payerRefund(b.payer, 2*batchPrice), x402.ReasonBatchCumulativeAmountMismatch},
	} {
		if resp := settleBatch(t, b.fx.f, tc.req); resp.Success || resp.ErrorReason != tc.reason {
			t.Errorf("a refund %s: %+v, want %s", tc.name, resp, tc.reason)
		}
	}
	if got := b.sentBy(t, b.c.Wallets) - sent; got != 0 {
		t.Fatalf("refused refunds sent %d transactions", got)
	}
	// The refund claims the three vouchers, pays them to the receiver and returns the rest, in one transaction.
	refund := b.payerRefund(b.payer, 3*batchPrice)
	first := settleBatch(t, b.fx.f, refund)
	if !first.Success || first.Transaction == "" || first.Amount != fmt.Sprint(7*batchPrice) {
		t.Fatalf("the refund: %+v", first)
	}
	payer, receiver := b.balances(t)
	if payer != payer0-3*batchPrice || receiver != 3*batchPrice {
		t.Fatalf("the payer holds %d (want %d), the receiver %d (want %d)", payer, payer0-3*batchPrice, receiver, 3*batchPrice)
	}
	// Presented again (its answer lost): the answer of the refund it was, nothing sent.
	if again := settleBatch(t, b.fx.f, refund); !again.Success || again.Transaction != first.Transaction {
		t.Fatalf("the refund presented again: %+v, want %s", again, first.Transaction)
	}
	if got := b.sentBy(t, b.c.Wallets) - sent; got != 1 {
		t.Fatalf("the refund sent %d transactions, want 1", got)
	}
	// Nothing is left for a voucher to take, and the claimer has nothing to claim.
	if resp := settleBatch(t, b.fx.f, b.voucher(b.rq, 4*batchPrice)); resp.Success {
		t.Fatalf("a voucher after the refund was accepted: %+v", resp)
	}
	if err := b.fx.f.ClaimBatches(context.Background()); err != nil {
		t.Fatal(err)
	}
	if got := b.sentBy(t, b.c.Wallets) - sent; got != 1 {
		t.Fatalf("after the refund %d transactions were sent, want 1", got)
	}
}

func TestBatchWithdrawalOfAPayerTheEngineClaimsBeforeItIsFinalizedAndTheRestIsExact(t *testing.T) {
	b := actionRoute(t, boltJournal(t))
	payer0, _ := b.balances(t)
	b.deposit(t, 10*batchPrice)
	for i := int64(1); i <= 4; i++ {
		if resp := settleBatch(t, b.fx.f, b.voucher(b.rq, i*batchPrice)); !resp.Success {
			t.Fatalf("voucher %d: %+v", i, resp)
		}
	}
	initiate, err := contracts.PackInitiateWithdraw(b.cfg, big.NewInt(10*batchPrice))
	if err != nil {
		t.Fatal(err)
	}
	finalize, err := contracts.PackFinalizeWithdraw(b.cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	// Only the payer (or its payerAuthorizer) may withdraw.
	if _, err := b.c.Call(ctx, b.receiver.Address, contracts.BatchSettlementAddress, initiate); err == nil {
		t.Fatal("the receiver could initiate the payer's withdrawal")
	}
	b.escrow(t, b.payer, initiate, "initiating the withdrawal")
	// Not before the delay.
	if _, err := b.c.Call(ctx, b.payer.Address, contracts.BatchSettlementAddress, finalize); err == nil {
		t.Fatal("the withdrawal could be finalized before its delay")
	}
	// The engine claims what it accepted before the delay runs out.
	if err := b.fx.f.ClaimBatches(ctx); err != nil {
		t.Fatal(err)
	}
	if _, claimed := b.channelOnChain(t); claimed != 4*batchPrice {
		t.Fatalf("claimed %d before the withdrawal, want %d", claimed, 4*batchPrice)
	}
	b.c.AdjustTime(time.Duration(contracts.MinWithdrawDelay+1) * time.Second)
	b.escrow(t, b.payer, finalize, "finalizing the withdrawal")
	payer, receiver := b.balances(t)
	if payer != payer0-4*batchPrice || receiver != 4*batchPrice {
		t.Fatalf("the payer holds %d (want %d), the receiver %d (want %d)", payer, payer0-4*batchPrice, receiver, 4*batchPrice)
	}
	if balance, claimed := b.channelOnChain(t); balance != 4*batchPrice || claimed != 4*batchPrice {
		t.Fatalf("the channel holds %d with %d claimed, want all of it claimed", balance, claimed)
	}
	// A second finalize has nothing pending.
	if _, err := b.c.Call(ctx, b.payer.Address, contracts.BatchSettlementAddress, finalize); err == nil {
		t.Fatal("a withdrawal could be finalized twice")
	}
}

func TestBatchClaimerWithAPolicySlowerThanTheWithdrawDelayClaimsBeforeAnUnseenWithdrawalCanBeFinalized(t *testing.T) {
	// The engine claims only every million vouchers or after an hour; the channel's withdrawDelay is 15 minutes.
	b := actionRoute(t, boltJournal(t))
	b.deposit(t, 10*batchPrice)
	for i := int64(1); i <= 4; i++ {
		if resp := settleBatch(t, b.fx.f, b.voucher(b.rq, i*batchPrice)); !resp.Success {
			t.Fatalf("voucher %d: %+v", i, resp)
		}
	}
	// The payer asks to withdraw everything; the engine reads nothing more of the channel.
	initiate, err := contracts.PackInitiateWithdraw(b.cfg, big.NewInt(10*batchPrice))
	if err != nil {
		t.Fatal(err)
	}
	b.escrow(t, b.payer, initiate, "initiating the withdrawal")
	// Ten minutes on, inside the claim margin of the channel's read: the claimer's own pass claims.
	b.c.AdjustTime(10*time.Minute + 30*time.Second)
	deadline := time.Now().Add(20 * time.Second)
	for {
		if _, claimed := b.channelOnChain(t); claimed == 4*batchPrice {
			break
		}
		if time.Now().After(deadline) {
			_, claimed := b.channelOnChain(t)
			t.Fatalf("five minutes before the withdrawal can be finalized, %d of the %d accepted is claimed", claimed, 4*batchPrice)
		}
		time.Sleep(50 * time.Millisecond)
	}
	b.c.AdjustTime(5 * time.Minute)
	finalize, err := contracts.PackFinalizeWithdraw(b.cfg)
	if err != nil {
		t.Fatal(err)
	}
	b.escrow(t, b.payer, finalize, "finalizing the withdrawal")
	if _, receiver := b.balances(t); receiver != 4*batchPrice {
		t.Fatalf("the receiver holds %d, want the %d its served vouchers charged", receiver, 4*batchPrice)
	}
}

func TestBatchActionOnAChannelWhoseRefundIsSentAndNotMinedWaitsForItAndSendsNothingThatReverts(t *testing.T) {
	b := newBatchRoute(t, fixtureOpts{journal: boltJournal(t), wallets: 1, receiptTimeout: 100 * time.Millisecond,
		tune: func(_ *fixture, nc *chain.NetworkConfig) {
			claimsWhenAsked(nc, chaintest.DeriveAccount("authorizer", 0))
		}})
	b.deposit(t, 10*batchPrice)
	sent := b.sentBy(t, b.c.Wallets)
	refund := b.action(t, b.refundOf(b.payer, 3*batchPrice, 7*batchPrice, 0, b.claimOf(b.payer, 3*batchPrice, 3*batchPrice)))
	if resp := settleBatch(t, b.fx.f, refund); resp.ErrorReason != x402.ReasonSettlementPending {
		t.Fatalf("the refund, not mined: %+v", resp)
	}
	// A claim of the channel above what the refund leaves: simulated now, it would pass and then revert.
	claim := b.action(t, x402.BatchPayload{Type: x402.BatchClaim, Claims: []x402.BatchVoucherClaim{b.claimOf(b.payer, 6*batchPrice, 6*batchPrice)}})
	done := make(chan x402.BatchSettleResponse, 1)
	go func() { done <- settleLeased(b.fx.f, claim) }()
	time.Sleep(300 * time.Millisecond)
	stop := b.c.AutoCommit(5 * time.Millisecond)
	defer stop()
	if resp := <-done; resp.Success || resp.ErrorReason != x402.ReasonBatchClaimSimulationFailed {
		t.Fatalf("the claim after the refund: %+v, want refused unsent", resp)
	}
	if got := b.sentBy(t, b.c.Wallets) - sent; got != 1 {
		t.Fatalf("sent %d transactions, want only the refund's", got)
	}
	if resp := settleBatch(t, b.fx.f, refund); !resp.Success || resp.Amount != fmt.Sprint(7*batchPrice) {
		t.Fatalf("the refund presented again: %+v", resp)
	}
}

func TestBatchClaimThatRevertedBecauseAnotherFacilitatorRefundedMayBeSentAgainOnceItWouldLand(t *testing.T) {
	b := newBatchRoute(t, fixtureOpts{journal: boltJournal(t), wallets: 1, receiptTimeout: 100 * time.Millisecond,
		tune: func(_ *fixture, nc *chain.NetworkConfig) {
			claimsWhenAsked(nc, chaintest.DeriveAccount("authorizer", 0))
		}})
	b.deposit(t, 10*batchPrice)
	// Another facilitator, sharing nothing with this engine, sends a refund that is not mined yet.
	other := b.engine(t, boltJournal(t), b.c.Wallets[1:2], true, 100*time.Millisecond)
	refund := b.action(t, b.refundOf(b.payer, 3*batchPrice, 7*batchPrice, 0, b.claimOf(b.payer, 3*batchPrice, 3*batchPrice)))
	if resp := settleLeased(other, refund); resp.ErrorReason != x402.ReasonSettlementPending {
		t.Fatalf("the other facilitator's refund: %+v", resp)
	}
	claim := b.action(t, x402.BatchPayload{Type: x402.BatchClaim, Claims: []x402.BatchVoucherClaim{b.claimOf(b.payer, 6*batchPrice, 6*batchPrice)}})
	if resp := settleBatch(t, b.fx.f, claim); resp.ErrorReason != x402.ReasonSettlementPending {
		t.Fatalf("the claim, not mined: %+v", resp)
	}
	b.c.Commit()
	if _, claimed := b.channelOnChain(t); claimed != 3*batchPrice {
		t.Skipf("the block put the claim before the refund (claimed %d): nothing reverted to try again", claimed)
	}
	stop := b.c.AutoCommit(5 * time.Millisecond)
	defer stop()
	if resp := settleBatch(t, b.fx.f, claim); resp.ErrorReason != x402.ReasonBatchClaimTransactionFailed {
		t.Fatalf("the claim that reverted: %+v", resp)
	}
	// Presented again, it is checked afresh rather than answered by the revert: refused unsent while it would
	// revert again, sent once the channel holds enough.
	sent := b.sentBy(t, b.c.Wallets[:1])
	if resp := settleBatch(t, b.fx.f, claim); resp.ErrorReason != x402.ReasonBatchClaimSimulationFailed {
		t.Fatalf("the claim presented again: %+v", resp)
	}
	b.deposit(t, 10*batchPrice)
	resp := settleBatch(t, b.fx.f, claim)
	for i := 0; i < 50 && resp.ErrorReason == x402.ReasonSettlementPending; i++ {
		resp = settleBatch(t, b.fx.f, claim)
	}
	if !resp.Success {
		t.Fatalf("the claim once the channel holds enough: %+v", resp)
	}
	if _, claimed := b.channelOnChain(t); claimed != 6*batchPrice {
		t.Fatalf("claimed %d, want %d", claimed, 6*batchPrice)
	}
	if got := b.sentBy(t, b.c.Wallets[:1]) - sent; got != 1 {
		t.Fatalf("sent %d transactions, want 1", got)
	}
}

// permit2Deposit is the batch request of the payer's deposit of amount through the Permit2 deposit collector,
// signed by signer, to route rq (which takes permit2 deposits), with its voucher for the first request.
func (b *batchRoute) permit2Deposit(signer *chaintest.Account, rq x402.BatchRequirements, amount int64) x402.BatchRequest {
	nonce := chaintest.RandomNonce()
	deadline := new(big.Int).SetUint64(b.c.HeadTime() + 240)
	sig := b.c.SignTypedData(signer, chaintest.DepositPermit2TypedData(b.c.ChainID, b.token, big.NewInt(amount), nonce, deadline, b.id))
	req := b.voucher(rq, batchPrice)
	pl := &req.PaymentPayload.Payload
	pl.Type = x402.BatchDeposit
	pl.Deposit = &x402.BatchDepositFields{Amount: fmt.Sprint(amount), Authorization: x402.BatchDepositAuthorization{
		Permit2Authorization: &x402.BatchPermit2Authorization{From: b.payer.Address.Hex(),
			Permitted: x402.TokenPermissions{Token: b.token.Hex(), Amount: fmt.Sprint(amount)},
			Spender:   contracts.Permit2DepositCollectorAddress.Hex(), Nonce: nonce.String(), Deadline: deadline.String(),
			Witness: x402.BatchPermit2Witness{ChannelID: b.id.Hex()}, Signature: hexutil.Encode(sig)}}}
	return req
}

func TestBatchPermit2DepositIsSentOnceThroughThePermit2CollectorAndItsVoucherAccepted(t *testing.T) {
	b := newBatchRoute(t, fixtureOpts{journal: boltJournal(t), autoCommit: 5 * time.Millisecond, receiptTimeout: 30 * time.Second})
	rq := b.rq
	rq.Extra.AssetTransferMethod = x402.TransferPermit2
	payer0, _ := b.balances(t)
	sent := b.sentBy(t, b.c.Wallets)
	// Refused before anything is sent: signed by another key; no Permit2 allowance yet.
	for _, tc := range []struct {
		name   string
		req    x402.BatchRequest
		reason string
	}{
		{"signed by another key", b.permit2Deposit(chaintest.DeriveAccount("stranger", 0), rq, 10*batchPrice), x402.ReasonBatchPermit2InvalidSignature},
		{"without a Permit2 allowance", b.permit2Deposit(b.payer, rq, 10*batchPrice), x402.ReasonBatchPermit2AllowanceRequired},
	} {
		if v, err := b.fx.f.VerifyBatch(context.Background(), tc.req); err != nil || v.IsValid || v.InvalidReason != tc.reason {
			t.Errorf("verifying a deposit %s: %+v, %v; want %s", tc.name, v, err, tc.reason)
		}
		if resp := settleBatch(t, b.fx.f, tc.req); resp.Success || resp.ErrorReason != tc.reason {
			t.Errorf("settling a deposit %s: %+v; want %s", tc.name, resp, tc.reason)
		}
	}
	if got := b.sentBy(t, b.c.Wallets) - sent; got != 0 {
		t.Fatalf("refused deposits sent %d transactions", got)
	}
	approve, err := contracts.StableCoinABI.Pack("approve", contracts.Permit2Address, big.NewInt(1_000_000_000))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := b.c.Transact(context.Background(), b.payer, b.token, approve); err != nil {
		t.Fatalf("approving Permit2: %v", err)
	}
	payer0, _ = b.balances(t)
	dep := b.permit2Deposit(b.payer, rq, 10*batchPrice)
	if v, err := b.fx.f.VerifyBatch(context.Background(), dep); err != nil || !v.IsValid {
		t.Fatalf("verifying the deposit: %+v, %v", v, err)
	}
	first := settleBatch(t, b.fx.f, dep)
	if !first.Success || first.Transaction == "" || first.Extra == nil || first.Extra.ChannelState == nil || first.Extra.ChannelState.ChargedCumulativeAmount != fmt.Sprint(batchPrice) {
		t.Fatalf("the deposit: %+v", first)
	}
	if balance, _ := b.channelOnChain(t); balance != 10*batchPrice {
		t.Fatalf("the channel holds %d, want %d", balance, 10*batchPrice)
	}
	if payer, _ := b.balances(t); payer != payer0-10*batchPrice {
		t.Fatalf("the payer holds %d, want %d", payer, payer0-10*batchPrice)
	}
	if again := settleBatch(t, b.fx.f, dep); !again.Success || again.Transaction != first.Transaction {
		t.Fatalf("the deposit presented again: %+v, want %s", again, first.Transaction)
	}
	if got := b.sentBy(t, b.c.Wallets) - sent; got != 1 {
		t.Fatalf("the deposit sent %d transactions, want 1", got)
	}
	if resp := settleBatch(t, b.fx.f, b.voucher(rq, 2*batchPrice)); !resp.Success {
		t.Fatalf("the next voucher: %+v", resp)
	}
	// Its record is the payer's Permit2 nonce's, and reads back as this engine's settlement after its deadline
	// (a restart, a takeover: reconciliation must still finish it).
	id := journal.PaymentID(b.fx.net, x402.TransferPermit2, b.token.Hex(), b.payer.Address.Hex(), dep.PaymentPayload.Payload.Deposit.Authorization.Permit2Authorization.Nonce)
	rec, ok, err := b.fx.journal.Get(context.Background(), id)
	if err != nil || !ok || rec.TxHash != first.Transaction {
		t.Fatalf("the deposit's record: %+v, %v, %v", rec, ok, err)
	}
	b.c.AdjustTime(10 * time.Minute)
	if got, refused, err := b.fx.f.RecordedPaymentIDForTest(rec.Request); err != nil || refused != "" || got != id {
		t.Fatalf("the deposit's record read back after its deadline: id %s, refused %q, %v; want %s", got, refused, err, id)
	}
}
