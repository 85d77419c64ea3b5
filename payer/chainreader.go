package payer

import (
	"context"
	"fmt"
	"math/big"
	"strings"
	"time"

	"github.com/ethereum/go-ethereum/common"
	"github.com/ethereum/go-ethereum/ethclient"

	"github.com/x402-gateway/caddy-x402/chain"
)

// chainReader reads what a payer needs from the chain: its time and the token's allowance and nonces.
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

// now is the time a payment's validity starts from: the later of the head block's time and wall, the
// payer's clock. A chain's head may run ahead of the wall clock (a dev chain under load); a chain that seals
// only when transactions come may have sat idle for minutes, and its next block, which the settlement lands
// in, is stamped with the wall clock: a payment dated from that head would be born expired.
func (c *chainReader) now(ctx context.Context, wall time.Time) (time.Time, error) {
	head, err := c.client.HeaderByNumber(ctx, nil)
	if err != nil {
		return time.Time{}, c.wrap("reading the head block from the RPC", err)
	}
	if chainTime := time.Unix(int64(head.Time), 0); chainTime.After(wall) {
		return chainTime, nil
	}
	return wall, nil
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
