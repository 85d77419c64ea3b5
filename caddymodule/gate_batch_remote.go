package caddymodule

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"go.uber.org/zap"

	"github.com/x402-gateway/caddy-x402/chain"
	"github.com/x402-gateway/caddy-x402/chain/journal"
	"github.com/x402-gateway/caddy-x402/facilitatorclient"
	"github.com/x402-gateway/caddy-x402/gate"
	"github.com/x402-gateway/caddy-x402/x402"
)

// Scheme batch through facilitator_url: the gate plays the public SDK's batch-settlement server in front of the
// facilitator (chain.RemoteBatch): deposits verified and sent by the facilitator, vouchers accepted off chain and
// kept in the x402 app's journal, claimed in batches through the facilitator's /settle claim action by the
// gate's batch block, and at shutdown.

// remoteBatchCloseTimeout bounds the last claim pass when a gate stops (a reload, or Caddy's exit).
const remoteBatchCloseTimeout = 30 * time.Second

// batchNetworks are the networks of the gate's batch offers, in order.
func (g *Gate) batchNetworks() []string {
	var out []string
	for _, s := range g.specs {
		if s.Scheme == x402.SchemeBatchSettlement && !slices.Contains(out, s.Network) {
			out = append(out, s.Network)
		}
	}
	return out
}

// provisionRemoteBatch checks, with nothing dialled, that a gate with scheme batch through facilitator_url has
// one facilitator over HTTP (whose receiverAuthorizer signs its channels' claims) and a sound batch block.
func (g *Gate) provisionRemoteBatch() error {
	if len(g.batchNetworks()) == 0 {
		if g.Batch != nil {
			return errors.New("batch: the claim policy of scheme batch, but no way to pay here is scheme batch")
		}
		return nil
	}
	if _, ok := g.fac.(*facilitatorclient.Client); !ok {
		return fmt.Errorf("scheme batch through a remote facilitator needs exactly one facilitator (its receiverAuthorizer signs the claims of the channels it names), not %s", g.facName)
	}
	if b := g.Batch; b != nil {
		switch {
		case b.ReceiverAuthorizerKey != "":
			return errors.New("batch: receiver_authorizer_key is the facilitator's own in front of facilitator_url (named in its /supported); a gate's batch block takes claim_every, claim_amount and claim_after")
		case b.ClaimEvery < 0:
			return fmt.Errorf("batch: claim_every %d: want a positive number of vouchers", b.ClaimEvery)
		case b.ClaimAfter < 0:
			return fmt.Errorf("batch: claim_after %s: want a positive duration", time.Duration(b.ClaimAfter))
		}
		if b.ClaimAmount != "" {
			if _, err := claimAmountValue(b.ClaimAmount); err != nil {
				return err
			}
		}
	}
	return nil
}

// startRemoteBatch starts the gate's batch server when it takes scheme batch through a remote facilitator. Its
// /supported is read in the background: one that lists no batch-settlement kind on a batch network is logged as
// the error it is (the route then offers no batch, and answers 503 when nothing else is offered).
func (g *Gate) startRemoteBatch(app *App, store journal.Store) error {
	networks := g.batchNetworks()
	client, ok := g.fac.(*facilitatorclient.Client)
	if len(networks) == 0 || !ok || g.embedded {
		return nil
	}
	cfg := chain.RemoteBatchConfig{Remote: client, Supported: client.Supported, Journal: store, Networks: networks,
		Logger: g.logger.With(zap.String("facilitator", client.BaseURL()))}
	if len(app.Networks) == 0 {
		// The gates prune the journal (no engine does): a voucher's answer is kept that long only.
		cfg.Retention = gate.RecordsKept
	}
	if b := g.Batch; b != nil {
		cfg.ClaimEvery, cfg.ClaimAfter = b.ClaimEvery, time.Duration(b.ClaimAfter)
		if b.ClaimAmount != "" {
			amount, err := claimAmountValue(b.ClaimAmount)
			if err != nil {
				return err
			}
			cfg.ClaimAmount = amount
		}
	}
	rb, err := chain.NewRemoteBatch(cfg)
	if err != nil {
		return fmt.Errorf("scheme batch through %s: %w", client.BaseURL(), err)
	}
	rb.Start()
	g.remoteBatch = rb
	go g.checkRemoteBatchSupported(client, networks)
	return nil
}

// checkRemoteBatchSupported logs, as an error, each batch network the facilitator's /supported lists no
// batch-settlement kind with a receiverAuthorizer on.
func (g *Gate) checkRemoteBatchSupported(client *facilitatorclient.Client, networks []string) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	sup, err := client.Supported(ctx)
	if err != nil {
		return // the gate says so at its first request
	}
	for _, n := range networks {
		if kind, ok := sup.SchemeKind(x402.Version2, x402.SchemeBatchSettlement, n, x402.TransferEIP3009); !ok || kind.Extra.ReceiverAuthorizer == "" {
			g.logger.Error("scheme batch: the facilitator's /supported lists no batch-settlement kind with a receiverAuthorizer on this network; the route offers no batch-settlement",
				zap.String("facilitator", client.BaseURL()), zap.String("network", n))
		}
	}
}

// stopRemoteBatch stops the gate's batch server after a last claim pass.
func (g *Gate) stopRemoteBatch() {
	rb := g.remoteBatch
	if rb == nil {
		return
	}
	g.remoteBatch = nil
	ctx, cancel := context.WithTimeout(context.Background(), remoteBatchCloseTimeout)
	defer cancel()
	if err := rb.Close(ctx); err != nil {
		g.logger.Warn("claiming batch-settlement vouchers at shutdown; what is left is claimed by the next start", zap.Error(err))
	}
}
