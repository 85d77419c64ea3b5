package chain

import (
	"context"
	"errors"
	"math/big"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ethereum/go-ethereum"
	"github.com/ethereum/go-ethereum/common"
	"github.com/ethereum/go-ethereum/core/types"

	"github.com/x402-gateway/caddy-x402/chain/chaintest"
)

// pollCounter counts the watcher's polls of the head block.
type pollCounter struct {
	Backend
	heads atomic.Int64
}

func (p *pollCounter) HeaderByNumber(ctx context.Context, n *big.Int) (*types.Header, error) {
	p.heads.Add(1)
	return p.Backend.HeaderByNumber(ctx, n)
}

// TestTheReceiptWatcherStopsPollingOnceEveryWaiterOfAReplacedTransactionIsDone: a waiter filed under a
// transaction that a fee bump then replaced is filed under both hashes. Whichever way it ends (the original
// mines, so the replacement never will; or the waiter gives up), it must be gone from both, and the watcher
// must stop polling: a stale waiter under a hash that can never mine kept it polling for ever.
func TestTheReceiptWatcherStopsPollingOnceEveryWaiterOfAReplacedTransactionIsDone(t *testing.T) {
	c := chaintest.New(t)
	for _, ending := range []string{"the original mines", "the waiter gives up"} {
		t.Run(ending, func(t *testing.T) {
			pc := &pollCounter{Backend: c.Client}
			rw := newReceiptWatcher(pc, 2*time.Millisecond)
			tx, err := c.SendTx(context.Background(), c.Payers[0], &c.Deployer.Address, nil)
			if err != nil {
				t.Fatal(err)
			}
			neverMines := common.HexToHash("0x0bad")
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			if ending == "the waiter gives up" {
				ctx, cancel = context.WithTimeout(context.Background(), 100*time.Millisecond)
				defer cancel()
			}
			got := make(chan error, 1)
			go func() {
				_, err := rw.wait(ctx, true, tx.Hash())
				got <- err
			}()
			for filed := false; !filed; time.Sleep(time.Millisecond) {
				rw.mu.Lock()
				filed = len(rw.waiters[tx.Hash()]) > 0
				rw.mu.Unlock()
			}
			rw.replaced(tx.Hash(), neverMines)
			if ending == "the original mines" {
				c.Commit()
			}
			if err := <-got; (err == nil) != (ending == "the original mines") || (err != nil && !errors.Is(err, context.DeadlineExceeded)) {
				t.Fatalf("wait = %v", err)
			}
			time.Sleep(50 * time.Millisecond) // the loop's last round ends
			before := pc.heads.Load()
			time.Sleep(200 * time.Millisecond) // a hundred polls at 2 ms, were it still polling
			if polls := pc.heads.Load() - before; polls != 0 {
				rw.mu.Lock()
				left := len(rw.waiters)
				rw.mu.Unlock()
				t.Fatalf("the watcher polled the head %d times after its last waiter was done (%d hashes still watched)", polls, left)
			}
			if ending == "the waiter gives up" {
				c.Commit() // mine it, so the next case starts clean
			}
		})
	}
}

// gatedBackend lets a test hold the watcher's look at the head (headMu) and, once armed, its first receipt
// lookup of hold until release is closed, so that a transaction can be registered at a chosen moment of a
// round of the watcher's loop.
type gatedBackend struct {
	Backend
	headMu  sync.Mutex
	hold    common.Hash
	armed   atomic.Bool
	reached chan struct{}
	release chan struct{}
}

func (g *gatedBackend) HeaderByNumber(ctx context.Context, n *big.Int) (*types.Header, error) {
	g.headMu.Lock()
	g.headMu.Unlock()
	return g.Backend.HeaderByNumber(ctx, n)
}

func (g *gatedBackend) TransactionReceipt(ctx context.Context, h common.Hash) (*types.Receipt, error) {
	if h == g.hold && g.armed.CompareAndSwap(true, false) {
		close(g.reached)
		<-g.release
	}
	return g.Backend.TransactionReceipt(ctx, h)
}

// TestTheReceiptWatcherFindsATransactionMinedInBlocksItSkippedOver: after more than maxScan blocks in one look,
// the watcher looks up the receipt of every awaited transaction instead of scanning the blocks. A transaction
// registered as just sent while that round runs, and mined in one of those skipped blocks, must still be
// found: it was filed as "only in a recently scanned block", and the skipped blocks were never scanned, so its
// waiter waited out its whole timeout (seen as a settle_ms of 30 s and a 502 "not final yet" for a payment
// that had settled in the first second, with three gateways sealing blocks fast on one chain).
func TestTheReceiptWatcherFindsATransactionMinedInBlocksItSkippedOver(t *testing.T) {
	c := chaintest.New(t)
	neverMines := common.HexToHash("0x0bad")
	gb := &gatedBackend{Backend: c.Client, hold: neverMines, reached: make(chan struct{}), release: make(chan struct{})}
	rw := newReceiptWatcher(gb, 2*time.Millisecond)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() { _, _ = rw.wait(ctx, false, neverMines) }() // keeps the loop running
	time.Sleep(50 * time.Millisecond)                      // its first look is done: it knows the head

	gb.headMu.Lock() // the loop does not see the blocks one by one
	tx, err := c.SendTx(context.Background(), c.Payers[0], &c.Deployer.Address, nil)
	if err != nil {
		t.Fatal(err)
	}
	for range maxScan + 8 {
		c.Commit()
	}
	gb.armed.Store(true)
	gb.headMu.Unlock()
	<-gb.reached // the round that skipped the blocks is looking up what it awaited before they came
	got := make(chan error, 1)
	go func() {
		wctx, wcancel := context.WithTimeout(context.Background(), 3*time.Second)
		defer wcancel()
		_, err := rw.wait(wctx, true, tx.Hash())
		got <- err
	}()
	for filed := false; !filed; time.Sleep(time.Millisecond) {
		rw.mu.Lock()
		filed = len(rw.waiters[tx.Hash()]) > 0
		rw.mu.Unlock()
	}
	close(gb.release)
	if err := <-got; err != nil {
		t.Fatalf("waiting for a transaction mined in a block the watcher skipped over: %v", err)
	}
}

// headGate holds the watcher's polls of the head block while closed, so a test can move the chain many blocks
// between two of its looks.
type headGate struct {
	Backend
	mu    chan struct{} // a token: held by the test while the gate is closed
	polls atomic.Int64
}

func (g *headGate) HeaderByNumber(ctx context.Context, n *big.Int) (*types.Header, error) {
	g.mu <- struct{}{}
	<-g.mu
	g.polls.Add(1)
	return g.Backend.HeaderByNumber(ctx, n)
}

// TestTheReceiptWatcherFindsATransactionMinedInABlockItSkipped: the head moves more than maxScan blocks between
// two looks of the watcher, so it looks up the waiters it has and scans none of those blocks; a transaction mined
// in one of them whose waiter registers (right after its broadcast, justSent) only after that look is in no block
// the watcher will scan. It must still be found: before, its waiter waited its whole timeout for a receipt the
// node had all along (a settlement mined in a second answered settlement_pending after 30 s, under load).
func TestTheReceiptWatcherFindsATransactionMinedInABlockItSkipped(t *testing.T) {
	c := chaintest.New(t)
	g := &headGate{Backend: c.Client, mu: make(chan struct{}, 1)}
	rw := newReceiptWatcher(g, 2*time.Millisecond)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	// A waiter that keeps the watcher polling, on a transaction that never mines.
	go rw.wait(ctx, false, common.HexToHash("0x0bad"))
	for g.polls.Load() < 2 {
		time.Sleep(time.Millisecond)
	}

	g.mu <- struct{}{} // the watcher's next look waits
	tx, err := c.SendTx(ctx, c.Payers[0], &c.Deployer.Address, nil)
	if err != nil {
		t.Fatal(err)
	}
	c.Commit()
	for range maxScan + 8 {
		c.Commit()
	}
	polled := g.polls.Load()
	<-g.mu // the watcher looks: a gap of more than maxScan blocks
	for g.polls.Load() < polled+3 {
		time.Sleep(time.Millisecond)
	}

	start := time.Now()
	r, err := rw.wait(ctx, true, tx.Hash())
	if err != nil {
		t.Fatalf("waiting for the receipt of a transaction mined %d blocks ago, in a gap the watcher did not scan: %v", maxScan+8, err)
	}
	if r.TxHash != tx.Hash() {
		t.Fatalf("got the receipt of %s, want %s", r.TxHash, tx.Hash())
	}
	t.Logf("found after %v", time.Since(start).Round(time.Millisecond))
}

// pushingBackend pushes the heads a test hands it, as a node in this process does.
type pushingBackend struct {
	Backend
	mu   sync.Mutex
	subs []chan<- *types.Header
}

type pushedSub struct{ err chan error }

func (s pushedSub) Unsubscribe()      {}
func (s pushedSub) Err() <-chan error { return s.err }

func (p *pushingBackend) SubscribeNewHead(_ context.Context, ch chan<- *types.Header) (ethereum.Subscription, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.subs = append(p.subs, ch)
	return pushedSub{err: make(chan error)}, nil
}

func (p *pushingBackend) push(h *types.Header) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, ch := range p.subs {
		select {
		case ch <- h:
		default:
		}
	}
}

// TestTheReceiptWatcherLooksAgainAsSoonAsANodeInThisProcessPushesANewHead: a transaction mined after the
// watcher's first look is found when the node pushes the block's head, not a poll (a minute here) or the 2 s
// rescue later.
func TestTheReceiptWatcherLooksAgainAsSoonAsANodeInThisProcessPushesANewHead(t *testing.T) {
	c := chaintest.New(t)
	pb := &pushingBackend{Backend: c.Client}
	rw := newReceiptWatcher(pb, time.Minute)
	tx, err := c.SendTx(context.Background(), c.Payers[0], &c.Deployer.Address, nil)
	if err != nil {
		t.Fatal(err)
	}
	got := make(chan error, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_, err := rw.wait(ctx, true, tx.Hash())
		got <- err
	}()
	for subscribed, deadline := false, time.Now().Add(5*time.Second); !subscribed; time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the watcher did not subscribe to the pushed heads of a node that pushes them")
		}
		pb.mu.Lock()
		subscribed = len(pb.subs) > 0
		pb.mu.Unlock()
	}
	time.Sleep(50 * time.Millisecond) // the first look is done: the transaction is not mined yet
	c.Commit()
	head, err := c.Client.HeaderByNumber(context.Background(), nil)
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	pb.push(head)
	select {
	case err := <-got:
		if err != nil {
			t.Fatalf("waiting for the receipt: %v", err)
		}
		if took := time.Since(start); took > time.Second {
			t.Fatalf("found %s after the head was pushed: by the rescue, not the push", took)
		}
	case <-time.After(1500 * time.Millisecond):
		t.Fatal("the receipt was not found within 1.5 s of the pushed head (the rescue comes at 2 s, the poll at 1 min)")
	}
}

// laggingHead answers the head block as it was when frozen, while receipts come from the chain as it is: the
// moment a node has indexed a new block's transactions and not yet moved its head to it.
type laggingHead struct {
	Backend
	frozen atomic.Pointer[types.Header]
}

func (l *laggingHead) HeaderByNumber(ctx context.Context, n *big.Int) (*types.Header, error) {
	if h := l.frozen.Load(); h != nil && n == nil {
		return h, nil
	}
	return l.Backend.HeaderByNumber(ctx, n)
}

// TestTheReceiptWatcherDeliversNoReceiptOfABlockPastTheHead: a receipt the node serves for a block its head has
// not reached yet is held back until the head gets there. Delivered at once, a settlement answered success was
// read back at the node's latest block as not having happened (a CI failure: the seller's balance read right
// after a successful settle was the old one).
func TestTheReceiptWatcherDeliversNoReceiptOfABlockPastTheHead(t *testing.T) {
	c := chaintest.New(t)
	lb := &laggingHead{Backend: c.Client}
	head, err := c.Client.HeaderByNumber(context.Background(), nil)
	if err != nil {
		t.Fatal(err)
	}
	lb.frozen.Store(head)
	rw := newReceiptWatcher(lb, 2*time.Millisecond)
	tx, err := c.SendTx(context.Background(), c.Payers[0], &c.Deployer.Address, nil)
	if err != nil {
		t.Fatal(err)
	}
	c.Commit()
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	if r, err := rw.wait(ctx, false, tx.Hash()); err == nil {
		t.Fatalf("got the receipt of block %d while the head is block %d", r.BlockNumber, head.Number)
	}
	lb.frozen.Store(nil)
	ctx, cancel = context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	r, err := rw.wait(ctx, false, tx.Hash())
	if err != nil || r.TxHash != tx.Hash() {
		t.Fatalf("once the head reached its block: receipt %v, %v", r, err)
	}
}
