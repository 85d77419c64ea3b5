package payer

import (
	"context"
	"errors"
	"fmt"
	"math/big"
	"runtime"
	"sync"
	"time"

	"github.com/ethereum/go-ethereum/common"
	"github.com/ethereum/go-ethereum/core/types"

	"github.com/x402-gateway/caddy-x402/chain"
	"github.com/x402-gateway/caddy-x402/chain/contracts"
	"github.com/x402-gateway/caddy-x402/x402"
)

// SignBatch signs n payments of offer.Required.Accepts[i], each with a nonce of its own drawn at random, all at
// one signing time (the chain's head, with an RPC): what a client that pays many requests of one offer, such as
// a load test, signs ahead. Unlike Sign it reads the chain once, never adds gas sponsoring (a sponsored permit
// can be applied once, so only one such payment can be outstanding), and refuses erc2612, whose permits take the
// token's nonces(payer) one after another. Check the funds first with Permit2Allowance and TokenBalance.
func (p *Payer) SignBatch(ctx context.Context, offer Offer, i, n int) ([]Payment, error) {
	if i < 0 || i >= len(offer.Required.Accepts) {
		return nil, fmt.Errorf("payer: no requirement %d: the offer has %d", i, len(offer.Required.Accepts))
	}
	if n < 0 {
		return nil, fmt.Errorf("payer: cannot sign %d payments", n)
	}
	req := offer.Required.Accepts[i]
	if req.Scheme == x402.SchemeBatchSettlement {
		return nil, errors.New("payer: batch-settlement payments cannot be signed ahead: each voucher is the last one the server accepted plus the price, which only its answer to the one before says; pay them through a Transport")
	}
	method := TransferMethod(req)
	if method == x402.TransferERC2612 {
		return nil, errors.New("payer: erc2612 payments cannot be signed ahead in a batch: each permit signs the token's nonces(payer), which rises by one as each settles")
	}
	id, err := x402.ChainID(req.Network)
	if err != nil {
		return nil, err
	}
	chainID := new(big.Int).SetUint64(id)
	rpc, err := p.chain(ctx)
	if err != nil {
		return nil, err
	}
	var at Payment
	now, err := p.signingTime(ctx, rpc, &at)
	if err != nil {
		return nil, err
	}
	deadline, err := p.deadline(now, req)
	if err != nil {
		return nil, fmt.Errorf("payer: %w", err)
	}
	var spender common.Address
	if method == x402.TransferPermit2 {
		if _, spender, err = p.permit2Contracts(req); err != nil {
			return nil, fmt.Errorf("payer: %w", err)
		}
	}

	out := make([]Payment, n)
	workers := min(runtime.GOMAXPROCS(0), max(n, 1))
	errs := make([]error, workers)
	var wg sync.WaitGroup
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for k := w; k < n; k += workers {
				if ctx.Err() != nil {
					errs[w] = ctx.Err()
					return
				}
				pay := Payment{Index: i, Requirements: req, Method: method, signedAt: at.signedAt}
				var pl x402.PaymentPayload
				var err error
				switch method {
				case x402.TransferPermit2:
					pl, err = chain.SignPermit2Payment(p.key, req, chainID, chain.Permit2Options{Now: now, Deadline: deadline, Proxy: spender})
				case x402.TransferEIP3009:
					pl, err = chain.SignEIP3009Payment(p.key, req, chainID, chain.EIP3009Options{Now: now, ValidBefore: deadline})
				default:
					err = fmt.Errorf("cannot sign asset transfer method %q", method)
				}
				if err != nil {
					errs[w] = fmt.Errorf("signing the %s payment: %w", method, err)
					return
				}
				if offer.Version == x402.Version2 && offer.Required.Resource.URL != "" {
					res := offer.Required.Resource
					pl.Resource = &res
				}
				pay.Payload = pl
				if pay.Header, pay.Value, err = encodePayment(offer, i, pl); err != nil {
					errs[w] = fmt.Errorf("encoding the payment: %w", err)
					return
				}
				out[k] = pay
			}
		}()
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	return out, nil
}

// TokenBalance reads what holder holds of the token at asset, in raw units, through the Payer's RPC.
func (p *Payer) TokenBalance(ctx context.Context, asset, holder common.Address) (*big.Int, error) {
	rpc, err := p.needChain(ctx, "reading a token balance")
	if err != nil {
		return nil, err
	}
	return rpc.callUint(ctx, asset, "balanceOf", holder)
}

// Permit2Allowance reads how much of req's asset the payer lets Permit2 (req.Extra.Permit2Address, else the
// canonical deployment) move, through the Payer's RPC: permit2 payments settle only within it.
func (p *Payer) Permit2Allowance(ctx context.Context, req x402.PaymentRequirements) (*big.Int, error) {
	rpc, err := p.needChain(ctx, "reading the Permit2 allowance")
	if err != nil {
		return nil, err
	}
	asset, permit2, err := p.permit2Of(req)
	if err != nil {
		return nil, err
	}
	return rpc.callUint(ctx, asset, "allowance", p.address, permit2)
}

// ApprovePermit2 sends, from the payer's account, a transaction that lets Permit2 move amount of req's asset
// (the ERC-20 approve the public SDKs ask a payer to make once), and waits for its receipt. The payer pays its
// gas. Nothing in this package calls it: sending a transaction is the caller's decision.
func (p *Payer) ApprovePermit2(ctx context.Context, req x402.PaymentRequirements, amount *big.Int) (common.Hash, error) {
	rpc, err := p.needChain(ctx, "approving Permit2")
	if err != nil {
		return common.Hash{}, err
	}
	asset, permit2, err := p.permit2Of(req)
	if err != nil {
		return common.Hash{}, err
	}
	data, err := contracts.StableCoinABI.Pack("approve", permit2, amount)
	if err != nil {
		return common.Hash{}, fmt.Errorf("packing approve: %w", err)
	}
	nonce, err := rpc.client.PendingNonceAt(ctx, p.address)
	if err != nil {
		return common.Hash{}, rpc.wrap("reading the payer's account nonce from the RPC", err)
	}
	tip, err := rpc.client.SuggestGasTipCap(ctx)
	if err != nil {
		return common.Hash{}, rpc.wrap("reading the gas tip from the RPC", err)
	}
	head, err := rpc.client.HeaderByNumber(ctx, nil)
	if err != nil {
		return common.Hash{}, rpc.wrap("reading the head block from the RPC", err)
	}
	feeCap := new(big.Int).Add(tip, new(big.Int).Mul(head.BaseFee, big.NewInt(2)))
	tx, err := types.SignNewTx(p.key, types.LatestSignerForChainID(rpc.chainID), &types.DynamicFeeTx{
		ChainID: rpc.chainID, Nonce: nonce, GasTipCap: tip, GasFeeCap: feeCap, Gas: 100_000, To: &asset, Data: data,
	})
	if err != nil {
		return common.Hash{}, fmt.Errorf("signing the approval: %w", err)
	}
	if err := rpc.client.SendTransaction(ctx, tx); err != nil {
		return tx.Hash(), rpc.wrap("sending the Permit2 approval through the RPC", err)
	}
	for {
		r, err := rpc.client.TransactionReceipt(ctx, tx.Hash())
		if err == nil {
			if r.Status != types.ReceiptStatusSuccessful {
				return tx.Hash(), fmt.Errorf("the Permit2 approval %s reverted", tx.Hash().Hex())
			}
			return tx.Hash(), nil
		}
		select {
		case <-ctx.Done():
			return tx.Hash(), fmt.Errorf("waiting for the receipt of the Permit2 approval %s: %w", tx.Hash().Hex(), ctx.Err())
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// needChain is chain for the methods that cannot do without one.
func (p *Payer) needChain(ctx context.Context, what string) (*chainReader, error) {
	rpc, err := p.chain(ctx)
	if err != nil {
		return nil, err
	}
	if rpc == nil {
		return nil, fmt.Errorf("payer: %s needs an RPC URL (Options.RPC)", what)
	}
	return rpc, nil
}

// permit2Of is req's asset and the Permit2 it names (else the canonical one), which must be the one the payer
// pins on req's network: an allowance or a permit for another would let it take the payer's tokens.
func (p *Payer) permit2Of(req x402.PaymentRequirements) (asset, permit2 common.Address, err error) {
	if asset, err = chain.ParseAddress("requirements.asset", req.Asset); err != nil {
		return asset, permit2, err
	}
	pinned := p.contractsOf(req.Network)
	permit2, err = pinnedContract("requirements.extra.permit2Address", req.Extra.Permit2Address, CanonicalContracts().Permit2, pinned.Permit2, "Permit2", req.Network)
	return asset, permit2, err
}

// TokenDecimals reads the decimals of the token at asset through the Payer's RPC: what a dollar amount is in
// its raw units, read from the chain rather than taken from a server.
func (p *Payer) TokenDecimals(ctx context.Context, asset common.Address) (uint8, error) {
	rpc, err := p.needChain(ctx, "reading a token's decimals")
	if err != nil {
		return 0, err
	}
	d, err := rpc.callUint(ctx, asset, "decimals")
	if err != nil {
		return 0, err
	}
	if !d.IsUint64() || d.Uint64() > 77 { // 10^77 is the largest power of ten below 2^256
		return 0, fmt.Errorf("token %s says it has %s decimals, expected at most 77", asset.Hex(), d)
	}
	return uint8(d.Uint64()), nil
}
