package journal

import (
	"context"
	"errors"
	"fmt"
	"math/big"
	"reflect"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/x402-gateway/caddy-x402/x402"
)

const (
	testEscrow  = "0x4020074e9dF2ce1deE5A9C1b5c3f541D02a10003"
	testChannel = "0x00000000000000000000000000000000000000000000000000000000000000c1"
)

// chanKey is the key of the test channel n on the test network, as the rows spell it (lower case).
func chanKey(n int) ChannelKey {
	return ChannelKey{Network: testNetwork, Escrow: strings.ToLower(testEscrow), ID: fmt.Sprintf("0x%064x", 0xc000+n)}
}

// channelsOf is s as the channel rows' store.
func channelsOf(t *testing.T, s Store) Channels {
	t.Helper()
	c, ok := s.(Channels)
	if !ok {
		t.Fatalf("%T does not keep channels", s)
	}
	return c
}

// depositRead is a read of channel key holding deposit, nothing claimed, at block.
func depositRead(key ChannelKey, deposit int64, block uint64) ChannelRead {
	return ChannelRead{
		Key:          key,
		Config:       x402.ChannelConfig{Payer: testPayer, Receiver: "0x209693Bc6afc0C5328bA36FaF03C514EF312287C", Token: testAsset, WithdrawDelay: 900, Salt: testChannel},
		Deposit:      big.NewInt(deposit),
		TotalClaimed: new(big.Int),
		Block:        block,
	}
}

// voucherOf is a voucher to the cumulative amount to: its digest and signature name the amount, so that a row
// read back shows whose voucher it holds.
func voucherOf(to int64) Voucher {
	d := make([]byte, 32)
	big.NewInt(to).FillBytes(d)
	sig := make([]byte, 65)
	copy(sig, d)
	sig[64] = 27
	return Voucher{Signature: sig, Digest: d}
}

func mustObserve(t *testing.T, c Channels, read ChannelRead) Channel {
	t.Helper()
	got, err := c.ObserveChannel(context.Background(), read)
	if err != nil {
		t.Fatalf("ObserveChannel(%s at block %d): %v", read.Key, read.Block, err)
	}
	return got
}

func mustChannel(t *testing.T, c Channels, key ChannelKey) Channel {
	t.Helper()
	got, ok, err := c.Channel(context.Background(), key)
	if err != nil || !ok {
		t.Fatalf("Channel(%s) = found %v, %v", key, ok, err)
	}
	return got
}

// wantRow fails the test unless the row of key holds charged (by the voucher to that amount), the vouchers count,
// claimed and the claim in flight (tx "" for none).
func wantRow(t *testing.T, c Channels, key ChannelKey, charged, vouchers, claimed int64, claimTx string) Channel {
	t.Helper()
	got := mustChannel(t, c, key)
	if got.Charged.Int64() != charged || got.Vouchers != uint64(vouchers) || got.Claimed.Int64() != claimed || got.ClaimTx != claimTx {
		t.Fatalf("%s: charged %s, %d vouchers, claimed %s, claim in flight %q; want %d, %d, %d, %q",
			key, got.Charged, got.Vouchers, got.Claimed, got.ClaimTx, charged, vouchers, claimed, claimTx)
	}
	if charged > claimed && got.Vouchers > 0 && !reflect.DeepEqual(Voucher{Signature: got.Signature, Digest: got.Digest}, voucherOf(charged)) {
		t.Fatalf("%s at %d holds the signature and digest of another voucher", key, charged)
	}
	return got
}

// TestChannelsAcceptEachVoucherOnceFromExactlyTheLastAmountWithinTheDeposit is the voucher's compare-and-set, the
// same table on every store: a step from the amount the row holds to one within its deposit is taken and durable
// (a reopen keeps it); a replay, a step from another amount, a step above the deposit, on a channel withdrawn or
// with no row, or a malformed one, is refused with its error and changes nothing.
func TestChannelsAcceptEachVoucherOnceFromExactlyTheLastAmountWithinTheDeposit(t *testing.T) {
	forEachStore(t, func(t *testing.T, h harness) {
		clock := newTestClock()
		s := h.open(t, clock.Now)
		ctx := context.Background()
		key := chanKey(1)
		accept := func(from, to int64) (Channel, error) {
			v := voucherOf(to)
			v.By = fmt.Sprintf("request %d-%d", from, to)
			return channelsOf(t, s).AcceptVoucher(ctx, key, big.NewInt(from), big.NewInt(to), v)
		}
		if _, err := accept(0, 10); !errors.Is(err, ErrChannelNotFound) {
			t.Fatalf("a voucher of a channel with no row: %v, want ErrChannelNotFound", err)
		}
		if _, ok, err := channelsOf(t, s).Channel(ctx, key); ok || err != nil {
			t.Fatalf("a refused voucher made a row: %v, %v", ok, err)
		}
		first := mustObserve(t, channelsOf(t, s), depositRead(key, 100, 7))
		if first.Charged.Sign() != 0 || first.Deposit.Int64() != 100 || first.DepositBlock != 7 || !first.DepositReadAt.Equal(clock.Now()) {
			t.Fatalf("new row %+v; want charged 0, deposit 100 at block 7 read now", first)
		}
		for _, step := range []struct {
			name     string
			from, to int64
			want     error
			charged  int64
			vouchers int64
		}{
			{"the first step", 0, 10, nil, 10, 1},
			{"a replay of it", 0, 10, ErrChannelMoved, 10, 1},
			{"a step from an amount passed", 0, 20, ErrChannelMoved, 10, 1},
			{"a step from an amount not reached", 20, 30, ErrChannelMoved, 10, 1},
			{"a step above the deposit", 10, 101, ErrAboveDeposit, 10, 1},
			{"the next step", 10, 20, nil, 20, 2},
			{"a step that lowers the amount", 20, 15, ErrInvalidChannel, 20, 2},
			{"a step that keeps the amount", 20, 20, ErrInvalidChannel, 20, 2},
			{"a step to exactly the deposit", 20, 100, nil, 100, 3},
			{"a step past the deposit", 100, 110, ErrAboveDeposit, 100, 3},
		} {
			clock.Advance(time.Second)
			got, err := accept(step.from, step.to)
			if !errors.Is(err, step.want) || (err == nil) != (step.want == nil) {
				t.Fatalf("%s (%d to %d): %v, want %v", step.name, step.from, step.to, err, step.want)
			}
			if step.want == nil && (got.Charged.Int64() != step.to || !got.AcceptedAt.Equal(clock.Now())) {
				t.Fatalf("%s: returned the row at %s accepted at %s, want %d now", step.name, got.Charged, got.AcceptedAt, step.to)
			}
			if want := fmt.Sprintf("request %d-%d", step.from, step.to); step.want == nil && got.AcceptedBy != want {
				t.Fatalf("%s: accepted by %q, want %q", step.name, got.AcceptedBy, want)
			}
			if errors.Is(step.want, ErrChannelMoved) || errors.Is(step.want, ErrAboveDeposit) {
				if !strings.Contains(err.Error(), key.ID) {
					t.Fatalf("%s: the error %q does not name the channel", step.name, err)
				}
			}
			wantRow(t, channelsOf(t, s), key, step.charged, step.vouchers, 0, "")
		}
		// The key is the same in any case.
		upper := ChannelKey{Network: key.Network, Escrow: testEscrow, ID: "0X" + strings.ToUpper(key.ID[2:])}
		if got := mustChannel(t, channelsOf(t, s), upper); got.Charged.Int64() != 100 || got.Key != key {
			t.Fatalf("the row read by an upper-case key: %s at %s, want %s at 100", got.Key, got.Charged, key)
		}
		for _, bad := range []struct {
			name string
			key  ChannelKey
			v    Voucher
		}{
			{"no network", ChannelKey{Escrow: key.Escrow, ID: key.ID}, voucherOf(110)},
			{"an escrow that is no address", ChannelKey{Network: key.Network, Escrow: "0x40", ID: key.ID}, voucherOf(110)},
			{"an id that is no bytes32", ChannelKey{Network: key.Network, Escrow: key.Escrow, ID: "c1"}, voucherOf(110)},
			{"no signature", key, Voucher{Digest: voucherOf(110).Digest}},
			{"a short digest", key, Voucher{Signature: voucherOf(110).Signature, Digest: []byte{1}}},
		} {
			if _, err := channelsOf(t, s).AcceptVoucher(ctx, bad.key, big.NewInt(100), big.NewInt(110), bad.v); !errors.Is(err, ErrInvalidChannel) {
				t.Fatalf("a voucher with %s: %v, want ErrInvalidChannel", bad.name, err)
			}
		}
		// A deposit raised by a newer read lets the amount go on; an older read changes nothing.
		mustObserve(t, channelsOf(t, s), depositRead(key, 150, 9))
		if got := mustObserve(t, channelsOf(t, s), depositRead(key, 100, 8)); got.Deposit.Int64() != 150 || got.DepositBlock != 9 {
			t.Fatalf("a read of block 8 after one of block 9 left deposit %s at block %d, want 150 at 9", got.Deposit, got.DepositBlock)
		}
		if _, err := accept(100, 110); err != nil {
			t.Fatalf("a step within the raised deposit: %v", err)
		}
		// Refunded or withdrawn: no more vouchers.
		gone := depositRead(key, 0, 12)
		gone.Withdrawn = true
		if got := mustObserve(t, channelsOf(t, s), gone); !got.Withdrawn || !got.WithdrawnAt.Equal(clock.Now()) {
			t.Fatalf("a withdrawn read: withdrawn %v at %s", got.Withdrawn, got.WithdrawnAt)
		}
		if _, err := accept(110, 120); !errors.Is(err, ErrChannelWithdrawn) {
			t.Fatalf("a voucher of a withdrawn channel: %v, want ErrChannelWithdrawn", err)
		}
		// Deposited into again (the same configuration is the same channel): vouchers go on from where they were.
		mustObserve(t, channelsOf(t, s), depositRead(key, 200, 13))
		if _, err := accept(110, 120); err != nil {
			t.Fatalf("a voucher after a new deposit into a refunded channel: %v", err)
		}
		before := wantRow(t, channelsOf(t, s), key, 120, 5, 0, "")
		if before.Withdrawn || !before.WithdrawnAt.IsZero() {
			t.Fatalf("deposited into again, the row still says withdrawn at %s", before.WithdrawnAt)
		}

		// Closed and opened again, the store has every voucher it accepted, as it answered.
		s = h.reopen(t, s)
		after := mustChannel(t, channelsOf(t, s), key)
		if !reflect.DeepEqual(before, after) {
			t.Fatalf("after a reopen the row is\n%+v\nwant\n%+v", after, before)
		}
	})
}

// TestChannelsAClaimMarkedSentIsNotOfferedAgainUntilItIsKnownFailed: the claimer's side, on every store. A channel
// with an unclaimed amount is offered (Unclaimed) until a claim of it is marked sent; then it is listed in flight
// (after a reopen too: a claim lost in a crash is found again) and offered to no other claim, whatever is
// accepted meanwhile, until that claim is marked failed (offered again) or mined (claimed, and offered for what
// was accepted since). A claim that names a channel taken already, or an amount not accepted or claimed already,
// marks none of its channels.
func TestChannelsAClaimMarkedSentIsNotOfferedAgainUntilItIsKnownFailed(t *testing.T) {
	forEachStore(t, func(t *testing.T, h harness) {
		clock := newTestClock()
		s := h.open(t, clock.Now)
		ctx := context.Background()
		a, b, other := chanKey(1), chanKey(2), chanKey(3)
		other.Network = "eip155:1"
		for _, k := range []ChannelKey{a, b, other} {
			mustObserve(t, channelsOf(t, s), depositRead(k, 1000, 5))
		}
		accept := func(k ChannelKey, from, to int64) {
			t.Helper()
			clock.Advance(time.Second)
			if _, err := channelsOf(t, s).AcceptVoucher(ctx, k, big.NewInt(from), big.NewInt(to), voucherOf(to)); err != nil {
				t.Fatalf("accept %s %d to %d: %v", k, from, to, err)
			}
		}
		offered := func(want ...ChannelKey) {
			t.Helper()
			got, err := channelsOf(t, s).Unclaimed(ctx, testNetwork)
			if err != nil {
				t.Fatal(err)
			}
			var keys []ChannelKey
			for _, c := range got {
				keys = append(keys, c.Key)
			}
			if !reflect.DeepEqual(keys, want) {
				t.Fatalf("Unclaimed lists %v, want %v", keys, want)
			}
		}
		inFlight := func(want ...string) {
			t.Helper()
			got, err := channelsOf(t, s).ClaimsInFlight(ctx, testNetwork)
			if err != nil {
				t.Fatal(err)
			}
			var txs []string
			for _, c := range got {
				txs = append(txs, c.Key.ID[len(c.Key.ID)-1:]+"@"+c.ClaimTx[len(c.ClaimTx)-1:]+"="+c.ClaimAmount.String())
			}
			if !reflect.DeepEqual(txs, want) {
				t.Fatalf("ClaimsInFlight lists %v, want %v", txs, want)
			}
		}
		tx := func(n int) string { return fmt.Sprintf("0x%064x", n) }
		claim := func(k ChannelKey, amount int64) ChannelClaim { return ChannelClaim{Key: k, Amount: big.NewInt(amount)} }

		offered()
		accept(b, 0, 10)
		accept(a, 0, 10)
		accept(other, 0, 10)
		offered(b, a) // oldest unclaimed voucher first
		inFlight()
		if err := channelsOf(t, s).MarkClaimSent(ctx, tx(1), []ChannelClaim{claim(a, 10)}); err != nil {
			t.Fatalf("MarkClaimSent: %v", err)
		}
		offered(b)
		inFlight("1@1=10")
		accept(a, 10, 20) // accepted while the claim is in flight: still not offered
		offered(b)
		for _, bad := range []struct {
			name   string
			claims []ChannelClaim
			want   error
		}{
			{"a channel with a claim in flight", []ChannelClaim{claim(b, 10), claim(a, 20)}, ErrClaimTaken},
			{"more than was accepted", []ChannelClaim{claim(b, 11)}, ErrClaimTaken},
			{"no channel row", []ChannelClaim{claim(b, 10), claim(chanKey(9), 10)}, ErrChannelNotFound},
			{"one channel twice", []ChannelClaim{claim(b, 10), claim(b, 10)}, ErrInvalidChannel},
			{"an amount of 0", []ChannelClaim{claim(b, 0)}, ErrInvalidChannel},
			{"no channel", nil, ErrInvalidChannel},
		} {
			if err := channelsOf(t, s).MarkClaimSent(ctx, tx(2), bad.claims); !errors.Is(err, bad.want) {
				t.Fatalf("a claim of %s: %v, want %v", bad.name, err, bad.want)
			}
			offered(b) // b, free in the same claim, was not marked
		}
		if err := channelsOf(t, s).MarkClaimSent(ctx, "", []ChannelClaim{claim(b, 10)}); !errors.Is(err, ErrInvalidChannel) {
			t.Fatalf("a claim without a transaction hash: %v", err)
		}
		if n, err := channelsOf(t, s).MarkClaimMined(ctx, ""); !errors.Is(err, ErrInvalidChannel) || n != 0 {
			t.Fatalf("MarkClaimMined of no transaction: %d, %v", n, err)
		}

		// Failed: offered again, with what was accepted meanwhile.
		if n, err := channelsOf(t, s).MarkClaimFailed(ctx, tx(1)); err != nil || n != 1 {
			t.Fatalf("MarkClaimFailed = %d, %v; want 1", n, err)
		}
		offered(b, a)
		inFlight()
		if err := channelsOf(t, s).MarkClaimSent(ctx, tx(3), []ChannelClaim{claim(a, 20), claim(b, 10)}); err != nil {
			t.Fatalf("MarkClaimSent of two: %v", err)
		}
		offered()
		accept(b, 10, 30)

		// A crash: the claim is found again.
		s = h.reopen(t, s)
		inFlight("1@3=20", "2@3=10")
		offered()
		wantRow(t, channelsOf(t, s), b, 30, 2, 0, tx(3))

		// Mined: claimed, and what was accepted since is offered.
		clock.Advance(time.Second)
		if n, err := channelsOf(t, s).MarkClaimMined(ctx, strings.ToUpper(tx(3))); err != nil || n != 2 {
			t.Fatalf("MarkClaimMined = %d, %v; want 2", n, err)
		}
		inFlight()
		offered(b)
		gotA := wantRow(t, channelsOf(t, s), a, 20, 2, 20, "")
		gotB := wantRow(t, channelsOf(t, s), b, 30, 2, 10, "")
		if gotA.ClaimedTx != tx(3) || !gotA.UnclaimedSince.IsZero() || gotB.UnclaimedSince.IsZero() {
			t.Fatalf("after the claim: a claimed by %q, unclaimed since %s; b unclaimed since %s", gotA.ClaimedTx, gotA.UnclaimedSince, gotB.UnclaimedSince)
		}
		if n, err := channelsOf(t, s).MarkClaimMined(ctx, tx(3)); err != nil || n != 0 {
			t.Fatalf("MarkClaimMined again = %d, %v; want 0", n, err)
		}
		for _, bad := range []ChannelClaim{claim(a, 20), claim(a, 15)} {
			if err := channelsOf(t, s).MarkClaimSent(ctx, tx(4), []ChannelClaim{bad}); !errors.Is(err, ErrClaimTaken) {
				t.Fatalf("a claim of %s, claimed already: %v, want ErrClaimTaken", bad.Amount, err)
			}
		}
		// A read of the chain that shows b's claim mined frees a claim whose mark was lost.
		if err := channelsOf(t, s).MarkClaimSent(ctx, tx(5), []ChannelClaim{claim(b, 30)}); err != nil {
			t.Fatal(err)
		}
		read := depositRead(b, 1000, 6)
		read.TotalClaimed = big.NewInt(30)
		if got := mustObserve(t, channelsOf(t, s), read); got.ClaimTx != "" || got.Claimed.Int64() != 30 || got.ClaimedTx != "" {
			t.Fatalf("a read showing the claim mined left claim %q in flight, claimed %s by %q", got.ClaimTx, got.Claimed, got.ClaimedTx)
		}
		offered()
		// The other network's channel was never offered here.
		if got, err := channelsOf(t, s).Unclaimed(ctx, "eip155:1"); err != nil || len(got) != 1 || got[0].Key != other {
			t.Fatalf("Unclaimed of the other network: %v, %v", got, err)
		}
	})
}

// TestChannelsANewRowStartsAtWhatTheChainClaimed: a row made after the journal lost its channel (pruned, or another
// journal's) starts at what the chain says is claimed, so the next voucher must be above it; a read showing more
// claimed than the row accepted raises the amount and drops the stale voucher.
func TestChannelsANewRowStartsAtWhatTheChainClaimed(t *testing.T) {
	forEachStore(t, func(t *testing.T, h harness) {
		s := channelsOf(t, h.open(t, nil))
		ctx := context.Background()
		key := chanKey(4)
		read := depositRead(key, 100, 3)
		read.TotalClaimed = big.NewInt(40)
		if got := mustObserve(t, s, read); got.Charged.Int64() != 40 || got.Claimed.Int64() != 40 || got.Vouchers != 0 {
			t.Fatalf("new row at charged %s, claimed %s, %d vouchers; want 40, 40, 0", got.Charged, got.Claimed, got.Vouchers)
		}
		if _, err := s.AcceptVoucher(ctx, key, big.NewInt(0), big.NewInt(10), voucherOf(10)); !errors.Is(err, ErrChannelMoved) {
			t.Fatalf("a voucher from 0 on a channel claimed to 40: %v, want ErrChannelMoved", err)
		}
		if _, err := s.AcceptVoucher(ctx, key, big.NewInt(40), big.NewInt(50), voucherOf(50)); err != nil {
			t.Fatal(err)
		}
		read.TotalClaimed, read.Block = big.NewInt(70), 4
		got := mustObserve(t, s, read)
		if got.Charged.Int64() != 70 || got.Claimed.Int64() != 70 || got.Signature != nil || got.Digest != nil || !got.UnclaimedSince.IsZero() {
			t.Fatalf("after a read claimed past the row: charged %s, claimed %s, signature %x, unclaimed since %s",
				got.Charged, got.Claimed, got.Signature, got.UnclaimedSince)
		}
	})
}

// TestChannelsPruneOnlyWithdrawnFullyClaimedChannelsPastTheRetention: a channel goes once it was refunded or
// withdrawn before the cutoff, all it accepted is claimed and no claim is in flight; any other stays.
func TestChannelsPruneOnlyWithdrawnFullyClaimedChannelsPastTheRetention(t *testing.T) {
	forEachStore(t, func(t *testing.T, h harness) {
		clock := newTestClock()
		s := channelsOf(t, h.open(t, clock.Now))
		ctx := context.Background()
		open, unclaimed, claiming, done, recent := chanKey(1), chanKey(2), chanKey(3), chanKey(4), chanKey(5)
		for _, k := range []ChannelKey{open, unclaimed, claiming, done, recent} {
			mustObserve(t, s, depositRead(k, 100, 1))
			if _, err := s.AcceptVoucher(ctx, k, big.NewInt(0), big.NewInt(10), voucherOf(10)); err != nil {
				t.Fatal(err)
			}
		}
		if err := s.MarkClaimSent(ctx, fmt.Sprintf("0x%064x", 7), []ChannelClaim{{claiming, big.NewInt(10)}}); err != nil {
			t.Fatal(err)
		}
		withdraw := func(k ChannelKey, claimed int64) {
			read := depositRead(k, 0, 2)
			read.Withdrawn, read.TotalClaimed = true, big.NewInt(claimed)
			mustObserve(t, s, read)
		}
		withdraw(unclaimed, 0)
		withdraw(claiming, 0)
		withdraw(done, 10)
		clock.Advance(time.Hour)
		withdraw(recent, 10)
		if n, err := s.PruneChannels(ctx, clock.Now().Add(-time.Minute)); err != nil || n != 1 {
			t.Fatalf("PruneChannels = %d, %v; want 1 (the withdrawn, claimed channel)", n, err)
		}
		for _, k := range []ChannelKey{open, unclaimed, claiming, recent} {
			mustChannel(t, s, k)
		}
		if _, ok, err := s.Channel(ctx, done); ok || err != nil {
			t.Fatalf("the pruned channel is still there: %v, %v", ok, err)
		}
	})
}

// raceVouchers has workers goroutines on each of stores (one journal) take the steps of one channel holding steps
// vouchers' worth, each reading the row and taking the next step, until the deposit is reached. It fails the test
// unless every step from 1 to steps was accepted exactly once, and the row holds the last.
func raceVouchers(t *testing.T, stores []Channels, key ChannelKey, workers, steps int) {
	ctx := context.Background()
	const price = 7
	mustObserve(t, stores[0], depositRead(key, int64(steps*price), 1))
	var (
		mu       sync.Mutex
		accepted = map[int64]int{}
		moved    atomic.Int64
		wg       sync.WaitGroup
	)
	start := make(chan struct{})
	for si, s := range stores {
		for w := range workers {
			wg.Go(func() {
				<-start
				for {
					c, ok, err := s.Channel(ctx, key)
					if err != nil || !ok {
						t.Errorf("store %d worker %d: read: %v, %v", si, w, ok, err)
						return
					}
					from := c.Charged.Int64()
					to := from + price
					got, err := s.AcceptVoucher(ctx, key, big.NewInt(from), big.NewInt(to), voucherOf(to))
					switch {
					case err == nil:
						if got.Charged.Int64() != to {
							t.Errorf("store %d worker %d: accepted %d, the row says %s", si, w, to, got.Charged)
						}
						mu.Lock()
						accepted[to]++
						mu.Unlock()
					case errors.Is(err, ErrChannelMoved):
						moved.Add(1)
					case errors.Is(err, ErrAboveDeposit):
						if from != int64(steps*price) {
							t.Errorf("store %d worker %d: %d to %d refused above the deposit of %d", si, w, from, to, steps*price)
						}
						return
					default:
						t.Errorf("store %d worker %d: %d to %d: %v", si, w, from, to, err)
						return
					}
				}
			})
		}
	}
	close(start)
	wg.Wait()
	if t.Failed() {
		return
	}
	if len(accepted) != steps {
		t.Fatalf("%d distinct steps accepted, want %d", len(accepted), steps)
	}
	var sum int64
	for n := 1; n <= steps; n++ {
		if c := accepted[int64(n*price)]; c != 1 {
			t.Fatalf("the step to %d was accepted %d times, want once", n*price, c)
		}
		sum += price
	}
	if sum > int64(steps*price) {
		t.Fatalf("accepted %d in all against a deposit of %d", sum, steps*price)
	}
	for _, s := range stores {
		wantRow(t, s, key, int64(steps*price), int64(steps), 0, "")
	}
	t.Logf("%d steps taken by %d goroutines on %d stores; %d tries found the step taken", steps, workers*len(stores), len(stores), moved.Load())
}

// TestChannelsConcurrentVouchersOfOneChannelTakeEachStepOnce: many goroutines racing the steps of one channel on
// one store: each step is taken once, and never past the deposit.
func TestChannelsConcurrentVouchersOfOneChannelTakeEachStepOnce(t *testing.T) {
	forEachStore(t, func(t *testing.T, h harness) {
		raceVouchers(t, []Channels{channelsOf(t, h.open(t, nil))}, chanKey(77), 8, 120)
	})
}

// TestChannelsRefuseWorkAfterClose: every method of a closed store answers ErrClosed and writes nothing.
func TestChannelsRefuseWorkAfterClose(t *testing.T) {
	forEachStore(t, func(t *testing.T, h harness) {
		st := h.open(t, nil)
		s := channelsOf(t, st)
		ctx := context.Background()
		key := chanKey(1)
		mustObserve(t, s, depositRead(key, 100, 1))
		st.Close()
		_, _, err1 := s.Channel(ctx, key)
		_, err2 := s.AcceptVoucher(ctx, key, big.NewInt(0), big.NewInt(1), voucherOf(1))
		_, err3 := s.Unclaimed(ctx, testNetwork)
		_, err4 := s.ObserveChannel(ctx, depositRead(key, 100, 2))
		for i, err := range []error{err1, err2, err3, err4} {
			if !errors.Is(err, ErrClosed) {
				t.Fatalf("call %d after Close: %v, want ErrClosed", i+1, err)
			}
		}
	})
}

// TestChannelsRowsShareNothingWithTheirCallers: a row AcceptVoucher or Channel returns, and the voucher given to
// AcceptVoucher, are the caller's own: changing their amounts and bytes afterwards changes no stored row, on every
// store (the memory store copies its rows outside its lock, and must still hand out copies).
func TestChannelsRowsShareNothingWithTheirCallers(t *testing.T) {
	forEachStore(t, func(t *testing.T, h harness) {
		s := channelsOf(t, h.open(t, nil))
		ctx := context.Background()
		key := chanKey(5)
		mustObserve(t, s, depositRead(key, 100, 3))
		v := voucherOf(10)
		got, err := s.AcceptVoucher(ctx, key, big.NewInt(0), big.NewInt(10), v)
		if err != nil {
			t.Fatal(err)
		}
		scribble := func(c *Channel) {
			c.Charged.SetInt64(99)
			c.Deposit.SetInt64(1)
			c.Claimed.SetInt64(98)
			for i := range c.Signature {
				c.Signature[i] = 0xee
			}
			for i := range c.Digest {
				c.Digest[i] = 0xee
			}
		}
		scribble(&got)
		for i := range v.Signature {
			v.Signature[i], v.Digest[i%32] = 0xdd, 0xdd
		}
		read := wantRow(t, s, key, 10, 1, 0, "")
		scribble(&read)
		row := wantRow(t, s, key, 10, 1, 0, "")
		if row.Deposit.Int64() != 100 {
			t.Fatalf("the row's deposit is %s after a caller changed its copy, want 100", row.Deposit)
		}
		// A refused step hands out a copy too.
		refused, err := s.AcceptVoucher(ctx, key, big.NewInt(0), big.NewInt(20), voucherOf(20))
		if !errors.Is(err, ErrChannelMoved) {
			t.Fatalf("a step from a passed amount: %v, want ErrChannelMoved", err)
		}
		if refused.Charged != nil {
			scribble(&refused)
		}
		if _, err := s.AcceptVoucher(ctx, key, big.NewInt(10), big.NewInt(20), voucherOf(20)); err != nil {
			t.Fatalf("the next step after callers changed their copies: %v", err)
		}
		if row := wantRow(t, s, key, 20, 2, 0, ""); row.Deposit.Int64() != 100 {
			t.Fatalf("the row's deposit is %s, want 100", row.Deposit)
		}
	})
}
