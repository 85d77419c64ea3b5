package chain

import (
	"context"
	"errors"
	"math/big"
	"sync"
	"time"

	"github.com/ethereum/go-ethereum/common"
	"github.com/ethereum/go-ethereum/common/hexutil"
	"github.com/ethereum/go-ethereum/rpc"
)

// batchCaller is a backend that sends several JSON-RPC calls in one request.
type batchCaller interface {
	BatchCallContext(ctx context.Context, b []rpc.BatchElem) error
}

// errNoBatch says a backend cannot send JSON-RPC batches; callers make their calls one by one.
var errNoBatch = errors.New("the backend does not send JSON-RPC batches")

// BatchCallContext sends the calls of b in one JSON-RPC request; each element gets its own result or error.
func (c *RPCClient) BatchCallContext(ctx context.Context, b []rpc.BatchElem) error {
	return c.Client.Client().BatchCallContext(ctx, b)
}

// BatchCallContext sends the batch to the first endpoint that answers it (see do). Every element's result and
// error are reset before each try. A node answers a batch call by call: each endpoint is given callTimeout and
// a further eighth of it per call past the first, so that a full batch on a busy node is not taken for a hang.
func (f *Failover) BatchCallContext(ctx context.Context, b []rpc.BatchElem) error {
	scaled := *f
	if f.callTimeout > 0 && len(b) > 1 {
		scaled.callTimeout += f.callTimeout * time.Duration(len(b)-1) / 8
	}
	_, err := do(ctx, &scaled, func(ctx context.Context, be Backend) (struct{}, error) {
		bc, ok := be.(batchCaller)
		if !ok {
			return struct{}{}, errNoBatch
		}
		for i := range b {
			b[i].Error = nil
		}
		return struct{}{}, bc.BatchCallContext(ctx, b)
	})
	return err
}

// callBatcher makes reads at the latest block (eth_getStorageAt) for concurrent callers, in as few JSON-RPC
// requests as it can: a read that finds fewer than maxLanes requests in flight goes out at once, alone; the
// reads that come while every lane is in flight go out together, in one batch, when a lane returns. Nothing
// waits for company, a burst of callers costs the node a handful of requests instead of one each, and a slow
// answer (a node busy sealing) holds up one lane, not every read behind it. A backend that cannot batch gets
// each read alone.
type callBatcher struct {
	backend Backend

	mu    sync.Mutex
	queue []*batchedCall
	lanes int // requests in flight
}

// maxLanes bounds the requests a callBatcher has in flight at once.
const maxLanes = 4

type batchedCall struct {
	method string
	args   []any
	out    []byte
	err    error
	done   chan struct{}
}

// maxBatch bounds the calls of one request: providers cap batches (often at 100 or less), and a node answers a
// batch one call after another, so a long one makes every caller in it wait for the last.
const maxBatch = 16

// storageAt reads one storage slot of a contract at the latest block: no EVM run, the cheapest read a node serves.
func (cb *callBatcher) storageAt(ctx context.Context, contract common.Address, slot common.Hash) ([]byte, error) {
	if ls, ok := cb.backend.(localStorageReader); ok {
		// A node in this process: its state answers at once, with nothing to batch.
		if b, err := ls.LocalStorageAt(ctx, contract, slot); !errors.Is(err, errNoLocalStorage) {
			return b, err
		}
	}
	return cb.do(ctx, "eth_getStorageAt", []any{contract, slot, "latest"}, func() ([]byte, error) {
		if sr, ok := cb.backend.(storageReader); ok {
			return sr.StorageAt(ctx, contract, slot, nil)
		}
		return nil, errNoBatch
	})
}

// storageReader is a backend that reads storage slots.
type storageReader interface {
	StorageAt(ctx context.Context, account common.Address, key common.Hash, blockNumber *big.Int) ([]byte, error)
}

func (cb *callBatcher) do(ctx context.Context, method string, args []any, alone func() ([]byte, error)) ([]byte, error) {
	bc, ok := cb.backend.(batchCaller)
	if !ok {
		return alone()
	}
	c := &batchedCall{method: method, args: args, done: make(chan struct{})}
	cb.mu.Lock()
	cb.queue = append(cb.queue, c)
	if cb.lanes < maxLanes {
		cb.lanes++
		go cb.run(bc)
	}
	cb.mu.Unlock()
	select {
	case <-c.done:
		if errors.Is(c.err, errNoBatch) {
			return alone()
		}
		return c.out, c.err
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

// run sends what is queued, batch after batch, until the queue is empty.
func (cb *callBatcher) run(bc batchCaller) {
	for {
		cb.mu.Lock()
		n := min(len(cb.queue), maxBatch)
		if n == 0 {
			cb.lanes--
			cb.mu.Unlock()
			return
		}
		batch := cb.queue[:n:n]
		cb.queue = cb.queue[n:]
		cb.mu.Unlock()

		elems := make([]rpc.BatchElem, len(batch))
		results := make([]hexutil.Bytes, len(batch))
		for i, c := range batch {
			elems[i] = rpc.BatchElem{Method: c.method, Args: c.args, Result: &results[i]}
		}
		// The batch outlives any one caller: each gives up on its own context, and a node that never answers is
		// bounded by this timeout (a Failover's per-endpoint timeout comes first).
		ctx, cancel := context.WithTimeout(context.Background(), defaultRPCTimeout)
		err := bc.BatchCallContext(ctx, elems)
		cancel()
		for i, c := range batch {
			switch {
			case err != nil:
				c.err = err
			case elems[i].Error != nil:
				c.err = elems[i].Error
			default:
				c.out = results[i]
			}
			close(c.done)
		}
	}
}
