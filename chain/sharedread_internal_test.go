package chain

import (
	"context"
	"errors"
	"math/big"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ethereum/go-ethereum/core/types"
)

// stuckNode is a Backend whose head block and priority fee reads block until release is closed; it counts the
// head reads.
// Everything else it would be asked panics (the embedded nil Backend): these tests ask nothing else.
type stuckNode struct {
	Backend
	release      chan struct{}
	heads        atomic.Int32
	head         *types.Header
	tip, chainID *big.Int
}

func newStuckNode() *stuckNode {
	return &stuckNode{release: make(chan struct{}), head: &types.Header{Number: big.NewInt(7), BaseFee: big.NewInt(100), Time: 1_000},
		tip: big.NewInt(3), chainID: big.NewInt(72344)}
}

func (n *stuckNode) HeaderByNumber(ctx context.Context, _ *big.Int) (*types.Header, error) {
	n.heads.Add(1)
	select {
	case <-n.release:
		return n.head, nil
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

func (n *stuckNode) SuggestGasTipCap(ctx context.Context) (*big.Int, error) {
	select {
	case <-n.release:
		return n.tip, nil
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

// readsConcurrently runs three reads of read on a node stuck until released: a first that waits, a second
// whose caller gives up after a short while and must get its own deadline's error without waiting on the first,
// and a third that must share the first's read.
func readsConcurrently[T any](t *testing.T, node *stuckNode, reads func() *atomic.Int32, read func(context.Context) (T, error)) {
	t.Helper()
	type result struct {
		v   T
		err error
	}
	first := make(chan result, 1)
	go func() {
		v, err := read(context.Background())
		first <- result{v, err}
	}()
	for reads().Load() == 0 {
		time.Sleep(time.Millisecond)
	}

	impatient := make(chan error, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
		defer cancel()
		_, err := read(ctx)
		impatient <- err
	}()
	select {
	case err := <-impatient:
		if !errors.Is(err, context.DeadlineExceeded) {
			t.Errorf("the impatient caller got %v, want its own deadline", err)
		}
	case <-time.After(5 * time.Second):
		t.Error("a caller with a 50ms deadline is still waiting 5s later behind a read that hangs")
	}

	third := make(chan result, 1)
	go func() {
		v, err := read(context.Background())
		third <- result{v, err}
	}()
	time.Sleep(20 * time.Millisecond)
	close(node.release)
	a, b := <-first, <-third
	if a.err != nil || b.err != nil {
		t.Fatalf("reads after the node answered: %v, %v", a.err, b.err)
	}
	if got := reads().Load(); got != 1 {
		t.Errorf("the node was read %d times; want one read shared by every caller", got)
	}
}

func TestAHangingHeadReadHoldsUpNoCallerPastItsOwnDeadline(t *testing.T) {
	node := newStuckNode()
	n := &network{backend: node, headTTL: time.Second, now: time.Now}
	readsConcurrently(t, node, func() *atomic.Int32 { return &node.heads }, n.chainHead)
}

func TestAHangingFeeQuoteHoldsUpNoSenderPastItsOwnDeadline(t *testing.T) {
	node := newStuckNode()
	s := newSender(node, node.chainID, FeePolicy{CacheFor: time.Second}, time.Now)
	// A quote reads the head block (for its base fee) first: that is where it hangs.
	readsConcurrently(t, node, func() *atomic.Int32 { return &node.heads }, s.feeQuote)
}
