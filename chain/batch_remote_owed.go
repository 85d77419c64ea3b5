package chain

import (
	"context"
	"fmt"
	"slices"
	"strings"

	"go.uber.org/zap"

	"github.com/x402-gateway/caddy-x402/chain/contracts"
	"github.com/x402-gateway/caddy-x402/chain/journal"
)

// A receiver's settle owed, kept in the journal: the facilitator's claim action only claims (the money stays in the
// escrow, credited to the receiver) and its settle action, a second transaction, pays the receiver. Between the
// two, a claim that landed is known to the channel rows as mined and nothing says its receiver is still to be
// paid: a crash there (or a settle that failed, then a crash) would leave the money in the escrow until a later
// claim of the receiver happened to settle it. So, once a claim is known landed and before its channels are marked
// mined, a mark of the settle it owes is written in the journal: a record in state claimed, no transaction, named
// by the network, token, receiver and the claim's token. A settle of the receiver that succeeded deletes the marks
// written before it started (it paid everything claimed for the receiver by then); a start reads the marks left
// (Store.PendingOf) and settles their receivers at its first pass. A pass with nothing owed reads nothing and asks
// the facilitator nothing.
//
// The embedded engine has no such gap: its claim transaction is one multicall of the claims and a settle of each
// receiver (batch_claim.go).

// remoteOwedMethod is the method of an owed settle's journal id; remoteOwedResource starts its Resource, which
// names the claim.
const (
	remoteOwedMethod   = "batch-remote-settle-owed"
	remoteOwedResource = "batch-settlement settle owed after claim "
)

// owedID is the journal id of the mark of the settle of receiver in token that claim owes.
func owedID(network, receiver, token, claim string) journal.ID {
	return journal.PaymentID(network, remoteOwedMethod, token, receiver, contracts.BatchSettlementAddress.Hex()+"/"+strings.ToLower(claim))
}

// owedKey is the owed map's key of a receiver.
func owedKey(network, receiver, token string) [3]string {
	return [3]string{network, strings.ToLower(receiver), strings.ToLower(token)}
}

// owe writes the mark of the settle of receiver in token that claim, landed, owes (see the top of this file). Its
// caller marks the claim's channels mined only once it returned nil: otherwise the claim stays in flight and is
// looked up, and its receiver settled, by a later pass.
func (b *RemoteBatch) owe(ctx context.Context, network, receiver, token, claim string) error {
	rec := journal.Record{ID: owedID(network, receiver, token, claim), State: journal.StateClaimed, Network: network,
		PayTo: strings.ToLower(receiver), Asset: strings.ToLower(token), Resource: remoteOwedResource + strings.ToLower(claim)}
	got, _, err := b.cfg.Journal.Claim(ctx, rec)
	if err != nil {
		return fmt.Errorf("recording the settle of %s that claim %s owes: %w", receiver, claim, err)
	}
	b.mu.Lock()
	k := owedKey(network, receiver, token)
	if !slices.ContainsFunc(b.marks[k], func(r journal.Record) bool { return r.ID == got.ID }) {
		b.marks[k] = append(b.marks[k], got)
	}
	b.mu.Unlock()
	return nil
}

// paid deletes the marks of the settles owed to receiver in token that marks (read before its settle started)
// names: that settle succeeded.
func (b *RemoteBatch) paid(ctx context.Context, network, receiver, token string, marks []journal.Record) {
	k := owedKey(network, receiver, token)
	for _, m := range marks {
		if err := b.cfg.Journal.Release(ctx, m); err != nil {
			// Left in the journal: the next start settles the receiver again, and is told there is nothing to settle.
			b.log.Warn("deleting the journal's mark of a settle owed after it was paid", zap.String("receiver", receiver), zap.Error(err))
		}
	}
	b.mu.Lock()
	b.marks[k] = slices.DeleteFunc(b.marks[k], func(r journal.Record) bool {
		return slices.ContainsFunc(marks, func(m journal.Record) bool { return m.ID == r.ID })
	})
	if len(b.marks[k]) == 0 {
		delete(b.marks, k)
	}
	b.mu.Unlock()
}

// loadOwed reads, once, the marks of settles owed that an earlier process left in the journal, and has the
// receivers they name settled at once.
func (b *RemoteBatch) loadOwed(ctx context.Context) error {
	b.mu.Lock()
	loaded := b.owedLoaded
	b.mu.Unlock()
	if loaded {
		return nil
	}
	recs, err := b.cfg.Journal.PendingOf(ctx, false)
	if err != nil {
		return fmt.Errorf("reading the journal's settles owed: %w", err)
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.owedLoaded {
		return nil
	}
	b.owedLoaded = true
	for _, r := range recs {
		claim, ok := strings.CutPrefix(r.Resource, remoteOwedResource)
		if !ok || r.State != journal.StateClaimed || b.claimers[r.Network] == nil || r.ID != owedID(r.Network, r.PayTo, r.Asset, claim) {
			continue // another user's record of the journal, or another network's
		}
		k := owedKey(r.Network, r.PayTo, r.Asset)
		if !slices.ContainsFunc(b.marks[k], func(m journal.Record) bool { return m.ID == r.ID }) {
			b.marks[k] = append(b.marks[k], r)
		}
		if b.owed[k] == nil {
			b.owed[k] = &owedSettle{pause: b.cfg.Tick / 2} // due now
		}
	}
	return nil
}
