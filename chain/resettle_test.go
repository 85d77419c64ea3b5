package chain_test

import (
	"bytes"
	"context"
	"errors"
	"math/big"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ethereum/go-ethereum"
	"github.com/ethereum/go-ethereum/common"
	"github.com/ethereum/go-ethereum/core/types"
	"github.com/ethereum/go-ethereum/crypto"

	"github.com/x402-gateway/caddy-x402/chain"
	"github.com/x402-gateway/caddy-x402/chain/chaintest"
	"github.com/x402-gateway/caddy-x402/x402"
)

// nonceScript decides the fate of each transaction the engine sends, by its wallet nonce (relative to the
// wallet's nonce at the start) and by whether it is the first transaction seen at that nonce.
type nonceScript struct {
	mu    sync.Mutex
	base  uint64
	first map[uint64]common.Hash
	taken bool // the nonce the script waits for went to another settlement
}

// fate is what happens to a send: forwarded to the chain, refused as a node without gas money would, or lost
// to a transport failure without reaching the node.
type fate int

const (
	forward fate = iota
	refuseIt
	loseIt
	// conflictIt: refused as a node refuses a transaction whose nonce another one in its pool holds, at a fee it
	// does not replace.
	conflictIt
)

func (s *nonceScript) send(ctx context.Context, chainSend func(context.Context, *types.Transaction) error, tx *types.Transaction,
	decide func(rel uint64, first, taken bool) (fate, bool)) error {
	s.mu.Lock()
	rel := tx.Nonce() - s.base
	h, seen := s.first[rel]
	if !seen {
		s.first[rel], h = tx.Hash(), tx.Hash()
	}
	f, takes := decide(rel, h == tx.Hash(), s.taken)
	s.mu.Unlock()
	switch f {
	case refuseIt:
		return errors.New("insufficient funds for gas * price + value (injected)")
	case loseIt:
		return &net.OpError{Op: "read", Net: "tcp", Err: errors.New("connection reset by peer (injected)")}
	case conflictIt:
		return errors.New("replacement transaction underpriced (injected)")
	}
	if err := chainSend(ctx, tx); err != nil {
		return err
	}
	if takes {
		s.mu.Lock()
		s.taken = true
		s.mu.Unlock()
	}
	return nil
}

// An erc2612 settlement is two transactions, a permit and the transfer it allows. When one of them loses its
// wallet nonce to another settlement (the engine re-read the wallet's nonce after a refusal, and the node had
// never received the one the journal holds), reconciliation settles the payment again. That must settle it,
// once, and answer so:
//   - the permit mined and the transfer lost its nonce: the payer's permit nonce is spent, by this very
//     settlement, and the transfer its allowance pays for is what is left to send. (Seen in the fault tests: the
//     payment answered settlement_pending for ten minutes, its nonce "spent" by its own permit.)
//   - the permit lost its nonce before it reached a node: the transfer must not go out alone, where it reverts
//     for want of the allowance. (Seen: the payment answered "mined but reverted", a second transaction.)
func TestAnERC2612SettlementWhoseTransactionLostItsNonceSettlesOnce(t *testing.T) {
	cases := []struct {
		name string
		// decide is the script: rel is the nonce relative to the start, first says the transaction is the first
		// seen at it, taken that another settlement now holds the nonce the payment's transaction lost. It
		// returns the send's fate and whether a forwarded send takes that nonce.
		decide func(rel uint64, first, taken bool) (fate, bool)
	}{
		{"permit mined, transfer lost its nonce", func(rel uint64, first, taken bool) (fate, bool) {
			switch {
			case rel == 1 && first && !taken:
				return refuseIt, false // the payment's transfer: refused until its nonce is gone
			case rel == 2 && first && !taken:
				return refuseIt, false // the second payment's first try: the engine reads the nonce again
			case rel == 1 && !first:
				return forward, true // the second payment, at the transfer's nonce
			}
			return forward, false
		}},
		{"permit lost its nonce before reaching a node", func(rel uint64, first, taken bool) (fate, bool) {
			switch {
			case rel == 0 && first && !taken:
				return loseIt, false // the payment's permit: lost, the transfer not sent at all
			case rel == 2 && first && !taken:
				return refuseIt, false
			case rel == 0 && !first:
				return forward, true
			}
			return forward, false
		}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			script := &nonceScript{first: map[uint64]common.Hash{}}
			fx := newFixture(t, fixtureOpts{
				wallets: 1, receiptTimeout: time.Second, chainOpts: []chaintest.Option{chaintest.WithPromptCommit()},
				configure: func(cfg *chain.Config) {
					cfg.ReconcileEvery, cfg.ReconcileGrace = 20*time.Millisecond, 50*time.Millisecond
				},
				tune: func(fx *fixture, nc *chain.NetworkConfig) {
					script.base = fx.c.TxCount(fx.c.Wallets[0].Address)
					client := fx.c.Client
					nc.Backend = sendFault{Backend: nc.Backend, send: func(ctx context.Context, tx *types.Transaction) error {
						return script.send(ctx, client.SendTransaction, tx, tc.decide)
					}}
				},
			})
			wallet := fx.c.Wallets[0].Address
			first, second := fx.c.Payers[0], fx.c.Payers[1]
			fx.approvePermit2(second)
			e := fx.erc2612(first, fx.requirements(x402.TransferERC2612), chain.ERC2612Options{})
			x := fx.permit2(second, fx.requirements(x402.TransferPermit2), chain.Permit2Options{})
			firstBefore, secondBefore, sellerBefore := fx.c.TokenBalance(first.Address), fx.c.TokenBalance(second.Address), fx.c.TokenBalance(fx.payTo)

			if a := fx.settle(e); a.Success || !a.Pending() {
				t.Fatalf("the erc2612 payment, one transaction of it refused or lost = %+v; want settlement_pending", a)
			}
			if a, err := fx.f.Settle(context.Background(), x); !x402.IsUnreachable(err) {
				t.Fatalf("the second payment, its first transaction refused = %+v, %v; want not sent (an unreachable error)", a, err)
			}
			if a, seen := settleUntilFinal(t, fx.f, x, time.Now().Add(10*time.Second)); !a.Success {
				t.Fatalf("the second payment presented again never settled; answers: %v", seen)
			}
			final, seen := settleUntilFinal(t, fx.f, e, time.Now().Add(20*time.Second))
			if !final.Success {
				t.Fatalf("the erc2612 payment never settled; answers: %v, last %+v", seen, final)
			}
			if again := fx.settle(e); !again.Success || again.Transaction != final.Transaction {
				t.Fatalf("the erc2612 payment presented again = %+v; want the same settlement %s", again, final.Transaction)
			}

			time.Sleep(200 * time.Millisecond) // blocks are sealed every 5 ms: anything else sent would be mined
			for _, p := range []struct {
				name   string
				before *big.Int
				now    *big.Int
			}{{"the erc2612 payer", firstBefore, fx.c.TokenBalance(first.Address)}, {"the permit2 payer", secondBefore, fx.c.TokenBalance(second.Address)}} {
				if paid := new(big.Int).Sub(p.before, p.now); paid.Cmp(big.NewInt(price)) != 0 {
					t.Errorf("%s paid %s, want %d", p.name, paid, price)
				}
			}
			if got := new(big.Int).Sub(fx.c.TokenBalance(fx.payTo), sellerBefore); got.Cmp(big.NewInt(2*price)) != 0 {
				t.Errorf("the seller received %s, want %d", got, 2*price)
			}
			// permit, transfer and the second payment's settlement: nothing sent that reverted or did nothing.
			if sent := fx.c.TxCount(wallet) - script.base; sent != 3 {
				t.Errorf("the settlement wallet sent %d transactions, want 3 (a permit, a transfer and a permit2 settlement)", sent)
			}
		})
	}
}

// minesOnNonceRead is a node that, once armed, seals a block right after it answered a read of a token's permit
// nonces: what was on its way mines between a settlement's read of the payer's permit nonce and its simulation.
type minesOnNonceRead struct {
	chain.Backend
	commit func()
	armed  atomic.Bool
	fired  atomic.Bool
}

func (b *minesOnNonceRead) CallContract(ctx context.Context, msg ethereum.CallMsg, block *big.Int) ([]byte, error) {
	out, err := b.Backend.CallContract(ctx, msg, block)
	if len(msg.Data) >= 4 && bytes.Equal(msg.Data[:4], crypto.Keccak256([]byte("nonces(address)"))[:4]) && b.armed.CompareAndSwap(true, false) {
		b.commit()
		b.fired.Store(true)
	}
	return out, err
}

// An erc2612 settlement whose permit is on its way (in the node's pool) when reconciliation settles the payment
// again (its transfer lost, and its nonce taken by another settlement): the permit mines between the new checks'
// read of the payer's permit nonce and their simulation, which then fails (ERC2612InvalidSigner: the permit's
// nonce is spent). That is the payment's own permit, granting the allowance its transfer needs: the payment is
// looked at again by the next pass and settles, once, with the transfer alone. Before, it was refused for good ("was
// dropped and cannot be sent again"; the fault test's erc2612 payment, once in a few dozen runs), its allowance
// granted and nothing moved.
//
// The same long after the payment was claimed (its transfer sat in the pool, or the engine was down): the receipt of
// the permit, looked up again after the refusal, decides it, not the time since the claim (found by review).
func TestAnERC2612SettlementWhosePermitMinesWhileItIsSettledAgainSettlesOnce(t *testing.T) {
	t.Run("just claimed", func(t *testing.T) { permitMinesWhileSettledAgain(t, 0) })
	t.Run("claimed eleven minutes ago", func(t *testing.T) { permitMinesWhileSettledAgain(t, 11*time.Minute) })
}

func permitMinesWhileSettledAgain(t *testing.T, since time.Duration) {
	script := &nonceScript{first: map[uint64]common.Hash{}}
	var node *minesOnNonceRead
	var skew atomic.Int64
	fx := newFixture(t, fixtureOpts{
		autoCommit: -1, wallets: 1, receiptTimeout: time.Second,
		configure: func(cfg *chain.Config) {
			cfg.ReconcileEvery, cfg.ReconcileGrace = 20*time.Millisecond, 50*time.Millisecond
			cfg.Now = func() time.Time { return time.Now().Add(time.Duration(skew.Load())) }
		},
		tune: func(fx *fixture, nc *chain.NetworkConfig) {
			script.base = fx.c.TxCount(fx.c.Wallets[0].Address)
			client := fx.c.Client
			node = &minesOnNonceRead{commit: func() { fx.c.Commit() }, Backend: sendFault{Backend: nc.Backend, send: func(ctx context.Context, tx *types.Transaction) error {
				return script.send(ctx, client.SendTransaction, tx, func(rel uint64, first, taken bool) (fate, bool) {
					switch {
					case rel == 1 && first && !taken:
						return loseIt, false // the payment's transfer: lost until another settlement took its nonce
					case rel == 1 && first:
						// Then refused for the nonce the second payment's transaction holds in the pool (whatever
						// the two fees: a node may take a transfer priced higher in its place).
						return conflictIt, false
					case rel == 2 && first && !taken:
						return refuseIt, false // the second payment's first try: the engine reads the nonce again
					case rel == 1 && !first:
						return forward, true // the second payment, at the transfer's nonce
					}
					return forward, false
				})
			}}}
			nc.Backend = node
		},
	})
	wallet := fx.c.Wallets[0].Address
	first, second := fx.c.Payers[0], fx.c.Payers[1]
	fx.approvePermit2(second)
	e := fx.erc2612(first, fx.requirements(x402.TransferERC2612), chain.ERC2612Options{})
	x := fx.permit2(second, fx.requirements(x402.TransferPermit2), chain.Permit2Options{})
	firstBefore, sellerBefore := fx.c.TokenBalance(first.Address), fx.c.TokenBalance(fx.payTo)

	if a := fx.settle(e); a.Success || !a.Pending() {
		t.Fatalf("the erc2612 payment, its transfer lost = %+v; want settlement_pending", a)
	}
	// From here on the only read of a permit nonce is the checks' of the erc2612 payment settled again, once the
	// second payment took its transfer's nonce: its permit mines as they run.
	skew.Store(int64(since))
	node.armed.Store(true)
	if a, err := fx.f.Settle(context.Background(), x); !x402.IsUnreachable(err) {
		t.Fatalf("the second payment, its first transaction refused = %+v, %v; want not sent (an unreachable error)", a, err)
	}
	go fx.f.Settle(context.Background(), x) // at the transfer's nonce, into the pool beside the permit
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		script.mu.Lock()
		taken := script.taken
		script.mu.Unlock()
		if taken {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the second payment never took the transfer's nonce")
		}
	}
	for deadline := time.Now().Add(10 * time.Second); !node.fired.Load(); time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the erc2612 payment was never settled again: the test did not mine its permit during its checks")
		}
	}
	t.Cleanup(fx.c.AutoCommit(5 * time.Millisecond))
	final, seen := settleUntilFinal(t, fx.f, e, time.Now().Add(20*time.Second))
	if !final.Success {
		t.Fatalf("the erc2612 payment never settled; answers: %v, last %+v", seen, final)
	}
	if a, _ := settleUntilFinal(t, fx.f, x, time.Now().Add(10*time.Second)); !a.Success {
		t.Fatalf("the second payment = %+v, want settled", a)
	}
	time.Sleep(200 * time.Millisecond) // blocks are sealed every 5 ms: anything else sent would be mined
	if paid := new(big.Int).Sub(firstBefore, fx.c.TokenBalance(first.Address)); paid.Cmp(big.NewInt(price)) != 0 {
		t.Errorf("the erc2612 payer paid %s, want %d", paid, price)
	}
	if got := new(big.Int).Sub(fx.c.TokenBalance(fx.payTo), sellerBefore); got.Cmp(big.NewInt(2*price)) != 0 {
		t.Errorf("the seller received %s, want %d", got, 2*price)
	}
	if sent := fx.c.TxCount(wallet) - script.base; sent != 3 {
		t.Errorf("the settlement wallet sent %d transactions, want 3 (the permit, the second payment's settlement, the transfer)", sent)
	}
}
