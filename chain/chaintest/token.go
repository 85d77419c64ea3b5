package chaintest

import (
	"context"
	"math/big"

	"github.com/ethereum/go-ethereum"
	"github.com/ethereum/go-ethereum/accounts/abi"
	"github.com/ethereum/go-ethereum/common"
	"github.com/ethereum/go-ethereum/core/types"

	"github.com/x402-gateway/caddy-x402/chain/contracts"
)

// Transfer is one ERC-20 Transfer log of the token.
type Transfer struct {
	From   common.Address
	To     common.Address
	Value  *big.Int
	TxHash common.Hash
	Block  uint64
}

var transferTopic = contracts.StableCoinABI.Events["Transfer"].ID

func (c *Chain) readUint(to common.Address, parsed abi.ABI, method string, args ...any) *big.Int {
	c.tb.Helper()
	data, err := parsed.Pack(method, args...)
	if err != nil {
		c.tb.Fatalf("chaintest: packing %s: %v", method, err)
	}
	out, err := c.Call(context.Background(), common.Address{}, to, data)
	if err != nil {
		c.tb.Fatalf("chaintest: calling %s on %s: %v", method, to, err)
	}
	vals, err := parsed.Unpack(method, out)
	if err != nil || len(vals) != 1 {
		c.tb.Fatalf("chaintest: unpacking %s from %x: %v", method, out, err)
	}
	v, ok := vals[0].(*big.Int)
	if !ok {
		c.tb.Fatalf("chaintest: %s returned %T, want *big.Int", method, vals[0])
	}
	return v
}

// TokenBalance returns the StableCoin balance of addr in raw units.
func (c *Chain) TokenBalance(addr common.Address) *big.Int {
	c.tb.Helper()
	return c.readUint(c.Token, contracts.StableCoinABI, "balanceOf", addr)
}

// BalanceOf returns the balance of addr in raw units of token, any ERC-20.
func (c *Chain) BalanceOf(token, addr common.Address) *big.Int {
	c.tb.Helper()
	return c.readUint(token, contracts.StableCoinABI, "balanceOf", addr)
}

// ETHBalance returns the ETH balance of addr in wei.
func (c *Chain) ETHBalance(addr common.Address) *big.Int {
	c.tb.Helper()
	c.sealed()
	b, err := c.Client.BalanceAt(context.Background(), addr, nil)
	if err != nil {
		c.tb.Fatalf("chaintest: reading the balance of %s: %v", addr, err)
	}
	return b
}

// Allowance returns the StableCoin allowance owner gave spender.
func (c *Chain) Allowance(owner, spender common.Address) *big.Int {
	c.tb.Helper()
	return c.readUint(c.Token, contracts.StableCoinABI, "allowance", owner, spender)
}

// TokenNonce returns the EIP-2612 nonce of owner, the one its next permit must carry.
func (c *Chain) TokenNonce(owner common.Address) *big.Int {
	c.tb.Helper()
	return c.readUint(c.Token, contracts.StableCoinABI, "nonces", owner)
}

// NonceBitmap returns Permit2's nonce bitmap word of owner.
func (c *Chain) NonceBitmap(owner common.Address, word *big.Int) *big.Int {
	c.tb.Helper()
	return c.readUint(contracts.Permit2Address, contracts.Permit2ABI, "nonceBitmap", owner, word)
}

// Permit2NonceUsed reports whether Permit2 marks nonce of owner as used.
func (c *Chain) Permit2NonceUsed(owner common.Address, nonce *big.Int) bool {
	c.tb.Helper()
	word := new(big.Int).Rsh(nonce, 8)
	bit := uint(new(big.Int).And(nonce, big.NewInt(0xff)).Uint64())
	return c.NonceBitmap(owner, word).Bit(int(bit)) == 1
}

// TxCount returns the number of transactions addr has sent (its confirmed account nonce).
func (c *Chain) TxCount(addr common.Address) uint64 {
	c.tb.Helper()
	c.sealed()
	n, err := c.Client.NonceAt(context.Background(), addr, nil)
	if err != nil {
		c.tb.Fatalf("chaintest: reading the nonce of %s: %v", addr, err)
	}
	return n
}

// Approve has owner approve spender for amount on the token, sealed into a block.
// The owner pays the gas, so it must hold ETH.
func (c *Chain) Approve(owner *Account, spender common.Address, amount *big.Int) *types.Receipt {
	c.tb.Helper()
	return c.mustTransact(owner, c.Token, contracts.StableCoinABI, "approve", spender, amount)
}

// Mint mints amount raw units to addr (sent by the deployer), sealed into a block.
func (c *Chain) Mint(to common.Address, amount *big.Int) *types.Receipt {
	c.tb.Helper()
	return c.mustTransact(c.Deployer, c.Token, contracts.StableCoinABI, "mint", to, amount)
}

// TransferToken sends amount raw units from an account to addr, sealed into a block.
func (c *Chain) TransferToken(from *Account, to common.Address, amount *big.Int) *types.Receipt {
	c.tb.Helper()
	return c.mustTransact(from, c.Token, contracts.StableCoinABI, "transfer", to, amount)
}

// SendETH sends wei from an account to addr, sealed into a block.
func (c *Chain) SendETH(from *Account, to common.Address, wei *big.Int) *types.Receipt {
	c.tb.Helper()
	receipt, err := c.transact(context.Background(), from, &to, wei, nil)
	if err != nil {
		c.tb.Fatalf("chaintest: sending %s wei from %s to %s: %v", wei, from.Address, to, err)
	}
	return receipt
}

func (c *Chain) mustTransact(from *Account, to common.Address, parsed abi.ABI, method string, args ...any) *types.Receipt {
	c.tb.Helper()
	data, err := parsed.Pack(method, args...)
	if err != nil {
		c.tb.Fatalf("chaintest: packing %s: %v", method, err)
	}
	receipt, err := c.Transact(context.Background(), from, to, data)
	if err != nil {
		c.tb.Fatalf("chaintest: %s from %s: %v", method, from.Address, err)
	}
	return receipt
}

// TokenTransfers returns the token's Transfer logs from genesis to the head block,
// filtered by from and to; a zero address matches any.
func (c *Chain) TokenTransfers(from, to common.Address) []Transfer {
	c.tb.Helper()
	return c.transfers(ethereum.FilterQuery{FromBlock: big.NewInt(0)}, from, to)
}

// CountTokenTransfers counts the token's Transfer logs from from to to (zero address: any),
// the way to assert that a payment moved exactly once.
func (c *Chain) CountTokenTransfers(from, to common.Address) int {
	c.tb.Helper()
	return len(c.TokenTransfers(from, to))
}

// TransfersInBlock returns the token's Transfer logs in block number n.
func (c *Chain) TransfersInBlock(n uint64) []Transfer {
	c.tb.Helper()
	b := new(big.Int).SetUint64(n)
	return c.transfers(ethereum.FilterQuery{FromBlock: b, ToBlock: b}, common.Address{}, common.Address{})
}

// TransfersInTx returns the token's Transfer logs emitted by transaction hash.
func (c *Chain) TransfersInTx(hash common.Hash) []Transfer {
	c.tb.Helper()
	receipt, err := c.Client.TransactionReceipt(context.Background(), hash)
	if err != nil {
		c.tb.Fatalf("chaintest: reading the receipt of %s: %v", hash, err)
	}
	var out []Transfer
	for _, l := range receipt.Logs {
		if t, ok := c.parseTransfer(l); ok {
			out = append(out, t)
		}
	}
	return out
}

func (c *Chain) transfers(q ethereum.FilterQuery, from, to common.Address) []Transfer {
	c.tb.Helper()
	q.Addresses = []common.Address{c.Token}
	q.Topics = [][]common.Hash{{transferTopic}}
	if from != (common.Address{}) {
		q.Topics = append(q.Topics, []common.Hash{common.BytesToHash(from.Bytes())})
	} else {
		q.Topics = append(q.Topics, nil)
	}
	if to != (common.Address{}) {
		q.Topics = append(q.Topics, []common.Hash{common.BytesToHash(to.Bytes())})
	}
	c.sealed()
	logs, err := c.Client.FilterLogs(context.Background(), q)
	if err != nil {
		c.tb.Fatalf("chaintest: filtering Transfer logs: %v", err)
	}
	var out []Transfer
	for _, l := range logs {
		if t, ok := c.parseTransfer(&l); ok {
			out = append(out, t)
		}
	}
	return out
}

func (c *Chain) parseTransfer(l *types.Log) (Transfer, bool) {
	if l.Address != c.Token || len(l.Topics) != 3 || l.Topics[0] != transferTopic || len(l.Data) != 32 {
		return Transfer{}, false
	}
	return Transfer{
		From:   common.BytesToAddress(l.Topics[1].Bytes()),
		To:     common.BytesToAddress(l.Topics[2].Bytes()),
		Value:  new(big.Int).SetBytes(l.Data),
		TxHash: l.TxHash,
		Block:  l.BlockNumber,
	}, true
}
