package chain_test

import (
	"context"
	"crypto/ecdsa"
	"errors"
	"math/big"
	"net"
	"testing"
	"time"

	"github.com/ethereum/go-ethereum/core/types"

	"github.com/x402-gateway/caddy-x402/chain"
	"github.com/x402-gateway/caddy-x402/chain/chaintest"
	"github.com/x402-gateway/caddy-x402/x402"
)

// TestASettlementTheNodeRefusedIsNeverSentLater: the node refuses the settlement outright (the only settlement
// wallet has no gas money), so the payer is told nothing was sent, and to present the payment again. That must stay true: once the wallet is funded
// and reconciliation has had many passes, the payer has paid nothing and the wallet sent nothing. Presenting the
// same payment again then settles it, once.
func TestASettlementTheNodeRefusedIsNeverSentLater(t *testing.T) {
	for _, method := range []string{x402.TransferPermit2, x402.TransferERC2612} {
		t.Run(method, func(t *testing.T) {
			broke := chaintest.DeriveAccount("broke-settlement-wallet-"+method, 0)
			fx := newFixture(t, fixtureOpts{
				tune: func(fx *fixture, nc *chain.NetworkConfig) { nc.Keys = []*ecdsa.PrivateKey{broke.Key} },
				configure: func(cfg *chain.Config) {
					cfg.ReconcileEvery, cfg.ReconcileGrace = 20*time.Millisecond, 20*time.Millisecond
				},
			})
			payer := fx.c.Payers[0]
			fx.approvePermit2(payer)
			rq := fx.requirements(method)
			if method == x402.TransferERC2612 {
				rq.Extra.Spender = broke.Address.Hex()
			}
			var req x402.VerifyRequest
			if method == x402.TransferPermit2 {
				req = fx.permit2(payer, rq, chain.Permit2Options{})
			} else {
				req = fx.erc2612(payer, rq, chain.ERC2612Options{})
			}
			before, sellerBefore := fx.c.TokenBalance(payer.Address), fx.c.TokenBalance(fx.payTo)

			// The payment is good and nothing was sent: the facilitator cannot settle it now (a gate tells the
			// payer to present it again), it does not refuse it (a gate would tell the payer to pay again).
			if first, err := fx.f.Settle(context.Background(), req); !x402.IsUnreachable(err) {
				t.Fatalf("settle from a wallet without gas money = %+v, %v; want an unreachable error", first, err)
			}
			if n, err := fx.journal.Backlog(context.Background()); err != nil || n != 0 {
				t.Errorf("the journal holds %d unfinished records (%v) after a refused send; want the claim released", n, err)
			}

			// The wallet gets gas money. A restart on the same journal reconciles it at once (the running
			// engine's passes too); neither may send what the payer was told was not sent.
			fx.c.SendETH(fx.c.Deployer, broke.Address, new(big.Int).Mul(big.NewInt(1e18), big.NewInt(1)))
			restarted, err := chain.New(context.Background(), chain.Config{Journal: fx.journal, Networks: []chain.NetworkConfig{{
				Network: fx.net, Backend: fx.c.Client, Keys: []*ecdsa.PrivateKey{broke.Key}, ReceiptPoll: 2 * time.Millisecond,
				Assets: []chain.AssetConfig{{Address: fx.c.Token, Name: "Stable Coin", Version: "1", Decimals: 6}},
			}}})
			if err != nil {
				t.Fatal(err)
			}
			restarted.Close()
			time.Sleep(200 * time.Millisecond) // blocks are sealed every 5 ms
			if sent := fx.c.TxCount(broke.Address); sent != 0 {
				t.Errorf("the wallet sent %d transactions after the payer was told nothing was sent", sent)
			}
			if paid := new(big.Int).Sub(before, fx.c.TokenBalance(payer.Address)); paid.Sign() != 0 {
				t.Fatalf("the payer paid %s for a payment it was told was not sent", paid)
			}

			// The same payment presented again settles, once.
			again := fx.settle(req)
			if !again.Success {
				t.Fatalf("the same payment presented again after the wallet was funded = %+v; want settled", again)
			}
			assertMoved(t, fx, payer.Address, before, sellerBefore, 1)
			if again := fx.settle(req); !again.Success || again.Transaction != fx.settle(req).Transaction {
				t.Fatalf("a third presentation = %+v; want the same settlement", again)
			}
			assertMoved(t, fx, payer.Address, before, sellerBefore, 1)
		})
	}
}

// sendFault is a backend whose SendTransaction fails as told; everything else goes to the chain.
type sendFault struct {
	chain.Backend
	send func(ctx context.Context, tx *types.Transaction) error
}

func (b sendFault) SendTransaction(ctx context.Context, tx *types.Transaction) error {
	return b.send(ctx, tx)
}

// TestARefusalAfterAnEndpointThatMayHoldTheTransactionIsNotNotSent: the first endpoint takes the transaction
// into the node's pool and then fails without answering; the second refuses it. The refusal says nothing of
// the first node's pool, so the payer must not be told "not sent": the settlement is pending (or unreachable),
// and it settles, once.
func TestARefusalAfterAnEndpointThatMayHoldTheTransactionIsNotNotSent(t *testing.T) {
	var fx *fixture
	fx = newFixture(t, fixtureOpts{
		receiptTimeout: 2 * time.Second,
		tune: func(fx *fixture, nc *chain.NetworkConfig) {
			took := sendFault{Backend: nc.Backend, send: func(ctx context.Context, tx *types.Transaction) error {
				if err := fx.c.Client.SendTransaction(ctx, tx); err != nil {
					return err
				}
				return &net.OpError{Op: "read", Net: "tcp", Err: errors.New("connection reset by peer (injected)")}
			}}
			refuses := sendFault{Backend: nc.Backend, send: func(context.Context, *types.Transaction) error {
				return errors.New("insufficient funds for gas * price + value (injected)")
			}}
			f, err := chain.NewFailover([]string{"takes-then-fails", "refuses"}, []chain.Backend{took, refuses})
			if err != nil {
				t.Fatal(err)
			}
			nc.Backend = f
		},
	})
	payer := fx.c.Payers[1]
	fx.approvePermit2(payer)
	req := fx.payment(x402.TransferPermit2, payer)
	before, sellerBefore := fx.c.TokenBalance(payer.Address), fx.c.TokenBalance(fx.payTo)

	resp, err := fx.f.Settle(context.Background(), req)
	if err == nil && !resp.Success && resp.Transaction == "" {
		t.Fatalf("settle = %+v; a refusal after an endpoint that may hold the transaction must not say it was not sent", resp)
	}
	final, _ := settleUntilFinal(t, fx.f, req, time.Now().Add(20*time.Second))
	if !final.Success {
		t.Fatalf("final answer %+v; want settled", final)
	}
	assertMoved(t, fx, payer.Address, before, sellerBefore, 1)
}

// TestASendThatFailsWithAnErrorThatIsNoNodesAnswerIsNotTakenAsRefused: a backend without failover (the app's own
// dev chain is reached so) whose SendTransaction hands the transaction to the node and then fails with an error
// that is neither a node's answer nor a network error: go-ethereum's RPC client says "client reconnected" when its
// connection was replaced under a call. Whether the node holds the transaction is unknown, so the settlement must
// not be answered as refused with its record deleted (the transaction then mines behind an answer that said
// nothing was sent): it is pending, and it settles, once.
func TestASendThatFailsWithAnErrorThatIsNoNodesAnswerIsNotTakenAsRefused(t *testing.T) {
	var fx *fixture
	fx = newFixture(t, fixtureOpts{
		receiptTimeout: 2 * time.Second,
		tune: func(fx *fixture, nc *chain.NetworkConfig) {
			nc.Backend = sendFault{Backend: nc.Backend, send: func(ctx context.Context, tx *types.Transaction) error {
				if err := fx.c.Client.SendTransaction(ctx, tx); err != nil {
					return err
				}
				return errors.New("client reconnected (injected)")
			}}
		},
	})
	payer := fx.c.Payers[1]
	fx.approvePermit2(payer)
	req := fx.payment(x402.TransferPermit2, payer)
	before, sellerBefore := fx.c.TokenBalance(payer.Address), fx.c.TokenBalance(fx.payTo)

	resp, err := fx.f.Settle(context.Background(), req)
	if err == nil && !resp.Success && resp.Transaction == "" {
		t.Fatalf("settle = %+v; a send that failed with no answer from the node must not say it was not sent", resp)
	}
	final, _ := settleUntilFinal(t, fx.f, req, time.Now().Add(20*time.Second))
	if !final.Success {
		t.Fatalf("final answer %+v; want settled", final)
	}
	assertMoved(t, fx, payer.Address, before, sellerBefore, 1)
}
