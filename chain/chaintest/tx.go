package chaintest

import (
	"context"
	"errors"
	"fmt"
	"math/big"
	"strings"
	"time"

	"github.com/ethereum/go-ethereum"
	"github.com/ethereum/go-ethereum/common"
	"github.com/ethereum/go-ethereum/common/hexutil"
	"github.com/ethereum/go-ethereum/core/types"
	"github.com/ethereum/go-ethereum/rpc"

	"github.com/x402-gateway/caddy-x402/chain/contracts"
)

// SendTx signs and submits an EIP-1559 transaction from an account without sealing it;
// to == nil creates a contract. The gas limit is the estimate plus a quarter, so an
// estimate that reverts comes back as an error here, before anything is broadcast.
func (c *Chain) SendTx(ctx context.Context, from *Account, to *common.Address, data []byte) (*types.Transaction, error) {
	return c.sendTx(ctx, from, to, nil, data)
}

func (c *Chain) sendTx(ctx context.Context, from *Account, to *common.Address, value *big.Int, data []byte) (*types.Transaction, error) {
	if value == nil {
		value = new(big.Int)
	}
	c.nonceMu.Lock()
	defer c.nonceMu.Unlock()
	nonce, err := c.Client.PendingNonceAt(ctx, from.Address)
	if err != nil {
		return nil, fmt.Errorf("reading the nonce of %s: %w", from.Address, err)
	}
	// The pool promotes transactions in the background, so its pending nonce can lag
	// behind what this harness just sent.
	if next, ok := c.nextNonce[from.Address]; ok && next > nonce {
		nonce = next
	}
	gas, err := c.Client.EstimateGas(ctx, ethereum.CallMsg{From: from.Address, To: to, Value: value, Data: data})
	if err != nil {
		return nil, fmt.Errorf("estimating gas for a call from %s: %w", from.Address, describeRevert(err))
	}
	tip, err := c.Client.SuggestGasTipCap(ctx)
	if err != nil {
		return nil, fmt.Errorf("suggesting a gas tip: %w", err)
	}
	head, err := c.Client.HeaderByNumber(ctx, nil)
	if err != nil {
		return nil, fmt.Errorf("reading the head block: %w", err)
	}
	feeCap := new(big.Int).Add(new(big.Int).Mul(head.BaseFee, big.NewInt(2)), tip)
	tx, err := types.SignNewTx(from.Key, c.Signer, &types.DynamicFeeTx{
		ChainID:   c.ChainID,
		Nonce:     nonce,
		GasTipCap: tip,
		GasFeeCap: feeCap,
		Gas:       gas + gas/4,
		To:        to,
		Value:     value,
		Data:      data,
	})
	if err != nil {
		return nil, fmt.Errorf("signing a transaction from %s: %w", from.Address, err)
	}
	if err := c.send(ctx, tx); err != nil {
		return nil, fmt.Errorf("sending a transaction from %s: %w", from.Address, err)
	}
	c.nextNonce[from.Address] = nonce + 1
	return tx, nil
}

// send submits a signed transaction, sending it again when go-ethereum's RPC client answered "client reconnected"
// (its connection replaced under the call: the node may or may not hold it; seen once in a test's SendETH with CI
// running beside it). The same bytes again are harmless: a node that holds them says "already known", which counts
// as sent.
func (c *Chain) send(ctx context.Context, tx *types.Transaction) error {
	for attempt := 1; ; attempt++ {
		err := c.Client.SendTransaction(ctx, tx)
		switch {
		case err == nil || (attempt > 1 && strings.Contains(err.Error(), "already known")):
			return nil
		case !strings.Contains(err.Error(), "client reconnected") || attempt == 3:
			return err
		}
	}
}

// SendSigned submits a transaction signed elsewhere (a payer's approval a payment carries), without sealing it.
// The node's pool takes a new head's balances a moment after the block is sealed: until then it refuses a
// transaction from an account just funded as "insufficient funds" (CI, eafd324 and f552323 under -race), so that
// refusal is tried again for up to ten seconds. A transaction the pool knows already counts as sent: code under
// test may have sent the same one.
func (c *Chain) SendSigned(ctx context.Context, tx *types.Transaction) error {
	deadline := time.Now().Add(10 * time.Second)
	for {
		err := c.send(ctx, tx)
		if err == nil || strings.Contains(err.Error(), "already known") {
			return nil
		}
		if !strings.Contains(err.Error(), "insufficient funds") || time.Now().After(deadline) {
			return err
		}
		select {
		case <-ctx.Done():
			return err
		case <-time.After(10 * time.Millisecond):
		}
	}
}

// Transact sends a transaction, seals it into a block and returns its receipt; a
// transaction that reverts on chain is an error (with the receipt).
func (c *Chain) Transact(ctx context.Context, from *Account, to common.Address, data []byte) (*types.Receipt, error) {
	return c.transact(ctx, from, &to, nil, data)
}

func (c *Chain) transact(ctx context.Context, from *Account, to *common.Address, value *big.Int, data []byte) (*types.Receipt, error) {
	tx, err := c.sendTx(ctx, from, to, value, data)
	if err != nil {
		return nil, err
	}
	receipts, err := c.CommitUntilIncluded(ctx, tx.Hash())
	if err != nil {
		return nil, err
	}
	receipt := receipts[0]
	if receipt.Status != types.ReceiptStatusSuccessful {
		return receipt, fmt.Errorf("transaction %s from %s reverted on chain", tx.Hash(), from.Address)
	}
	return receipt, nil
}

// CommitUntilIncluded seals blocks until every transaction has a receipt and returns the
// receipts in order. One Commit is usually enough, but the pool admits transactions in the
// background, so a transaction sent just before a Commit can miss that block.
func (c *Chain) CommitUntilIncluded(ctx context.Context, hashes ...common.Hash) ([]*types.Receipt, error) {
	receipts := make([]*types.Receipt, len(hashes))
	for {
		c.Commit()
		missing := 0
		for i, h := range hashes {
			if receipts[i] != nil {
				continue
			}
			r, err := c.Client.TransactionReceipt(ctx, h)
			switch {
			case err == nil:
				receipts[i] = r
			case errors.Is(err, ethereum.NotFound):
				missing++
			default:
				return nil, fmt.Errorf("reading the receipt of %s: %w", h, err)
			}
		}
		if missing == 0 {
			return receipts, nil
		}
		select {
		case <-ctx.Done():
			return nil, fmt.Errorf("%d of %d transactions not included: %w", missing, len(hashes), ctx.Err())
		case <-time.After(2 * time.Millisecond):
		}
	}
}

// Call runs an eth_call from an address against the head block. A revert comes back as an
// error whose message names the decoded reason (e.g. "PaymentTooEarly()"); RevertData
// extracts the raw bytes.
func (c *Chain) Call(ctx context.Context, from common.Address, to common.Address, data []byte) ([]byte, error) {
	c.sealed()
	out, err := c.Client.CallContract(ctx, ethereum.CallMsg{From: from, To: &to, Data: data}, nil)
	if err != nil {
		return nil, describeRevert(err)
	}
	return out, nil
}

// RevertError is a call that reverted, with the revert data and its decoded name.
type RevertError struct {
	// Data is the raw revert data.
	Data []byte
	// Reason is the decoded error, e.g. "InvalidNonce()", or "" when unknown.
	Reason string
	err    error
}

func (e *RevertError) Error() string {
	if e.Reason != "" {
		return fmt.Sprintf("execution reverted: %s", e.Reason)
	}
	return e.err.Error()
}

func (e *RevertError) Unwrap() error { return e.err }

// RevertData returns the revert data carried by err (from Call, SendTx or any
// go-ethereum RPC error), and whether there was any.
func RevertData(err error) ([]byte, bool) {
	var re *RevertError
	if errors.As(err, &re) {
		return re.Data, len(re.Data) > 0
	}
	var de rpc.DataError
	if !errors.As(err, &de) {
		return nil, false
	}
	s, ok := de.ErrorData().(string)
	if !ok {
		return nil, false
	}
	b, decErr := hexutil.Decode(s)
	if decErr != nil {
		return nil, false
	}
	return b, len(b) > 0
}

// RevertReason returns the decoded name of the revert carried by err, or "".
func RevertReason(err error) string {
	data, ok := RevertData(err)
	if !ok {
		return ""
	}
	reason, _ := contracts.DecodeRevert(data)
	return reason
}

func describeRevert(err error) error {
	data, ok := RevertData(err)
	if !ok {
		return err
	}
	reason, _ := contracts.DecodeRevert(data)
	return &RevertError{Data: data, Reason: reason, err: err}
}
