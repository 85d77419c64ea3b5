package journal

import (
	"context"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/x402-gateway/caddy-x402/chain/journal/pgtest"
)

// serverCPU is the CPU time, in clock ticks, of the PostgreSQL server whose backend pid is pid: its postmaster and
// every process it started.
func serverCPU(pid int) int64 {
	stat := func(p string) []string {
		b, err := os.ReadFile("/proc/" + p + "/stat")
		if err != nil {
			return nil
		}
		s := string(b)
		return strings.Fields(s[strings.LastIndexByte(s, ')')+2:])
	}
	f := stat(strconv.Itoa(pid))
	if f == nil {
		return 0
	}
	master := f[1]
	var tot int64
	ents, _ := os.ReadDir("/proc")
	for _, e := range ents {
		f := stat(e.Name())
		if f == nil || (f[1] != master && e.Name() != master) {
			continue
		}
		u, _ := strconv.ParseInt(f[11], 10, 64)
		s, _ := strconv.ParseInt(f[12], 10, 64)
		tot += u + s
	}
	return tot
}

// BenchmarkPostgresFinalWritesGrouped measures a gate's last write of a served payment (UpdateKnownIdle: the
// record's final change with the in-flight mark cleared, one statement) from 32 concurrent writers, each write
// alone (its own implicit transaction and commit) and grouped with the others queued behind the groups in flight
// (postgres_group.go), on a fresh database of the test server (fsync on). pg-µs/op is the CPU time the server's
// processes spent a write, read from /proc (Linux; 0 elsewhere), which is what the journal costs a payment on a
// machine whose cores the gateway, the chain and the database share.
func BenchmarkPostgresFinalWritesGrouped(b *testing.B) {
	for _, off := range []bool{true, false} {
		b.Run(map[bool]string{true: "alone", false: "grouped"}[off], func(b *testing.B) {
			ctx := context.Background()
			s, err := OpenPostgres(ctx, pgtest.Shared(b)+"&pool_max_conns=32", Options{})
			if err != nil {
				b.Fatal(err)
			}
			defer s.Close()
			s.group.off = off
			var pid int
			if err := s.pool.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&pid); err != nil {
				b.Fatal(err)
			}
			recs := make([]Record, b.N)
			for i := range recs {
				r := claimOf(i)
				r.Request = benchRequest
				r.RawTx = make([]byte, 600)
				recs[i], _, err = s.Claim(ctx, r)
				if err != nil {
					b.Fatal(err)
				}
			}
			var next atomic.Int64
			c0 := serverCPU(pid)
			b.ResetTimer()
			var wg sync.WaitGroup
			for range 32 {
				wg.Go(func() {
					for {
						n := next.Add(1)
						if n > int64(b.N) {
							return
						}
						_, _, err := UpdateKnownIdle(ctx, s, recs[n-1], func(r *Record) error {
							r.Served, r.ServedAt = true, time.Now()
							return nil
						})
						if err != nil {
							b.Error(err)
							return
						}
					}
				})
			}
			wg.Wait()
			b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "writes/s")
			b.ReportMetric(float64(serverCPU(pid)-c0)*10000/float64(b.N), "pg-µs/op")
		})
	}
}
