package journal

import (
	"fmt"
	"time"

	"github.com/x402-gateway/caddy-x402/x402"
)

// State is where a settlement stands. States only move forward: claimed, then broadcast, then final; a claim
// that never broadcast may instead be released, which deletes its record.
type State string

// States of a Record.
const (
	// StateClaimed: a process owns the payment and has sent nothing to the chain yet, so releasing it is safe.
	// An async payment waiting for background settlement is also claimed.
	StateClaimed State = "claimed"
	// StateBroadcast: a signed transaction exists and may have reached the chain; its hash is known and no
	// receipt has been seen. Write this state before sending, so a crash between send and write cannot lose
	// the hash; reconciliation then finds the receipt, waits, or resends RawTx.
	StateBroadcast State = "broadcast"
	// StateFinal: the outcome is decided (receipt seen, or failure decided) and Response is the answer.
	StateFinal State = "final"
)

// rank orders states; 0 is not a state.
func (s State) rank() int {
	switch s {
	case StateClaimed:
		return 1
	case StateBroadcast:
		return 2
	case StateFinal:
		return 3
	}
	return 0
}

// Record is everything the journal remembers of one payment.
type Record struct {
	// ID is PaymentID of the payment; it never changes.
	ID    ID    `json:"id"`
	State State `json:"state"`

	// Network (CAIP-2), Payer, Asset, Amount (atomic units, decimal) and PayTo describe the payment, so that
	// reconciliation, metrics and operators need not decode Request.
	Network string `json:"network,omitempty"`
	Payer   string `json:"payer,omitempty"`
	Asset   string `json:"asset,omitempty"`
	Amount  string `json:"amount,omitempty"`
	PayTo   string `json:"payTo,omitempty"`
	// Request is the settle request JSON, kept when the payment must be settled again from the journal alone
	// (async mode, replay on start-up).
	Request []byte `json:"request,omitempty"`

	// Wallet is the settlement wallet that signed the transaction, TxNonce its account nonce.
	Wallet  string `json:"wallet,omitempty"`
	TxNonce uint64 `json:"txNonce,omitempty"`
	// TxHash is the hash of the latest signed transaction; RawTx is that transaction, kept so a dropped
	// transaction can be resent unchanged (same nonce, same hash) after a restart.
	TxHash string `json:"txHash,omitempty"`
	RawTx  []byte `json:"rawTx,omitempty"`
	// PriorRawTxs are transactions of the same settlement sent before RawTx from the same wallet, in nonce
	// order (an erc2612 permit before its transferFrom), resent before RawTx when the node forgot them.
	PriorRawTxs [][]byte `json:"priorRawTxs,omitempty"`
	// PriorTxHashes are the hashes of every prior transaction (an erc2612 permit) any attempt of this settlement
	// signed: one of them mined means the settlement's own permit spent the payer's permit nonce.
	PriorTxHashes []string `json:"priorTxHashes,omitempty"`
	// SponsoredRawTx is the payer's own signed approval of Permit2 (erc20ApprovalGasSponsoring), sent after
	// PriorRawTxs (the payer's gas money) and before RawTx, which goes out only once it mined.
	SponsoredRawTx []byte `json:"sponsoredRawTx,omitempty"`
	// ReplacedTxHashes are earlier versions of TxHash (same wallet, same nonce, lower fees) that a fee bump
	// replaced; any one of them may still be the one that mines.
	ReplacedTxHashes []string `json:"replacedTxHashes,omitempty"`
	// Attempts counts broadcasts of this payment, resends included.
	Attempts int `json:"attempts,omitempty"`

	// Response is the final answer, returned as-is to every later /settle of the same payment.
	Response *x402.SettleResponse `json:"response,omitempty"`
	// Served and ServedAt record that a gate has served the one response this payment buys.
	Served   bool      `json:"served,omitempty"`
	ServedAt time.Time `json:"servedAt,omitzero"`
	// Async marks a payment accepted before settlement, to be settled in the background.
	Async bool `json:"async,omitempty"`
	// Resource is what a gate's payment buys: the request it was first presented for (its method and URL, in the
	// gate's words), the only one it may be presented again for. Once set it never changes; a record written by
	// a release before it was kept has none.
	Resource string `json:"resource,omitempty"`
	// Described is a digest of what the gate's 402 said of Resource beside its URL (its description and MIME type)
	// when the payment was first presented. Presented again for Resource at a gate that describes it alike, the
	// payment is judged by this record, whatever that gate's terms are now (a reload, another gateway); a record
	// without it, by the gate's terms.
	Described string `json:"described,omitempty"`
	// Route identifies the gate's route the payment was first presented at (gate.Config.Route): the same on every
	// gateway of one configuration and across its reloads, whatever its price. The payment is judged by this record
	// only at that route; a record without it (of a release before it was kept), by the route's terms. Once set it
	// never changes.
	Route string `json:"route,omitempty"`
	// Deadline is the last moment the payment's authorization can be settled, when its claimant knows it. Prune
	// keeps a final record until its deadline too: pruned earlier, the payment would look new to Claim while it
	// can still be presented.
	Deadline time.Time `json:"deadline,omitzero"`

	// ClaimedAt, UpdatedAt and FinalAt are set by the store from its clock.
	ClaimedAt time.Time `json:"claimedAt,omitzero"`
	UpdatedAt time.Time `json:"updatedAt,omitzero"`
	FinalAt   time.Time `json:"finalAt,omitzero"`
	// Owner is the claim token of the process that holds the payment, so that start-up can tell its own
	// claims from those a crashed process left behind.
	Owner string `json:"owner,omitempty"`
	// Handoff is set on a claim whose settlement its claimant handed to the other instances sharing the journal,
	// holding no free settlement wallet itself (see chain's handoff.go); nil otherwise. Only a Cluster store's
	// records carry it.
	Handoff *Handoff `json:"handoff,omitempty"`
}

// Handoff is a settlement handed from the instance that claimed the payment, which waits for its answer, to
// one that holds a free settlement wallet. The claim moves by conditional updates only: the taker makes the
// record its own (Owner) while Taker is empty and the claim is still From's, the waiter takes it back on the
// same condition, so exactly one of them settles it; a taker that sent nothing gives it back to From with its
// answer.
type Handoff struct {
	// From is the owner token of the instance that handed the settlement off and waits for its answer.
	From string `json:"from"`
	// Wallet is the only settlement wallet that can settle the payment (an upto witness's facilitator, an
	// erc2612 permit's spender), or "" when any can.
	Wallet string `json:"wallet,omitempty"`
	// Taker is the owner token of the instance that took the settlement; "" while it is on offer.
	Taker string `json:"taker,omitempty"`
	// Answer is the taker's answer when it sent nothing and gave the claim back (a refusal); Failure its error
	// then, when it could not settle the payment for a reason not the payment's.
	Answer  *x402.SettleResponse `json:"answer,omitempty"`
	Failure string               `json:"failure,omitempty"`
}

// OnOffer reports whether r is a settlement handed off and not taken yet.
func (r *Record) OnOffer() bool {
	return r.State == StateClaimed && r.Handoff != nil && r.Handoff.Taker == "" && r.Owner == r.Handoff.From
}

// keptUntil is when a final record may go: once it is final and past its deadline.
func (r *Record) keptUntil() time.Time {
	if r.Deadline.After(r.FinalAt) {
		return r.Deadline
	}
	return r.FinalAt
}

// validate checks what must hold of any stored record.
// SameClaim reports whether r and claim are one claim of the payment: made by the same owner at the same time.
// A record taken over by another process, or released and claimed again, is another claim.
func (r *Record) SameClaim(claim *Record) bool {
	return r.Owner == claim.Owner && r.ClaimedAt.Equal(claim.ClaimedAt)
}

func (r *Record) validate() error {
	if r.ID.IsZero() {
		return fmt.Errorf("record has no id; want PaymentID of the payment")
	}
	switch r.State {
	case StateClaimed:
	case StateBroadcast:
		// Without a hash, reconciliation could neither find the receipt nor tell it was dropped.
		if r.TxHash == "" {
			return fmt.Errorf("record %s: state %q needs TxHash", r.ID, r.State)
		}
	case StateFinal:
		if r.Response == nil {
			return fmt.Errorf("record %s: state %q needs Response, the answer later callers get", r.ID, r.State)
		}
	default:
		return fmt.Errorf("record %s: unknown state %q; want %q, %q or %q",
			r.ID, r.State, StateClaimed, StateBroadcast, StateFinal)
	}
	return nil
}

// checkTransition refuses an update that changes the id or moves the state backwards, either of which would
// let a broadcast transaction be forgotten and the payment settled twice.
func checkTransition(prev, next *Record) error {
	if next.ID != prev.ID {
		return fmt.Errorf("%w: update of %s changed the id to %s", ErrInvalidUpdate, prev.ID, next.ID)
	}
	if err := next.validate(); err != nil {
		return fmt.Errorf("%w: %w", ErrInvalidUpdate, err)
	}
	if next.State.rank() < prev.State.rank() {
		return fmt.Errorf("%w: record %s cannot move from %q back to %q", ErrInvalidUpdate, prev.ID, prev.State, next.State)
	}
	if prev.Resource != "" && next.Resource != prev.Resource {
		// A payment bound to another resource could buy a second one's response.
		return fmt.Errorf("%w: record %s buys %q and cannot be bound to %q", ErrInvalidUpdate, prev.ID, prev.Resource, next.Resource)
	}
	if prev.Route != "" && next.Route != prev.Route {
		// A payment moved to another route could be judged by its record where another price holds.
		return fmt.Errorf("%w: record %s was taken at route %q and cannot be moved to %q", ErrInvalidUpdate, prev.ID, prev.Route, next.Route)
	}
	if prev.Served && (!next.Served || !next.ServedAt.Equal(prev.ServedAt)) {
		// A payment unmarked as served could buy its response a second time.
		return fmt.Errorf("%w: record %s was served at %s and cannot be unmarked or re-dated", ErrInvalidUpdate, prev.ID,
			prev.ServedAt.Format(time.RFC3339Nano))
	}
	return nil
}
