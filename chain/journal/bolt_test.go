package journal

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	bolt "go.etcd.io/bbolt"

	"github.com/x402-gateway/caddy-x402/internal/racepass"
)

func TestOpenBoltCreatesAPrivateFileAndItsDirectories(t *testing.T) {
	path := filepath.Join(t.TempDir(), "state", "x402", "journal.db")
	s, err := OpenBolt(path, Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	info, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	if perm := info.Mode().Perm(); perm&0o077 != 0 {
		t.Fatalf("journal file mode = %v, want no access for group or others", perm)
	}
	dir, _ := os.Stat(filepath.Dir(path))
	if perm := dir.Mode().Perm(); perm&0o077 != 0 {
		t.Fatalf("created directory mode = %v, want no access for group or others", perm)
	}
}

func TestOpenBoltRefusesAnEmptyPath(t *testing.T) {
	if _, err := OpenBolt("", Options{}); err == nil {
		t.Fatal("OpenBolt(\"\") succeeded")
	}
}

func TestOpenBoltFailsQuicklyWhenTheFileIsAlreadyOpen(t *testing.T) {
	path := filepath.Join(t.TempDir(), "journal.db")
	first, err := OpenBolt(path, Options{})
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	second, err := OpenBolt(path, Options{OpenTimeout: 100 * time.Millisecond})
	waited := time.Since(start)
	if err == nil {
		second.Close()
		t.Fatal("second OpenBolt of a locked file succeeded")
	}
	if !errors.Is(err, ErrLocked) || !strings.Contains(err.Error(), path) {
		t.Fatalf("second OpenBolt error = %v; want ErrLocked naming %s", err, path)
	}
	if waited > 2*time.Second {
		t.Fatalf("second OpenBolt took %v to give up, want about its 100ms timeout", waited)
	}
	if err := first.Close(); err != nil {
		t.Fatal(err)
	}
	third, err := OpenBolt(path, Options{})
	if err != nil {
		t.Fatalf("OpenBolt after the holder closed: %v", err)
	}
	third.Close()
}

func TestOpenBoltRefusesAFileOfAnotherLayout(t *testing.T) {
	path := filepath.Join(t.TempDir(), "journal.db")
	db, err := bolt.Open(path, 0o600, nil)
	if err != nil {
		t.Fatal(err)
	}
	err = db.Update(func(tx *bolt.Tx) error {
		b, err := tx.CreateBucket(bucketMeta)
		if err != nil {
			return err
		}
		return b.Put(keyLayout, []byte("3"))
	})
	db.Close()
	if err != nil {
		t.Fatal(err)
	}
	if s, err := OpenBolt(path, Options{}); err == nil || !strings.Contains(err.Error(), `layout "3"`) {
		if s != nil {
			s.Close()
		}
		t.Fatalf("OpenBolt of a layout-3 file: %v; want a refusal naming the layout", err)
	}
}

// TestOpenBoltUpgradesALayout1FileKeepingItsServedPayments opens a file as the release before the served bucket
// wrote it: a payment served there stays served (MarkServed refuses it), an unserved one can still be marked,
// and the file is layout 2 afterwards, so that release refuses it rather than serve a served payment again.
func TestOpenBoltUpgradesALayout1FileKeepingItsServedPayments(t *testing.T) {
	path := filepath.Join(t.TempDir(), "journal.db")
	servedAt := time.Date(2026, 3, 1, 12, 0, 1, 500, time.UTC)
	served, unserved := claimOf(90), claimOf(91)
	served.Served, served.ServedAt, served.Async = true, servedAt, true
	db, err := bolt.Open(path, 0o600, nil)
	if err != nil {
		t.Fatal(err)
	}
	err = db.Update(func(tx *bolt.Tx) error {
		meta, err := tx.CreateBucket(bucketMeta)
		if err != nil {
			return err
		}
		if err := meta.Put(keyLayout, layoutV1); err != nil {
			return err
		}
		for _, name := range [][]byte{bucketRecords, bucketPending, bucketFinals} {
			if _, err := tx.CreateBucket(name); err != nil {
				return err
			}
		}
		for _, r := range []Record{served, unserved} {
			r.State = StateClaimed
			enc, err := encodeRecord(&r)
			if err != nil {
				return err
			}
			if err := tx.Bucket(bucketRecords).Put(r.ID[:], enc); err != nil {
				return err
			}
			if err := tx.Bucket(bucketPending).Put(r.ID[:], []byte{}); err != nil {
				return err
			}
		}
		return nil
	})
	db.Close()
	if err != nil {
		t.Fatal(err)
	}

	s, err := OpenBolt(path, Options{})
	if err != nil {
		t.Fatalf("OpenBolt of a layout-1 file: %v", err)
	}
	ctx := context.Background()
	if err := s.MarkServed(ctx, served.ID, time.Now()); !errors.Is(err, ErrServed) {
		t.Errorf("MarkServed of the payment layout 1 recorded as served: %v, want ErrServed", err)
	}
	if got, _, err := s.Get(ctx, served.ID); err != nil || !got.Served || !got.ServedAt.Equal(servedAt) {
		t.Errorf("the served payment after the upgrade: served %v at %s, %v; want served at %s", got.Served, got.ServedAt, err, servedAt)
	}
	if async, err := s.PendingOf(ctx, true); err != nil || len(async) != 1 || async[0].ID != served.ID {
		t.Errorf("PendingOf(async) after the upgrade = %v, %v; want the async payment layout 1 wrote", async, err)
	}
	if others, err := s.PendingOf(ctx, false); err != nil || len(others) != 1 || others[0].ID != unserved.ID {
		t.Errorf("PendingOf(not async) after the upgrade = %v, %v; want the other payment", others, err)
	}
	if err := s.MarkServed(ctx, unserved.ID, time.Now()); err != nil {
		t.Errorf("MarkServed of the unserved payment after the upgrade: %v", err)
	}
	s.Close()

	db, err = bolt.Open(path, 0o600, &bolt.Options{ReadOnly: true})
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	_ = db.View(func(tx *bolt.Tx) error {
		if got := tx.Bucket(bucketMeta).Get(keyLayout); string(got) != string(layoutV2) {
			t.Errorf("layout after the upgrade = %q, want %q", got, layoutV2)
		}
		return nil
	})
}

// Environment of the helper process the crash test starts and kills.
const (
	envCrashFile  = "JOURNAL_CRASH_FILE"
	envCrashRound = "JOURNAL_CRASH_ROUND"
)

// TestBoltHelperProcessWritesUntilKilled is not a test: run by TestBoltKeepsCommittedRecordsAcrossKills in a
// child process, it settles payments as fast as it can and reports each committed step on stdout.
func TestBoltHelperProcessWritesUntilKilled(t *testing.T) {
	path := os.Getenv(envCrashFile)
	if path == "" {
		t.Skip("helper process for TestBoltKeepsCommittedRecordsAcrossKills")
	}
	round, _ := strconv.Atoi(os.Getenv(envCrashRound))
	s, err := OpenBolt(path, Options{OpenTimeout: 5 * time.Second})
	if err != nil {
		fmt.Println("error", err)
		os.Exit(2)
	}
	var mu sync.Mutex
	report := func(step string, id ID) {
		mu.Lock()
		defer mu.Unlock()
		fmt.Fprintln(os.Stdout, step, id)
	}
	ctx := context.Background()
	var wg sync.WaitGroup
	for g := range 8 {
		wg.Go(func() {
			for i := 0; ; i++ {
				n := round*1_000_000 + g*100_000 + i
				r, claimed, err := s.Claim(ctx, claimOf(n))
				if err != nil || !claimed {
					fmt.Println("error claim", n, claimed, err)
					os.Exit(2)
				}
				report("claimed", r.ID)
				if i%5 == 4 {
					report("releasing", r.ID)
					if err := s.Release(ctx, r); err != nil {
						fmt.Println("error release", err)
						os.Exit(2)
					}
					report("released", r.ID)
					continue
				}
				if _, err := s.Update(ctx, r.ID, toBroadcast(fmt.Sprintf("0x%x", n))); err != nil {
					fmt.Println("error broadcast", err)
					os.Exit(2)
				}
				report("broadcast", r.ID)
				if _, err := s.Update(ctx, r.ID, toFinal(true)); err != nil {
					fmt.Println("error final", err)
					os.Exit(2)
				}
				report("final", r.ID)
			}
		})
	}
	wg.Wait()
}

func TestBoltKeepsCommittedRecordsAcrossKills(t *testing.T) {
	if testing.Short() {
		t.Skip("starts and kills 20 processes")
	}
	racepass.Once(t, "20 writer processes SIGKILLed: what it checks is the file on disk; the journal's concurrency runs under -race in the package's other tests")
	path := filepath.Join(t.TempDir(), "journal.db")
	seed := uint64(time.Now().UnixNano())
	rng := rand.New(rand.NewPCG(seed, 0))
	t.Logf("seed %d", seed)

	// last holds the last step each payment's writer reported as committed, over every round.
	last := make(map[ID]string)
	const rounds = 20
	for round := range rounds {
		lines := runUntilKilled(t, path, round, time.Duration(20+rng.IntN(150))*time.Millisecond)
		steps := 0
		for _, line := range lines {
			step, idText, _ := strings.Cut(line, " ")
			switch step {
			case "claimed", "releasing", "released", "broadcast", "final":
				id, err := parseID(idText)
				if err != nil {
					t.Fatalf("round %d: helper wrote %q: %v", round, line, err)
				}
				last[id] = step
				steps++
			case "error":
				t.Fatalf("round %d: helper failed: %s", round, line)
			}
		}
		if steps == 0 {
			t.Fatalf("round %d: helper reported no committed step before it was killed", round)
		}
		checkAfterCrash(t, path, round, last)
	}
	t.Logf("%d payments checked after %d kills", len(last), rounds)
}

// runUntilKilled runs the helper process on path, SIGKILLs it about d after its first committed write, and
// returns what it reported.
func runUntilKilled(t *testing.T, path string, round int, d time.Duration) []string {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^TestBoltHelperProcessWritesUntilKilled$")
	cmd.Env = append(os.Environ(), envCrashFile+"="+path, envCrashRound+"="+strconv.Itoa(round))
	cmd.Stderr = os.Stderr
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	var lines []string
	writing := make(chan struct{}) // closed at the first committed step, so start-up time does not count
	done := make(chan struct{})
	go func() {
		defer close(done)
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			if len(lines) == 0 {
				close(writing)
			}
			lines = append(lines, sc.Text())
		}
	}()
	select {
	case <-writing:
		time.Sleep(d)
	case <-done:
	case <-time.After(10 * time.Second):
	}
	if err := cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	<-done
	cmd.Wait()
	return lines
}

// checkAfterCrash reopens the journal and checks every reported step survived, and that the pending index
// agrees with the records.
func checkAfterCrash(t *testing.T, path string, round int, last map[ID]string) {
	t.Helper()
	s, err := OpenBolt(path, Options{})
	if err != nil {
		t.Fatalf("round %d: reopen after kill: %v", round, err)
	}
	defer s.Close()
	ctx := context.Background()
	for id, step := range last {
		r, ok, err := s.Get(ctx, id)
		if err != nil {
			t.Fatalf("round %d: %s: %v", round, id, err)
		}
		var good bool
		switch step {
		case "claimed":
			good = ok
		case "releasing":
			good = !ok || r.State == StateClaimed
		case "released":
			good = !ok
		case "broadcast":
			good = ok && r.State.rank() >= StateBroadcast.rank() && r.TxHash != ""
		case "final":
			good = ok && r.State == StateFinal && r.Response != nil && r.Response.Success
		}
		if !good {
			t.Fatalf("round %d: %s was reported %s but the journal has present=%v state=%q", round, id, step, ok, r.State)
		}
	}
	pending, err := s.Pending(ctx)
	if err != nil {
		t.Fatalf("round %d: Pending: %v", round, err)
	}
	inPending := make(map[ID]bool, len(pending))
	for _, r := range pending {
		if r.State == StateFinal {
			t.Fatalf("round %d: Pending lists final record %s", round, r.ID)
		}
		inPending[r.ID] = true
	}
	for id := range last {
		r, ok, _ := s.Get(ctx, id)
		if ok && r.State != StateFinal && !inPending[id] {
			t.Fatalf("round %d: %s is %q but Pending does not list it", round, id, r.State)
		}
	}
	if n, err := s.Backlog(ctx); err != nil || n != len(pending) {
		t.Fatalf("round %d: Backlog = %d, %v; Pending listed %d", round, n, err, len(pending))
	}
}

func TestBoltCommitRetriesTheRestOfABatchWithoutTheOperationThatFailed(t *testing.T) {
	s, err := OpenBolt(filepath.Join(t.TempDir(), "journal.db"), Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	now := time.Now()
	claimed := make([]bool, 3)
	op := func(i int, fail bool) *boltOp {
		return &boltOp{done: make(chan error, 1), run: func(t *boltTxn) {
			_, claimed[i], _ = claimIn(t, claimOf(i), now)
			if fail {
				panic("boom") // after its write, so the whole transaction holds half of it
			}
		}}
	}
	batch := []*boltOp{op(0, false), op(1, true), op(2, false)}
	s.commit(batch)
	for i, o := range batch {
		if err := <-o.done; err != nil {
			t.Fatalf("op %d: commit error %v", i, err)
		}
	}
	if batch[1].panicked != "boom" {
		t.Fatalf("failed op carries panic %v, want boom", batch[1].panicked)
	}
	ctx := context.Background()
	for i, want := range []bool{true, false, true} {
		if _, ok, err := s.Get(ctx, claimOf(i).ID); ok != want || err != nil {
			t.Errorf("record %d present = %v (%v), want %v", i, ok, err, want)
		}
		if want && !claimed[i] {
			t.Errorf("op %d did not report its claim", i)
		}
	}
	if n, _ := s.Backlog(ctx); n != 2 {
		t.Fatalf("Backlog = %d, want 2: the rolled-back claim must leave no pending entry", n)
	}
}

func TestBoltPruneWorksThroughMoreRecordsThanOneChunk(t *testing.T) {
	clock := newTestClock()
	s, err := OpenBolt(filepath.Join(t.TempDir(), "journal.db"), Options{Clock: clock.Now})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	ctx := context.Background()
	const total = 5*pruneChunk/2 + 7
	var cutoff time.Time
	// One write for all records keeps the test fast; the order of FinalAt is what Prune reads.
	err = s.write(ctx, func(tx *boltTxn) {
		for i := range total {
			now := clock.now.Add(time.Duration(i) * time.Millisecond)
			if i == 2*pruneChunk+3 {
				cutoff = now
			}
			r, _, err := claimIn(tx, claimOf(i), now)
			if err == nil {
				_, err = updateIn(tx, r.ID, toFinal(true), now)
			}
			if err != nil {
				panic(err)
			}
		}
	})
	if err != nil {
		t.Fatal(err)
	}
	n, err := s.Prune(ctx, cutoff)
	if err != nil || n != 2*pruneChunk+3 {
		t.Fatalf("Prune = %d, %v; want %d", n, err, 2*pruneChunk+3)
	}
	if left, _ := s.Count(ctx); left != total-n {
		t.Fatalf("Count after Prune = %d, want %d", left, total-n)
	}
}
