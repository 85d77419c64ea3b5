package payer

import (
	"context"
	"errors"
	"fmt"
	"math/big"
	"net/http"

	"github.com/ethereum/go-ethereum/accounts/abi"
	"github.com/ethereum/go-ethereum/common"
	"github.com/ethereum/go-ethereum/core/types"

	"github.com/x402-gateway/caddy-x402/chain/contracts"
	"github.com/x402-gateway/caddy-x402/x402"
)

// What a Transport gives back, and on what proof, is told in its doc comment; this file holds the proofs.

// authorization is a permit2 payment a Transport sent and follows until the chain shows its final cost.
type authorization struct {
	req      x402.PaymentRequirements
	key      string // the nonce, decimal: Permit2 nonces are the payer's own and drawn at random
	amount   *big.Int
	asset    common.Address
	payTo    common.Address
	owner    common.Address
	nonce    *big.Int
	deadline *big.Int
	permit2  common.Address
	spender  common.Address // the pinned proxy the payment was signed for
	upto     bool
	signedAt uint64 // the head block at signing: its settlement can only be later
}

// watch starts following pay, a permit2 payment about to be sent, when the Payer has an RPC to follow it with;
// nil otherwise.
func (t *Transport) watch(rpc *chainReader, pay Payment) *authorization {
	auth := pay.Payload.Payload.Permit2Authorization
	if rpc == nil || pay.Method != x402.TransferPermit2 || auth == nil {
		return nil
	}
	a := &authorization{req: pay.Requirements, key: auth.Nonce, upto: pay.Requirements.Scheme == x402.SchemeUpto, signedAt: pay.signedAt,
		owner: t.Payer.address, asset: common.HexToAddress(pay.Requirements.Asset), payTo: common.HexToAddress(pay.Requirements.PayTo)}
	var err error
	if a.nonce, err = x402.ParseUint256(auth.Nonce); err != nil {
		return nil
	}
	if a.deadline, err = x402.ParseUint256(auth.Deadline); err != nil {
		return nil
	}
	if a.amount, err = x402.ParseUint256(pay.Requirements.Amount); err != nil {
		return nil
	}
	if a.permit2, a.spender, err = t.Payer.permit2Contracts(pay.Requirements); err != nil {
		return nil
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.open == nil {
		t.open = map[string]*authorization{}
	}
	t.open[a.key] = a
	return a
}

// answered looks at the answer to the paid request of a: an upto payment the server says it settled is proved
// on the chain, in the transaction the answer names, and what it did not move is given back; an exact payment
// the server says it settled is no longer followed. Anything else stays for Reconcile.
func (t *Transport) answered(ctx context.Context, rpc *chainReader, a *authorization, resp *http.Response) {
	s, err := Settlement(resp)
	if err != nil || s == nil || !s.Success {
		return
	}
	if !a.upto {
		t.close(a, nil)
		return
	}
	if !x402.IsTxHash(s.Transaction) {
		return
	}
	moved, err := t.proveSettlement(ctx, rpc, a, common.HexToHash(s.Transaction))
	if err != nil {
		return // the server's word alone gives nothing back
	}
	t.close(a, moved)
}

// close stops following a, whose final cost is cost: what is reserved above it is given back. A nil cost is
// the whole amount, as far as anyone can tell. Closing a twice (the answer and Reconcile at once) gives back
// once.
func (t *Transport) close(a *authorization, cost *big.Int) {
	t.mu.Lock()
	mine := t.open[a.key] == a
	if mine {
		delete(t.open, a.key)
	}
	t.mu.Unlock()
	if mine && cost != nil && cost.Cmp(a.amount) < 0 {
		t.releaseAmount(a.req, new(big.Int).Sub(a.amount, cost))
	}
}

// Pending returns how many payments the Transport follows: permit2 payments sent whose final cost the chain
// has not shown yet, each counted in Spent at its whole amount until Reconcile learns it.
func (t *Transport) Pending() int {
	t.mu.Lock()
	defer t.mu.Unlock()
	return len(t.open)
}

// Reconcile asks the chain, through the Payer's RPC, what became of the permit2 payments the Transport
// follows, and gives back what they did not cost: an upto payment whose settlement it finds (in the asset's
// Transfer logs from the payer to payTo since the payment was signed) gives back its maximum less what it
// moved, and a payment whose deadline the head block has passed with its nonce unspent gives back all of it.
// A payment whose nonce is spent in a way it cannot prove stays counted whole. Payments still spendable stay
// followed, for a later call. The error joins what could not be read; what could was counted.
func (t *Transport) Reconcile(ctx context.Context) error {
	rpc, err := t.Payer.needChain(ctx, "reconciling payments with the chain")
	if err != nil {
		return err
	}
	head, err := rpc.head(ctx)
	if err != nil {
		return fmt.Errorf("payer: %w", err)
	}
	t.mu.Lock()
	open := make([]*authorization, 0, len(t.open))
	for _, a := range t.open {
		open = append(open, a)
	}
	t.mu.Unlock()

	var errs []error
	for _, a := range open {
		used, err := rpc.permit2NonceUsed(ctx, a.permit2, a.owner, a.nonce, head.Number)
		switch {
		case err != nil:
			errs = append(errs, fmt.Errorf("payer: payment %s: %w", a.key, err))
		case !used && new(big.Int).SetUint64(head.Time).Cmp(a.deadline) > 0:
			t.close(a, new(big.Int)) // Permit2 refuses it from now on: it cost nothing
		case !used:
			// Still spendable by whoever holds it.
		case !a.upto:
			t.close(a, nil)
		default:
			cost, err := t.findSettlement(ctx, rpc, a, head.Number)
			if err != nil {
				errs = append(errs, fmt.Errorf("payer: payment %s: %w", a.key, err))
				continue
			}
			t.close(a, cost)
		}
	}
	return errors.Join(errs...)
}

// findSettlement looks for the transaction that settled a among the asset's Transfer logs from the payer to
// payTo since a was signed, and returns what it moved; nil when none of them proves it.
func (t *Transport) findSettlement(ctx context.Context, rpc *chainReader, a *authorization, head *big.Int) (*big.Int, error) {
	logs, err := rpc.transfers(ctx, a.asset, a.owner, a.payTo, new(big.Int).SetUint64(a.signedAt), head)
	if err != nil {
		return nil, err
	}
	seen := map[common.Hash]bool{}
	for _, l := range logs {
		if seen[l.TxHash] || l.Removed {
			continue
		}
		seen[l.TxHash] = true
		if moved, err := t.proveSettlement(ctx, rpc, a, l.TxHash); err == nil {
			return moved, nil
		}
	}
	return nil, nil
}

// proveSettlement returns what the transaction hash moved of a's asset from the payer, if the chain shows it
// settled a: mined and successful, sent to the proxy a was signed for, spending a's nonce from this payer in
// its calldata. Anything else is an error saying why it proves nothing.
func (t *Transport) proveSettlement(ctx context.Context, rpc *chainReader, a *authorization, hash common.Hash) (*big.Int, error) {
	tx, receipt, err := rpc.minedTransaction(ctx, hash)
	if err != nil {
		return nil, err
	}
	if receipt.Status != types.ReceiptStatusSuccessful {
		return nil, fmt.Errorf("the transaction %s reverted", hash.Hex())
	}
	if tx.To() == nil || *tx.To() != a.spender {
		return nil, fmt.Errorf("the transaction %s is no call to the proxy %s the payment was signed for", hash.Hex(), a.spender.Hex())
	}
	owner, nonce, err := settledPermit(a.upto, tx.Data())
	if err != nil {
		return nil, fmt.Errorf("the transaction %s: %w", hash.Hex(), err)
	}
	if owner != a.owner || nonce.Cmp(a.nonce) != 0 {
		return nil, fmt.Errorf("the transaction %s settles another payment (payer %s, nonce %s)", hash.Hex(), owner.Hex(), nonce)
	}
	moved := new(big.Int)
	for _, l := range receipt.Logs {
		if l.Address == a.asset && len(l.Topics) == 3 && l.Topics[0] == transferEvent && common.BytesToAddress(l.Topics[1].Bytes()) == a.owner {
			moved.Add(moved, new(big.Int).SetBytes(l.Data))
		}
	}
	if moved.Cmp(a.amount) > 0 {
		return nil, fmt.Errorf("the transaction %s moved %s from the payer, more than the %s signed", hash.Hex(), moved, a.amount)
	}
	return moved, nil
}

// settledPermit reads the payer and the Permit2 nonce a call of an x402 proxy's settle or settleWithPermit
// spends, from its calldata.
func settledPermit(upto bool, data []byte) (owner common.Address, nonce *big.Int, err error) {
	parsed := contracts.ProxyABI
	if upto {
		parsed = contracts.UptoProxyABI
	}
	if len(data) < 4 {
		return owner, nil, errors.New("its calldata is no proxy call")
	}
	m, err := parsed.MethodById(data[:4])
	if err != nil || (m.Name != "settle" && m.Name != "settleWithPermit") {
		return owner, nil, errors.New("its calldata calls neither settle nor settleWithPermit")
	}
	args, err := m.Inputs.Unpack(data[4:])
	if err != nil {
		return owner, nil, fmt.Errorf("its calldata does not decode: %w", err)
	}
	var permit *contracts.PermitTransferFrom
	for i, in := range m.Inputs {
		switch in.Name {
		case "permit":
			permit = abi.ConvertType(args[i], new(contracts.PermitTransferFrom)).(*contracts.PermitTransferFrom)
		case "owner":
			owner, _ = args[i].(common.Address)
		}
	}
	if permit == nil || permit.Nonce == nil {
		return owner, nil, errors.New("its calldata names no permit")
	}
	return owner, permit.Nonce, nil
}
