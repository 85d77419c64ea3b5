package devchain

import (
	"sync"
	"time"

	"github.com/ethereum/go-ethereum/core"
	"github.com/ethereum/go-ethereum/core/txpool"
	"github.com/ethereum/go-ethereum/eth/catalyst"
	"github.com/ethereum/go-ethereum/event"
)

// sealer seals the dev chain's blocks through its simulated beacon: every period, or with period 0 whenever the
// transaction pool holds executable transactions. go-ethereum's simulated beacon has sealing loops of its own
// (one per period, one in its API for period 0), which its Stop tells to end and does not wait for: a block they
// sealed while the node closed its database ended the process ("Failed to write bad blocks", leveldb: closed,
// logged at Crit, which exits). The dev chain starts neither and seals here, a node lifecycle whose Stop returns
// once no seal is under way. The node stops lifecycles in the reverse order of registration: registered after
// the Ethereum service, the sealer stops before the service closes the database.
type sealer struct {
	beacon *catalyst.SimulatedBeacon
	pool   *txpool.TxPool
	period time.Duration // 0: a block whenever transactions arrive

	nudges chan struct{} // a block now, and then until nothing executable waits
	quit   chan struct{}
	done   chan struct{} // closed when loop returned; nil before Start

	mu      sync.Mutex
	stopped bool
}

func newSealer(beacon *catalyst.SimulatedBeacon, pool *txpool.TxPool, period time.Duration) *sealer {
	return &sealer{beacon: beacon, pool: pool, period: period, nudges: make(chan struct{}, 1), quit: make(chan struct{})}
}

// Start subscribes to the pool's transactions before it returns, so a transaction sent once the node started
// is seen.
func (s *sealer) Start() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.stopped || s.done != nil {
		return nil
	}
	var txs chan core.NewTxsEvent
	var sub event.Subscription
	if s.period == 0 {
		txs = make(chan core.NewTxsEvent, 16)
		sub = s.pool.SubscribeTransactions(txs, true)
	}
	s.done = make(chan struct{})
	go s.loop(txs, sub)
	return nil
}

// Stop ends the sealing and returns once a seal under way has ended. It may be called more than once, and
// before Start.
func (s *sealer) Stop() error {
	s.mu.Lock()
	if !s.stopped {
		s.stopped = true
		close(s.quit)
	}
	done := s.done
	s.mu.Unlock()
	if done != nil {
		<-done
	}
	return nil
}

// nudge asks for a block now (a transaction the pool took before the sealer subscribed waits for no other).
func (s *sealer) nudge() {
	select {
	case s.nudges <- struct{}{}:
	default:
	}
}

func (s *sealer) loop(txs chan core.NewTxsEvent, sub event.Subscription) {
	defer close(s.done)
	var tick <-chan time.Time
	if s.period > 0 {
		t := time.NewTicker(s.period)
		defer t.Stop()
		tick = t.C
	}
	// The pool's events are taken at once, apart from the sealing: the pool sends them while it takes a new head
	// in, which sealing waits for (TxPool.Sync); a sealer that read them only between seals would hold the pool
	// and the pool the sealer. Events that come while a block is sealed make one more round.
	arrived := make(chan struct{}, 1)
	if sub != nil {
		forwarded := make(chan struct{})
		defer func() { <-forwarded }()
		go func() {
			defer close(forwarded)
			defer sub.Unsubscribe()
			for {
				select {
				case <-s.quit:
					return
				case <-sub.Err():
					return // the pool closed
				case <-txs:
					select {
					case arrived <- struct{}{}:
					default:
					}
				}
			}
		}()
	}
	for {
		select {
		case <-s.quit:
			return
		case <-tick:
			s.beacon.Commit()
		case <-s.nudges:
			s.beacon.Commit()
			s.sealExecutable()
		case <-arrived:
			s.sealExecutable()
		}
	}
}

// sealExecutable seals blocks while the pool holds executable transactions: one that arrived while a block was
// being sealed is not left waiting for the next arrival. A block that left as many waiting as before ends it (a
// transaction the pool counts executable and the block builder leaves out would have it seal empty blocks
// without end); the next arrival starts it again.
func (s *sealer) sealExecutable() {
	for last := -1; ; {
		select {
		case <-s.quit:
			return
		default:
		}
		_ = s.pool.Sync() // the pool takes the last block in before it counts what is left
		executable, _ := s.pool.Stats()
		if executable == 0 || (last >= 0 && executable >= last) {
			return
		}
		last = executable
		s.beacon.Commit()
	}
}
