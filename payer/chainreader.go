package payer

import (
	"context"
	"fmt"
	"math/big"
	"strings"

	"github.com/ethereum/go-ethereum"
	"github.com/ethereum/go-ethereum/common"
	"github.com/ethereum/go-ethereum/core/types"
	"github.com/ethereum/go-ethereum/ethclient"

	"github.com/x402-gateway/caddy-x402/chain"
	"github.com/x402-gateway/caddy-x402/chain/contracts"
)

// transferEvent is the topic of the ERC-20 Transfer(address,address,uint256) event.
var transferEvent = contracts.StableCoinABI.Events["Transfer"].ID

// chainReader reads what a payer needs from the chain: its time, the token's allowance and nonces, and what
// became of the payments it signed (settlement transactions, Permit2 nonces, Transfer logs).
type chainReader struct {
	client  *ethclient.Client
	raw     string // the URL as given, to scrub from errors
	name    string // the URL without credentials, path or query, for messages
	chainID *big.Int
}

// dialChain connects to rawURL and reads the chain ID, so that an unreachable RPC fails before anything is
// signed.
func dialChain(ctx context.Context, rawURL string) (*chainReader, error) {
	c := &chainReader{raw: rawURL, name: chain.RedactRPCURL(rawURL)}
	client, err := ethclient.DialContext(ctx, rawURL)
	if err != nil {
		return nil, c.wrap("connecting to the RPC", err)
	}
	c.client = client
	if c.chainID, err = client.ChainID(ctx); err != nil {
		client.Close()
		return nil, c.wrap("reading the chain ID from the RPC", err)
	}
	return c, nil
}

func (c *chainReader) close() { c.client.Close() }

// head is the head block: its time is the clock the facilitator judges deadlines by, which may run ahead of
// the wall clock.
func (c *chainReader) head(ctx context.Context) (*types.Header, error) {
	head, err := c.client.HeaderByNumber(ctx, nil)
	if err != nil {
		return nil, c.wrap("reading the head block from the RPC", err)
	}
	return head, nil
}

// minedTransaction is the transaction hash and its receipt, once mined.
func (c *chainReader) minedTransaction(ctx context.Context, hash common.Hash) (*types.Transaction, *types.Receipt, error) {
	tx, pending, err := c.client.TransactionByHash(ctx, hash)
	if err != nil {
		return nil, nil, c.wrap("reading the transaction "+hash.Hex()+" from the RPC", err)
	}
	if pending {
		return nil, nil, fmt.Errorf("the transaction %s is not mined yet", hash.Hex())
	}
	receipt, err := c.client.TransactionReceipt(ctx, hash)
	if err != nil {
		return nil, nil, c.wrap("reading the receipt of "+hash.Hex()+" from the RPC", err)
	}
	return tx, receipt, nil
}

// permit2NonceUsed says whether owner's unordered Permit2 nonce is spent at block.
func (c *chainReader) permit2NonceUsed(ctx context.Context, permit2, owner common.Address, nonce, block *big.Int) (bool, error) {
	word, bit := new(big.Int).Rsh(nonce, 8), uint(new(big.Int).And(nonce, big.NewInt(0xff)).Uint64())
	data, err := contracts.Permit2ABI.Pack("nonceBitmap", owner, word)
	if err != nil {
		return false, fmt.Errorf("packing nonceBitmap: %w", err)
	}
	out, err := c.client.CallContract(ctx, ethereum.CallMsg{To: &permit2, Data: data}, block)
	if err != nil {
		return false, c.wrap("reading nonceBitmap on Permit2 "+permit2.Hex()+" through the RPC", err)
	}
	if len(out) < 32 {
		return false, fmt.Errorf("nonceBitmap on %s returned %d bytes, want 32 (is Permit2 deployed there?)", permit2.Hex(), len(out))
	}
	return new(big.Int).SetBytes(out[:32]).Bit(int(bit)) == 1, nil
}

// transfers are the ERC-20 Transfer logs of token from from to to in the blocks from..to.
func (c *chainReader) transfers(ctx context.Context, token, from, to common.Address, fromBlock, toBlock *big.Int) ([]types.Log, error) {
	logs, err := c.client.FilterLogs(ctx, ethereum.FilterQuery{
		FromBlock: fromBlock, ToBlock: toBlock, Addresses: []common.Address{token},
		Topics: [][]common.Hash{{transferEvent}, {common.BytesToHash(from.Bytes())}, {common.BytesToHash(to.Bytes())}},
	})
	if err != nil {
		return nil, c.wrap(fmt.Sprintf("reading the Transfer logs of token %s through the RPC", token.Hex()), err)
	}
	return logs, nil
}

// callUint calls a uint256 view of the token (allowance, nonces).
func (c *chainReader) callUint(ctx context.Context, token common.Address, method string, args ...any) (*big.Int, error) {
	v, err := chain.CallTokenUint(ctx, c.client, token, method, args...)
	if err != nil {
		return nil, c.wrap(fmt.Sprintf("reading %s on token %s through the RPC", method, token.Hex()), err)
	}
	return v, nil
}

// wrap names the RPC by its redacted URL and scrubs the full one from err's text: providers put API keys in
// RPC URLs, and transport errors quote the URL.
func (c *chainReader) wrap(what string, err error) error {
	return &rpcError{msg: fmt.Sprintf("%s %s: %s", what, c.name, strings.ReplaceAll(err.Error(), c.raw, c.name)), err: err}
}

// rpcError is an RPC failure whose text names the endpoint without its secrets.
type rpcError struct {
	msg string
	err error
}

func (e *rpcError) Error() string { return e.msg }
func (e *rpcError) Unwrap() error { return e.err }
