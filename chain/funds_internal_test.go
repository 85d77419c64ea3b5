package chain

import (
	"context"
	"math/big"
	"testing"
	"time"

	"github.com/ethereum/go-ethereum/common"
	"github.com/ethereum/go-ethereum/core/types"

	"github.com/x402-gateway/caddy-x402/chain/journal"
	"github.com/x402-gateway/caddy-x402/x402"
)

func fundsID(i int) journal.ID { return journal.ID{byte(i >> 8), byte(i)} }

func fundsPayment(i int, amount int64, deadline uint64) *payment {
	return &payment{
		asset:  &asset{AssetConfig: AssetConfig{Address: common.HexToAddress("0x70")}},
		payer:  common.HexToAddress("0xabc"),
		amount: big.NewInt(amount),
		id:     fundsID(i),
		method: x402.TransferPermit2,
		p2:     permit2Transfer{Deadline: new(big.Int).SetUint64(deadline)},
	}
}

// The accounting of holds, step by step: each case is a sequence of operations on one payer and what a check of
// a payment of 10 answers afterwards.
func TestFundsCountHoldsUntilTheChainShowsThem(t *testing.T) {
	now := time.Unix(1_000_000, 0)
	clock := func() time.Time { return now }
	read := func(block, balance int64) *fundsRead {
		return &fundsRead{block: uint64(block), balance: big.NewInt(balance), allowance: big.NewInt(1 << 40)}
	}
	const chainTime = 500
	type step func(fs *funds)
	take := func(i int, deadline uint64, r *fundsRead) step {
		return func(fs *funds) {
			if ok, _, _ := fs.cover(fundsPayment(i, 10, deadline), chainTime, r, fundsSettle); !ok {
				t.Fatalf("holding payment %d was refused", i)
			}
		}
	}
	for _, tc := range []struct {
		name      string
		steps     []step
		want      bool // a new payment of 10 is covered by the last read
		wantKnown bool
	}{
		{"no read: unknown", nil, false, false},
		{"a read of 30 covers 10", []step{take(1, 900, read(5, 30))}, true, true},
		{"three holds of 10 use up 30", []step{take(1, 900, read(5, 30)), take(2, 900, nil), take(3, 900, nil)}, false, true},
		{"a dropped hold frees its amount", []step{take(1, 900, read(5, 30)), take(2, 900, nil), take(3, 900, nil),
			func(fs *funds) { fs.drop(fundsID(2), false) }}, true, true},
		{"a hold mined at block 6 still counts against a read of block 5", []step{take(1, 900, read(5, 20)), take(2, 900, nil),
			func(fs *funds) { fs.mined(fundsID(1), 6) }}, false, true},
		{"a read of block 6 reflects it: the hold ends", []step{take(1, 900, read(5, 20)), take(2, 900, nil),
			func(fs *funds) { fs.mined(fundsID(1), 6) },
			func(fs *funds) { fs.cover(fundsPayment(9, 10, 900), chainTime, read(6, 10), fundsVerify) }}, false, true},
		{"after that read, one more payment fits a top-up", []step{take(1, 900, read(5, 20)), take(2, 900, nil),
			func(fs *funds) { fs.mined(fundsID(1), 6) },
			func(fs *funds) { fs.cover(fundsPayment(9, 10, 900), chainTime, read(6, 20), fundsVerify) }}, true, true},
		{"a hold past its deadline, never mined, ends at the next read", []step{take(1, 400, read(5, 20)), take(2, 900, nil),
			func(fs *funds) { fs.cover(fundsPayment(9, 10, 900), chainTime, read(7, 20), fundsVerify) }}, true, true},
		{"an older read does not replace a newer one", []step{take(1, 900, read(8, 10)),
			func(fs *funds) { fs.cover(fundsPayment(9, 10, 900), chainTime, read(7, 1000), fundsVerify) }}, false, true},
		{"a read older than the TTL answers nothing", []step{take(1, 900, read(5, 100)),
			func(*funds) { now = now.Add(3 * time.Second) }}, false, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			now = time.Unix(1_000_000, 0)
			fs := newFunds(2*time.Second, clock)
			for _, s := range tc.steps {
				s(fs)
			}
			ok, known, _ := fs.cover(fundsPayment(100, 10, 900), chainTime, nil, fundsVerify)
			if ok != tc.want || known != tc.wantKnown {
				t.Errorf("covered %v (known %v), want %v (known %v)", ok, known, tc.want, tc.wantKnown)
			}
		})
	}
}

// A payment already held is covered by its own hold, however little is left: a settlement after VerifyAndHold
// must not be refused for the amount it holds itself.
func TestFundsAPaymentIsCoveredByItsOwnHold(t *testing.T) {
	fs := newFunds(2*time.Second, time.Now)
	p := fundsPayment(1, 10, 900)
	if ok, _, _ := fs.cover(p, 500, &fundsRead{block: 1, balance: big.NewInt(10), allowance: big.NewInt(10)}, fundsSettle); !ok {
		t.Fatal("holding the payment was refused")
	}
	if ok, _, _ := fs.cover(p, 500, nil, fundsSettle); !ok {
		t.Error("the held payment is not covered by its own hold")
	}
	if ok, _, _ := fs.cover(fundsPayment(2, 10, 900), 500, nil, fundsSettle); ok {
		t.Error("another payment was covered by funds already held")
	}
}

// Many payers: idle ones are forgotten, payers with holds are kept.
func TestFundsForgetIdlePayersButNotHolds(t *testing.T) {
	now := time.Unix(1_000_000, 0)
	fs := newFunds(time.Second, func() time.Time { return now })
	held := fundsPayment(0, 10, 900)
	fs.cover(held, 500, &fundsRead{block: 1, balance: big.NewInt(100), allowance: big.NewInt(100)}, fundsSettle)
	for i := 1; i < fundsSweepAt+10; i++ {
		p := fundsPayment(i, 10, 900)
		p.payer = common.BigToAddress(big.NewInt(int64(1000 + i)))
		fs.cover(p, 500, &fundsRead{block: 1, balance: big.NewInt(100), allowance: big.NewInt(100)}, fundsVerify)
		if i == fundsSweepAt/2 {
			now = now.Add(2 * time.Second)
		}
	}
	if len(fs.payers) > fundsSweepAt {
		t.Errorf("%d payers tracked, want at most %d", len(fs.payers), fundsSweepAt)
	}
	if _, ok := fs.byID[held.id]; !ok {
		t.Error("the sweep forgot a payer with a payment held")
	}
}

// The simulation alone answers for a payer with nothing held who did not pay lately; a repeat payer, or one with
// payments held, needs the read.
func TestFundsSimulationSufficesForOneOffPayers(t *testing.T) {
	now := time.Unix(1_000_000, 0)
	for _, tc := range []struct {
		name  string
		ttl   time.Duration
		steps []bool // take, per payment in turn
		want  []bool
	}{
		{"cache on: first yes, repeat no", 2 * time.Second, []bool{false, false}, []bool{true, false}},
		{"cache on: a held payment makes the next need a read", 2 * time.Second, []bool{true, false}, []bool{true, false}},
		{"cache off: nothing held, never a read", 0, []bool{false, false, false}, []bool{true, true, true}},
		{"cache off: a held payment makes the next need a read", 0, []bool{true, false}, []bool{true, false}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			fs := newFunds(tc.ttl, func() time.Time { return now })
			for i, take := range tc.steps {
				use := fundsVerify
				if take {
					use = fundsSettle
				}
				if got := fs.simulationSuffices(fundsPayment(i, 10, 900), use); got != tc.want[i] {
					t.Errorf("payment %d: simulation suffices = %v, want %v", i, got, tc.want[i])
				}
			}
		})
	}
	fs := newFunds(2*time.Second, func() time.Time { return now })
	fs.simulationSuffices(fundsPayment(1, 10, 900), fundsVerify)
	now = now.Add(3 * time.Second)
	if !fs.simulationSuffices(fundsPayment(2, 10, 900), fundsVerify) {
		t.Error("a payer seen longer ago than the TTL counted as a repeat payer")
	}
}

func TestAnUptoHoldShrunkToItsSettledAmountFreesTheRestAtOnce(t *testing.T) {
	now := time.Unix(1_000_000, 0)
	fs := newFunds(time.Minute, func() time.Time { return now })
	r := &fundsRead{block: 5, balance: big.NewInt(30), allowance: big.NewInt(1 << 40)}
	upto := fundsPayment(1, 25, 900)
	upto.scheme = x402.SchemeUpto
	if ok, _, _ := fs.cover(upto, 500, r, fundsSettle); !ok {
		t.Fatal("holding the upto payment at its maximum of 25 was refused")
	}
	if ok, _, _ := fs.cover(fundsPayment(2, 10, 900), 500, nil, fundsVerify); ok {
		t.Fatal("a payment of 10 beside a hold of 25 out of 30 was covered")
	}
	settling := fundsPayment(1, 4, 900) // the same payment, settled for 4
	fs.shrink(settling)
	if ok, _, avail := fs.cover(fundsPayment(2, 10, 900), 500, nil, fundsVerify); !ok || avail.Int64() != 26 {
		t.Fatalf("after the hold shrank to 4, a payment of 10 is covered %v with %v left, want true with 26", ok, avail)
	}
	fs.shrink(fundsPayment(1, 20, 900)) // never grows
	if _, _, avail := fs.cover(fundsPayment(2, 10, 900), 500, nil, fundsVerify); avail.Int64() != 26 {
		t.Fatalf("shrinking to more than the hold changed it: %v left, want 26", avail)
	}
	fs.shrink(fundsPayment(3, 1, 900)) // not held: nothing happens
}

// A payment whose permit nonce another held payment carries is not held beside it, whatever the funds, and check
// says it was refused for that (clash), not for the funds: coverHeld answers from it, not from a second look at
// the holds, which may have changed by then (found by review: a clash the other hold's end then hid was answered
// insufficient_funds, a refusal for good).
func TestFundsRefuseAPermitNonceHeldTwiceAndSaySo(t *testing.T) {
	fs := newFunds(time.Minute, time.Now)
	erc2612 := func(i int) *payment {
		p := fundsPayment(i, 10, 900)
		p.method, p.permit = x402.TransferERC2612, Permit{Nonce: big.NewInt(3), Deadline: big.NewInt(900)}
		return p
	}
	r := &fundsRead{block: 1, balance: big.NewInt(100), allowance: big.NewInt(100)}
	if ok, clash, _, err := fs.check(context.Background(), erc2612(1), 500, r, fundsSettle); !ok || clash || err != nil {
		t.Fatalf("check of the first = %v, clash %v, %v; want held", ok, clash, err)
	}
	ok, clash, avail, err := fs.check(context.Background(), erc2612(2), 500, nil, fundsSettle)
	if ok || !clash || err != nil || avail.Cmp(big.NewInt(90)) != 0 {
		t.Fatalf("check of a second payment of the same permit nonce = %v, clash %v, avail %v, %v; want refused for the clash, 90 left", ok, clash, avail, err)
	}
	other := erc2612(3)
	other.permit = Permit{Nonce: big.NewInt(4), Deadline: big.NewInt(900)}
	if ok, clash, _, err := fs.check(context.Background(), other, 500, nil, fundsSettle); !ok || clash || err != nil {
		t.Fatalf("check of a payment of another permit nonce = %v, clash %v, %v; want held", ok, clash, err)
	}
}

// holdsOnly is a cluster whose only use here is to list the holds stored (HoldsOf).
type holdsOnly struct {
	journal.Cluster
	holds []journal.Hold
}

func (c holdsOnly) HoldsOf(context.Context, string) ([]journal.Hold, error) { return c.holds, nil }

// TestAPermitNonceHeldByAPaymentThatCountsNoMoreDoesNotRefuseTheNextPaymentOfIt: an erc2612 payment held for permit
// nonce 3 was never settled, and the chain's time passed its deadline (or it mined); its hold stays stored until it is
// pruned. The payer's next payment of that permit nonce (the first one's permit never applied, so the payer signs
// the nonce again) is not refused for it: the hold statement no longer counts that hold either. While the first hold
// counts, it is refused. In memory and with shared holds.
func TestAPermitNonceHeldByAPaymentThatCountsNoMoreDoesNotRefuseTheNextPaymentOfIt(t *testing.T) {
	erc2612 := func(i int, head *types.Header) *payment {
		p := fundsPayment(i, 10, 900)
		p.method, p.permit = x402.TransferERC2612, Permit{Nonce: big.NewInt(3), Deadline: big.NewInt(900)}
		p.head = head
		return p
	}
	at := func(block, time uint64) *types.Header {
		return &types.Header{Number: new(big.Int).SetUint64(block), Time: time}
	}
	cases := []struct {
		name   string
		mined  uint64
		head   *types.Header
		inUse  bool
		reason string
	}{
		{"the first one's deadline ahead", 0, at(5, 800), true, "its permit may still apply"},
		{"at the first one's deadline", 0, at(5, 900), true, "its permit may still apply in this block"},
		{"past the first one's deadline", 0, at(5, 901), false, "its permit can never apply"},
		{"the first one mined after the head", 7, at(5, 800), true, "the head does not show it yet"},
		{"the first one mined at or before the head", 5, at(5, 800), false, "the chain shows its nonce spent, which refuses the next payment by itself"},
		{"no head read", 0, nil, true, "nothing to judge by"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			mem := newFunds(time.Minute, time.Now)
			r := &fundsRead{block: 1, balance: big.NewInt(100), allowance: big.NewInt(100)}
			if ok, _, _, err := mem.check(context.Background(), erc2612(1, nil), 500, r, fundsSettle); !ok || err != nil {
				t.Fatalf("holding the first = %v, %v", ok, err)
			}
			if c.mined != 0 {
				mem.mined(fundsID(1), c.mined)
			}
			shared := newFunds(time.Minute, time.Now)
			shared.shared = holdsOnly{holds: []journal.Hold{{ID: fundsID(1), Key: "k", Amount: big.NewInt(10), Deadline: 900, Mined: c.mined, PermitNonce: big.NewInt(3)}}}
			for name, fs := range map[string]*funds{"in memory": mem, "shared": shared} {
				got, err := fs.permitInUse(context.Background(), erc2612(2, c.head))
				if err != nil || got != c.inUse {
					t.Errorf("%s: the next payment of the permit nonce is held back = %v, %v; want %v (%s)", name, got, err, c.inUse, c.reason)
				}
			}
		})
	}

	// A sponsored approval's hold (the payer's account nonce) holds it past its payment's deadline until it is seen
	// mined: the gas money and the approval it sends have no deadline, and may still be on their way.
	approval := func(i int, head *types.Header) *payment {
		p := fundsPayment(i, 10, 900)
		p.approval, p.head = &sponsorApproval{tx: types.NewTx(&types.DynamicFeeTx{Nonce: 3}), amount: big.NewInt(100)}, head
		return p
	}
	for _, c := range []struct {
		name  string
		mined uint64
		head  *types.Header
		inUse bool
	}{
		{"past its deadline, not seen mined", 0, at(5, 5000), true},
		{"mined at or before the head", 5, at(5, 5000), false},
	} {
		mem := newFunds(time.Minute, time.Now)
		r := &fundsRead{block: 1, balance: big.NewInt(100), allowance: big.NewInt(100)}
		if ok, _, _, err := mem.check(context.Background(), approval(1, nil), 500, r, fundsSettle); !ok || err != nil {
			t.Fatalf("holding the first approval's payment = %v, %v", ok, err)
		}
		if c.mined != 0 {
			mem.mined(fundsID(1), c.mined)
		}
		shared := newFunds(time.Minute, time.Now)
		shared.shared = holdsOnly{holds: []journal.Hold{{ID: fundsID(1), Key: "k", Amount: big.NewInt(10), Deadline: 900, Mined: c.mined, PermitNonce: approval(1, nil).permitNonce()}}}
		for name, fs := range map[string]*funds{"in memory": mem, "shared": shared} {
			if got, err := fs.permitInUse(context.Background(), approval(2, c.head)); err != nil || got != c.inUse {
				t.Errorf("approval %s, %s: the next payment carrying an approval of that account nonce is held back = %v, %v; want %v", c.name, name, got, err, c.inUse)
			}
		}
	}
}
