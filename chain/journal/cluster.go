package journal

import (
	"context"
	"errors"
	"math/big"
	"time"
)

// Cluster is what a store shared by several processes at once adds to Store (the PostgreSQL store): which of
// them are alive, which one is working on a payment right now, which one holds each settlement wallet, and
// what every one of them holds against a payer's funds. A store one process holds alone (bbolt, memory) does not
// implement it: the engine and the gate keep those things in memory then.
//
// Every method is safe for concurrent use. Times that decide between processes (lease expiry, heartbeats)
// are the database's, never a process's own clock, so processes whose clocks disagree still agree on them.
type Cluster interface {
	Store

	// Instance is this process's owner token in the store, unique to this open of it and kept alive by a
	// heartbeat while the store is open. Records this process claims carry it as their Owner: the caller sets
	// Owner, as with any store, and Claim stores what it is given.
	Instance() string
	// Alive reports whether the instance owner has a current heartbeat: it has not closed its store and has
	// not missed heartbeats for the instance TTL. This instance is always alive.
	Alive(ctx context.Context, owner string) (bool, error)
	// Instances counts the live instances, this one included, and gives this instance's rank among them: how
	// many live instances have a token that sorts before its own. Instances that agree on who is alive agree on
	// the ranks, so that shares each computes from its own rank add up to the whole (see the wallet leases).
	Instances(ctx context.Context) (live, rank int, err error)
	// Continuity is a number that changes whenever this instance may have looked dead to the others: its last
	// heartbeat the database took is too old to vouch for it now (the database out of reach for most of the
	// TTL), or such a gap came between two heartbeats. Others take over a dead instance's in-flight marks; work
	// that holds one is finished as this instance's only while the number is what it was when the mark was
	// taken.
	Continuity() uint64

	// Busy marks payment id as being worked on by this instance and returns true; it returns false, changing
	// nothing, when another live instance has marked it. A mark left by a dead instance is taken over. Marking
	// a payment this instance has marked already returns true.
	Busy(ctx context.Context, id ID) (bool, error)
	// Idle removes this instance's mark of id; another instance's mark is left alone.
	Idle(ctx context.Context, id ID) error

	// Lease takes or renews the lease called name for this instance for ttl of the database's time, and
	// returns the lease as it stands afterwards. Held says this instance holds it; otherwise Owner is the live
	// instance that does, and nothing changed. A lease that was free or past its expiry is taken over, and
	// every takeover bumps Fence; a renewal by the holder keeps it. A lease whose holder looks dead is not
	// taken before it expires: a holder cut off from the database goes on signing until its own reckoning of
	// the lease runs out, which it keeps shorter than the lease.
	Lease(ctx context.Context, name string, ttl time.Duration) (Lease, error)
	// Unlease gives up this instance's lease of name; a lease held by another is left alone. The fence stays,
	// so the next holder's fence is higher than any before it.
	Unlease(ctx context.Context, name string) error
	// UpdateFenced is Update, done only while this instance holds the lease called lease at fence, unexpired,
	// checked in the same transaction; otherwise nothing is written and the error wraps ErrFenced. It is the
	// write-ahead record of a transaction signed with a leased wallet: a holder that lost the lease without
	// knowing (paused past its expiry) cannot record, so cannot send, and a new holder's nonce, read after its
	// takeover, is above every nonce an earlier holder recorded.
	UpdateFenced(ctx context.Context, id ID, lease string, fence uint64, fn func(*Record) error) (Record, error)

	// Hold holds h against the funds of h.Key when they cover it beside every other hold of that key, and
	// reports whether h is held (true too when h.ID was held already) and what the key's funds cover beside the
	// holds (avail less the other holds). avail is what the caller read the payer can pay at block readBlock
	// (the lesser of balance and allowance); holds whose settlement was mined at or before readBlock, and
	// holds never seen mined whose Deadline is before chainTime, no longer count. With take they are deleted,
	// a mined one only once no instance's read older than its block can still answer (see
	// PostgresStore.ReadsAnswerFor), and h is refused, whatever the funds, when another hold that counts carries
	// its PermitNonce (ErrPermitNonceHeld, with ok false and left; HoldClaimAndSign says it as not held). With take
	// false nothing is written: Hold only answers whether h would be covered.
	Hold(ctx context.Context, h Hold, avail *big.Int, readBlock, chainTime uint64, take bool) (ok bool, left *big.Int, err error)
	// A hold that is Served is marked so by Hold with take (even when h.ID was held already), and stays so.
	//
	// HoldMined records that the settlement of the held payment id was mined in block.
	HoldMined(ctx context.Context, id ID, block uint64) error
	// Unhold deletes the hold of id (its payment will not move tokens); deleting an absent hold is a no-op. With
	// unlessServed, a Served hold stays: its settlement failed for now, and is tried again.
	Unhold(ctx context.Context, id ID, unlessServed bool) error
	// HoldsOf lists the holds of key, oldest first, for a caller that must look at them (a sponsor permit's
	// nonce). It knows no block or chain time, so it lists every hold not yet deleted: one past its deadline goes
	// at the next Hold of its key with take, one mined at such a Hold once it was marked long enough ago.
	HoldsOf(ctx context.Context, key string) ([]Hold, error)
	// PruneHolds deletes the holds of the keys that start with prefix whose Deadline is before the chain time
	// before, mined or not, and returns how many it deleted: Hold deletes those of one key only when a payment of
	// that key is held, so a payer who pays no more would keep its holds for ever.
	PruneHolds(ctx context.Context, prefix string, before uint64) (int, error)
}

// AliveOnce is c's Alive, asking the database once per owner: for one pass over many records, which mostly share a
// few owners.
func AliveOnce(c Cluster) func(ctx context.Context, owner string) (bool, error) {
	seen := map[string]bool{}
	return func(ctx context.Context, owner string) (bool, error) {
		if alive, ok := seen[owner]; ok {
			return alive, nil
		}
		alive, err := c.Alive(ctx, owner)
		if err == nil {
			seen[owner] = alive
		}
		return alive, err
	}
}

// Lease is a named lease as a Cluster store holds it.
type Lease struct {
	Name  string
	Owner string // the instance holding it; "" when nobody does
	// Fence is bumped on every change of holder: whatever a holder writes under its lease can carry it, and
	// a write fenced by a lower number comes from a holder that has lost it.
	Fence uint64
	// Expires is when the lease lapses unless renewed, by the database's clock.
	Expires time.Time
	// Held says this instance holds the lease (Owner is Instance()).
	Held bool
	// Took says this call took the lease over (it was free, expired or a dead instance's): its holder must
	// treat whatever it remembered of the leased thing as stale.
	Took bool
}

// Hold is one payment held against a payer's funds until its settlement shows on chain.
type Hold struct {
	ID ID
	// Key names whose funds: network, token and payer, as the caller spells them.
	Key    string
	Amount *big.Int
	// Deadline is the chain time after which the payment can no longer be mined.
	Deadline uint64
	// Mined is the block its settlement was mined in; 0 until known.
	Mined uint64
	// PermitNonce is the token nonce of the EIP-2612 permit its settlement applies (an erc2612 payment's own, or
	// a gas-sponsoring permit); nil when none.
	PermitNonce *big.Int
	// Served says the payment was served before it settles (a gate that settles async): its hold lasts until
	// it settles, is refused for good or its deadline passes, whoever's settlement attempts fail meanwhile.
	Served bool
}

// ErrPermitNonceHeld: Hold with take refused h because another hold of its key that counts carries h's PermitNonce
// (the chain takes a permit's nonce once, and a payer's account nonce once), whatever the funds; ok is false and left
// is what the funds cover beside the other holds, as for any refusal.
var ErrPermitNonceHeld = errors.New("journal: another hold carries the hold's permit nonce")

// ErrFenced: UpdateFenced by an instance that no longer holds the lease at that fence.
var ErrFenced = errors.New("journal: the lease is no longer held at this fence")

// ErrUnavailable marks a failure to reach a shared store's database (connection refused or lost, a timeout):
// nothing was written, except that a connection lost while a write commits leaves that write's fate unknown. Every
// write of the journal is safe to repeat (a repeated Claim returns the first one's record), so a caller may
// try again once the database answers.
var ErrUnavailable = errors.New("journal: database unavailable")
