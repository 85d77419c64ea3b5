package e2e

import (
	"context"
	"crypto/ecdsa"
	"errors"
	"fmt"
	"math/big"
	"testing"
	"time"

	"github.com/ethereum/go-ethereum"
	"github.com/ethereum/go-ethereum/common"
	"github.com/ethereum/go-ethereum/core/types"
	"github.com/ethereum/go-ethereum/crypto"
	"github.com/ethereum/go-ethereum/ethclient"

	"github.com/x402-gateway/caddy-x402/chain/contracts"
	"github.com/x402-gateway/caddy-x402/chain/devchain"
)

// seller is the pay_to address of Caddyfile.example, used by every test's gate.
var seller = common.HexToAddress("0x5e11e75e11e75e11e75e11e75e11e75e11e75e11")

// transferTopic is the topic of ERC-20 Transfer(address,address,uint256).
var transferTopic = contracts.StableCoinABI.Events["Transfer"].ID

// devChain reads (and, for set-up, writes) the dev chain of a Caddy process over its JSON-RPC endpoint.
type devChain struct {
	t      *testing.T
	url    string
	client *ethclient.Client
}

// dialChain connects to the dev chain at url; the connection closes when the test ends.
func dialChain(t *testing.T, url string) *devChain {
	t.Helper()
	c, err := ethclient.Dial(url)
	if err != nil {
		t.Fatalf("connecting to the dev chain at %s: %v", url, err)
	}
	t.Cleanup(c.Close)
	return &devChain{t: t, url: url, client: c}
}

func rpcContext() (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.Background(), 10*time.Second)
}

// tokenBalance reads the dev token's balanceOf(holder), or says why it cannot.
func (d *devChain) tokenBalance(holder common.Address) (*big.Int, error) {
	return d.tokenBalanceOf(devchain.TokenAddress, holder)
}

// tokenBalanceOf reads token's balanceOf(holder), or says why it cannot.
func (d *devChain) tokenBalanceOf(token, holder common.Address) (*big.Int, error) {
	data, err := contracts.StableCoinABI.Pack("balanceOf", holder)
	if err != nil {
		return nil, err
	}
	ctx, cancel := rpcContext()
	defer cancel()
	out, err := d.client.CallContract(ctx, ethereum.CallMsg{To: &token, Data: data}, nil)
	if err != nil {
		return nil, fmt.Errorf("balanceOf(%s) on %s: %w", holder, token, err)
	}
	vals, err := contracts.StableCoinABI.Unpack("balanceOf", out)
	if err != nil || len(vals) != 1 {
		return nil, fmt.Errorf("balanceOf(%s): expected one uint256, got %d bytes (is the token deployed yet?)", holder, len(out))
	}
	return vals[0].(*big.Int), nil
}

// balance is tokenBalance that fails the test on error.
func (d *devChain) balance(holder common.Address) *big.Int {
	d.t.Helper()
	return d.balanceOf(devchain.TokenAddress, holder)
}

// balanceOf is tokenBalanceOf that fails the test on error.
func (d *devChain) balanceOf(token, holder common.Address) *big.Int {
	d.t.Helper()
	b, err := d.tokenBalanceOf(token, holder)
	if err != nil {
		d.t.Fatal(err)
	}
	return b
}

// ether is holder's balance in wei.
func (d *devChain) ether(holder common.Address) *big.Int {
	d.t.Helper()
	ctx, cancel := rpcContext()
	defer cancel()
	b, err := d.client.BalanceAt(ctx, holder, nil)
	if err != nil {
		d.t.Fatalf("reading the ether balance of %s: %v", holder, err)
	}
	return b
}

// head is the number of the latest block.
func (d *devChain) head() uint64 {
	d.t.Helper()
	ctx, cancel := rpcContext()
	defer cancel()
	n, err := d.client.BlockNumber(ctx)
	if err != nil {
		d.t.Fatalf("reading the head block number: %v", err)
	}
	return n
}

// headTime is the latest block's time: the chain's clock.
func (d *devChain) headTime() uint64 {
	d.t.Helper()
	ctx, cancel := rpcContext()
	defer cancel()
	h, err := d.client.HeaderByNumber(ctx, nil)
	if err != nil {
		d.t.Fatalf("reading the head block: %v", err)
	}
	return h.Time
}

// transfers lists the dev token's Transfer logs from -> to in blocks from fromBlock on.
func (d *devChain) transfers(from, to common.Address, fromBlock uint64) []types.Log {
	d.t.Helper()
	return d.tokenTransfers(devchain.TokenAddress, &from, &to, fromBlock)
}

// tokenTransfers lists token's Transfer logs in blocks from fromBlock on, from and to whom they say (nil: anyone).
func (d *devChain) tokenTransfers(token common.Address, from, to *common.Address, fromBlock uint64) []types.Log {
	d.t.Helper()
	topics := [][]common.Hash{{transferTopic}, nil, nil}
	if from != nil {
		topics[1] = []common.Hash{common.BytesToHash(from.Bytes())}
	}
	if to != nil {
		topics[2] = []common.Hash{common.BytesToHash(to.Bytes())}
	}
	ctx, cancel := rpcContext()
	defer cancel()
	logs, err := d.client.FilterLogs(ctx, ethereum.FilterQuery{
		FromBlock: new(big.Int).SetUint64(fromBlock), Addresses: []common.Address{token}, Topics: topics,
	})
	if err != nil {
		d.t.Fatalf("reading the Transfer logs of %s: %v", token, err)
	}
	return logs
}

// transferAmount is the value of a Transfer log.
func transferAmount(l types.Log) *big.Int { return new(big.Int).SetBytes(l.Data) }

// receipt reads the receipt of tx, failing the test when there is none.
func (d *devChain) receipt(tx common.Hash) *types.Receipt {
	d.t.Helper()
	ctx, cancel := rpcContext()
	defer cancel()
	r, err := d.client.TransactionReceipt(ctx, tx)
	if err != nil {
		d.t.Fatalf("reading the receipt of %s: %v", tx, err)
	}
	return r
}

// sender reads who signed the mined transaction tx, failing the test when it cannot.
func (d *devChain) sender(tx common.Hash) common.Address {
	d.t.Helper()
	ctx, cancel := rpcContext()
	defer cancel()
	t, _, err := d.client.TransactionByHash(ctx, tx)
	if err != nil {
		d.t.Fatalf("reading the transaction %s: %v", tx, err)
	}
	from, err := types.Sender(types.LatestSignerForChainID(t.ChainId()), t)
	if err != nil {
		d.t.Fatalf("recovering the sender of %s: %v", tx, err)
	}
	return from
}

// send signs a transaction from key to `to` with value and data, sends it and waits for its receipt; the test
// fails unless it succeeds. For set-up only (funding and approving payers).
func (d *devChain) send(key *ecdsa.PrivateKey, to common.Address, value *big.Int, data []byte) *types.Receipt {
	d.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	from := crypto.PubkeyToAddress(key.PublicKey)
	chainID, err := d.client.ChainID(ctx)
	if err != nil {
		d.t.Fatalf("reading the chain ID: %v", err)
	}
	nonce, err := d.client.PendingNonceAt(ctx, from)
	if err != nil {
		d.t.Fatalf("reading the nonce of %s: %v", from, err)
	}
	head, err := d.client.HeaderByNumber(ctx, nil)
	if err != nil {
		d.t.Fatalf("reading the head block: %v", err)
	}
	gas, err := d.client.EstimateGas(ctx, ethereum.CallMsg{From: from, To: &to, Value: value, Data: data})
	if err != nil {
		d.t.Fatalf("estimating a transaction %s -> %s: %v", from, to, err)
	}
	tip := big.NewInt(1_000_000_000)
	tx, err := types.SignNewTx(key, types.LatestSignerForChainID(chainID), &types.DynamicFeeTx{
		ChainID: chainID, Nonce: nonce, GasTipCap: tip, GasFeeCap: new(big.Int).Add(new(big.Int).Mul(head.BaseFee, big.NewInt(2)), tip),
		Gas: gas * 2, To: &to, Value: value, Data: data,
	})
	if err != nil {
		d.t.Fatalf("signing a transaction: %v", err)
	}
	return d.sendSigned(ctx, tx, fmt.Sprintf("%s -> %s", from, to))
}

// sendSigned sends a signed transaction and waits for its receipt within ctx; the test fails unless it succeeds.
// what names the transaction in the failure.
func (d *devChain) sendSigned(ctx context.Context, tx *types.Transaction, what string) *types.Receipt {
	d.t.Helper()
	if err := d.client.SendTransaction(ctx, tx); err != nil {
		d.t.Fatalf("sending a transaction %s: %v", what, err)
	}
	for {
		r, err := d.client.TransactionReceipt(ctx, tx.Hash())
		if err == nil {
			if r.Status != types.ReceiptStatusSuccessful {
				d.t.Fatalf("transaction %s (%s) reverted", tx.Hash(), what)
			}
			return r
		}
		if ctx.Err() != nil {
			d.t.Fatalf("no receipt for %s (%s): %v", tx.Hash(), what, err)
		}
		if !errors.Is(err, ethereum.NotFound) {
			d.t.Logf("waiting for the receipt of %s: %v", tx.Hash(), err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// callToken packs a call of the dev token's method, failing the test on a wrong argument.
func callToken(t *testing.T, method string, args ...any) []byte {
	t.Helper()
	data, err := contracts.StableCoinABI.Pack(method, args...)
	if err != nil {
		t.Fatalf("encoding %s: %v", method, err)
	}
	return data
}

// walletsIdle reports whether none of wallets has a transaction sent and not mined; false when that cannot be
// read.
func (d *devChain) walletsIdle(wallets []common.Address) bool {
	ctx, cancel := rpcContext()
	defer cancel()
	for _, w := range wallets {
		pending, err1 := d.client.PendingNonceAt(ctx, w)
		mined, err2 := d.client.NonceAt(ctx, w, nil)
		if err1 != nil || err2 != nil || pending != mined {
			return false
		}
	}
	return true
}

// maxUint256 is the largest uint256: an allowance that never runs out.
var maxUint256 = new(big.Int).Sub(new(big.Int).Lsh(big.NewInt(1), 256), big.NewInt(1))

// approvePermit2 has key's account approve Permit2 for all of its token, as a returning client has: its permit2
// payments then settle without gas sponsoring, and its balance moves by the prices alone.
func (d *devChain) approvePermit2(key *ecdsa.PrivateKey, token common.Address) {
	d.t.Helper()
	d.send(key, token, nil, callToken(d.t, "approve", contracts.Permit2Address, maxUint256))
}

// fundPayer gives key's address 1 ether and 1,000,000 raw units of the dev chain's StableCoin from the demo payer,
// and has it approve Permit2 for the token.
func (d *devChain) fundPayer(key *ecdsa.PrivateKey) {
	d.t.Helper()
	addr := crypto.PubkeyToAddress(key.PublicKey)
	d.send(devchain.PayerKey(), addr, big.NewInt(1e18), nil)
	d.send(devchain.PayerKey(), devchain.TokenAddress, nil, callToken(d.t, "transfer", addr, big.NewInt(1_000_000)))
	d.approvePermit2(key, devchain.TokenAddress)
}

// delta is after - before.
func delta(before, after *big.Int) *big.Int { return new(big.Int).Sub(after, before) }
