package journal

import (
	"context"
	"fmt"
	"math/big"
	"path/filepath"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/x402-gateway/caddy-x402/chain/journal/pgtest"
)

// BenchmarkBoltClaimUpdateFinal measures whole settlements as the journal sees them: a claim, the update to
// broadcast and the update to final, three fsynced commits each. settlements/s is the figure to compare with
// the facilitator's target.
func BenchmarkBoltClaimUpdateFinal(b *testing.B) {
	for _, bc := range []struct {
		name        string
		parallelism int // goroutines per GOMAXPROCS; 0 runs serially
	}{
		{"serial", 0},
		{"parallel-x8", 8},
		{"parallel-x64", 64},
	} {
		b.Run(bc.name, func(b *testing.B) {
			s, err := OpenBolt(filepath.Join(b.TempDir(), "journal.db"), Options{})
			if err != nil {
				b.Fatal(err)
			}
			defer s.Close()
			var next atomic.Int64
			settle := func() {
				ctx := context.Background()
				n := next.Add(1)
				r := claimOf(int(n))
				r.Request = benchRequest
				rec, claimed, err := s.Claim(ctx, r)
				if err != nil || !claimed {
					b.Errorf("claim %d: %v %v", n, claimed, err)
					return
				}
				if _, err := s.Update(ctx, rec.ID, toBroadcast("0x"+strconv.FormatInt(n, 16))); err != nil {
					b.Error(err)
					return
				}
				if _, err := s.Update(ctx, rec.ID, toFinal(true)); err != nil {
					b.Error(err)
				}
			}
			b.ReportAllocs()
			b.ResetTimer()
			if bc.parallelism == 0 {
				for b.Loop() {
					settle()
				}
			} else {
				b.SetParallelism(bc.parallelism)
				b.RunParallel(func(pb *testing.PB) {
					for pb.Next() {
						settle()
					}
				})
			}
			b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "settlements/s")
		})
	}
}

// BenchmarkPostgresClaim measures claims of distinct payments in the PostgreSQL store (each an INSERT ... ON
// CONFLICT DO NOTHING, one round trip and one commit) from 1, 8 and 64 concurrent writers, each with a
// connection of its own (pool_max_conns is the number of writers), on a fresh database of the test server
// (pgtest: fsync on, synchronous_commit on).
func BenchmarkPostgresClaim(b *testing.B) {
	for _, writers := range []int{1, 8, 64} {
		b.Run(fmt.Sprintf("writers-%d", writers), func(b *testing.B) {
			s, err := OpenPostgres(context.Background(), pgtest.Shared(b)+fmt.Sprintf("&pool_max_conns=%d", writers), Options{})
			if err != nil {
				b.Fatal(err)
			}
			defer s.Close()
			// Open every writer's connection before the clock starts.
			var conns []*pgxpool.Conn
			for range writers {
				conn, err := s.pool.Acquire(context.Background())
				if err != nil {
					b.Fatal(err)
				}
				conns = append(conns, conn)
			}
			for _, c := range conns {
				c.Release()
			}
			var next atomic.Int64
			b.ReportAllocs()
			b.ResetTimer()
			var wg sync.WaitGroup
			for range writers {
				wg.Go(func() {
					for {
						n := next.Add(1)
						if n > int64(b.N) {
							return
						}
						r := claimOf(int(n))
						r.Request = benchRequest
						if _, claimed, err := s.Claim(context.Background(), r); err != nil || !claimed {
							b.Errorf("claim %d: %v %v", n, claimed, err)
							return
						}
					}
				})
			}
			wg.Wait()
			b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "claims/s")
		})
	}
}

// benchRequest is a settle request of realistic size (a permit2 payload with its requirements), about 1.2 kB.
var benchRequest = []byte(`{"x402Version":2,"paymentPayload":{"x402Version":2,"accepted":{"scheme":"exact","network":"eip155:84532",` +
	`"amount":"10000","asset":"0x036CbD53842c5426634e7929541eC2318f3dCF7e","payTo":"0x209693Bc6afc0C5328bA36FaF03C514EF312287C",` +
	`"maxTimeoutSeconds":60,"extra":{"assetTransferMethod":"permit2","name":"USDC","version":"2"}},"payload":{"signature":"0x` +
	`2d6a7588d6acca505cbf0d9a4a227e0c52c6c34008c8e8986a1283259764173608a2ce6496642e377d6da8dbbf5836e9bd15092f9ecab05ded3d6293af148b571c",` +
	`"permit2Authorization":{"from":"0x857b06519E91e3A54538791bDbb0E22373e36b66","permitted":{"token":"0x036CbD53842c5426634e7929541eC2318f3dCF7e",` +
	`"amount":"10000"},"spender":"0x402085c248EeA27D92E8b30b2C58ed07f9E20001","nonce":"71629105226137346455519519395046418542406318049917617963553498398725043232281",` +
	`"deadline":"1767225600","witness":{"to":"0x209693Bc6afc0C5328bA36FaF03C514EF312287C","validAfter":"1767224900"}}}},` +
	`"paymentRequirements":{"scheme":"exact","network":"eip155:84532","amount":"10000","asset":"0x036CbD53842c5426634e7929541eC2318f3dCF7e",` +
	`"payTo":"0x209693Bc6afc0C5328bA36FaF03C514EF312287C","maxTimeoutSeconds":60,"extra":{"assetTransferMethod":"permit2","name":"USDC","version":"2"}}}`)

// BenchmarkPostgresHoldAndClaimOnePayer measures settlements' claims with their funds holds and the records of
// their signed transactions (HoldClaimAndSign, through claimWithHold; until 2026-11-27 the claim and the hold
// alone, HoldAndClaim, which settlements no longer used) of
// distinct payments of one payer, from 1, 8 and 32 concurrent writers, on a fresh database of the test server
// (fsync on). One payer's holds are serialized by its key's row lock: what that lock is held across is what bounds
// a busy payer's settlements (a transaction committed synchronously holds it across the WAL flush).
func BenchmarkPostgresHoldAndClaimOnePayer(b *testing.B) {
	for _, writers := range []int{1, 8, 32} {
		b.Run(fmt.Sprintf("writers-%d", writers), func(b *testing.B) {
			s, err := OpenPostgres(context.Background(), pgtest.Shared(b)+fmt.Sprintf("&pool_max_conns=%d", writers), Options{})
			if err != nil {
				b.Fatal(err)
			}
			defer s.Close()
			key := fmt.Sprintf("bench-one-payer-%d-%d", writers, time.Now().UnixNano())
			base := int(time.Now().UnixNano() % 1e9)
			avail := new(big.Int).Lsh(big.NewInt(1), 200)
			var next atomic.Int64
			b.ResetTimer()
			var wg sync.WaitGroup
			for range writers {
				wg.Go(func() {
					for {
						n := next.Add(1)
						if n > int64(b.N) {
							return
						}
						r := claimOf(base + int(n))
						r.Request = benchRequest
						h := holdOf(base+int(n), key, 1)
						if out, err := claimWithHold(context.Background(), s, h, avail, r); err != nil || !out.Claimed || !out.Held {
							b.Errorf("hold and claim %d: %+v %v", n, out, err)
							return
						}
					}
				})
			}
			wg.Wait()
			b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "settlements/s")
		})
	}
}
