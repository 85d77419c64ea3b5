package chain

import (
	"context"
	"errors"
	"math/big"
	"testing"
	"time"

	"github.com/ethereum/go-ethereum/common"
	"github.com/ethereum/go-ethereum/core/types"
	"github.com/ethereum/go-ethereum/params"

	"github.com/x402-gateway/caddy-x402/chain/chaintest"
)

// A stuck transaction that sends value (a sponsored approval's gas money) is replaced by one that sends the same
// value, with higher fees: a replacement without it would leave the payer unfunded and its approval stuck.
func TestAFeeBumpKeepsTheValueTheStuckTransactionSends(t *testing.T) {
	c := chaintest.New(t)
	s := newSender(c.EthClient, c.ChainID, FeePolicy{CacheFor: time.Second}, time.Now)
	w := &wallet{key: c.Wallets[0].Key, Address: c.Wallets[0].Address}
	q, err := s.feeQuote(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	value := big.NewInt(7_000_000_000_000)
	stuck, err := s.sign(w, 0, contractCall{To: c.PayerNoGas.Address, Value: value, Gas: params.TxGas}, q)
	if err != nil {
		t.Fatal(err)
	}
	replacement, err := s.replace(context.Background(), w, stuck)
	if err != nil {
		t.Fatal(err)
	}
	if replacement.Value().Cmp(value) != 0 || replacement.Nonce() != stuck.Nonce() || replacement.GasFeeCap().Cmp(stuck.GasFeeCap()) <= 0 {
		t.Fatalf("replacement sends %s at nonce %d with fee cap %s; want %s at %d above %s", replacement.Value(), replacement.Nonce(), replacement.GasFeeCap(), value, stuck.Nonce(), stuck.GasFeeCap())
	}
}

// receiptsUnreadable is a node whose receipts cannot be read (its RPC answering 503, say).
type receiptsUnreadable struct{ Backend }

func (receiptsUnreadable) TransactionReceipt(context.Context, common.Hash) (*types.Receipt, error) {
	return nil, errors.New("503 Service Unavailable")
}

// A payer's signed approval that the node refuses as "nonce too low" is mined already (an earlier attempt sent it)
// or replaced by another of the payer's transactions: only its receipt tells which. A receipt that cannot be read
// leaves it unknown, never refused: refused, the settlement after it would be forgotten and the payer told nothing
// was sent, though its approval (and the gas money for it) is spent, and the payment, settled again, funds it again.
func TestASignedApprovalRefusedAsMinedWhoseReceiptCannotBeReadIsNotTakenForRefused(t *testing.T) {
	c := chaintest.New(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	payer := c.Payers[2]
	nonce, err := c.EthClient.PendingNonceAt(ctx, payer.Address)
	if err != nil {
		t.Fatal(err)
	}
	head, err := c.EthClient.HeaderByNumber(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	signed := func(n uint64) *types.Transaction {
		to := c.Payers[3].Address
		tx, err := types.SignNewTx(payer.Key, types.LatestSignerForChainID(c.ChainID), &types.DynamicFeeTx{ChainID: c.ChainID, Nonce: n,
			GasTipCap: big.NewInt(params.GWei), GasFeeCap: new(big.Int).Add(new(big.Int).Mul(head.BaseFee, big.NewInt(3)), big.NewInt(params.GWei)), Gas: params.TxGas, To: &to, Value: big.NewInt(int64(n) + 1)})
		if err != nil {
			t.Fatal(err)
		}
		return tx
	}
	mined := signed(nonce)
	if err := c.SendSigned(ctx, mined); err != nil {
		t.Fatal(err)
	}
	if _, err := c.CommitUntilIncluded(ctx, mined.Hash()); err != nil {
		t.Fatal(err)
	}
	blind := newSender(receiptsUnreadable{c.EthClient}, c.ChainID, FeePolicy{CacheFor: time.Second}, time.Now)
	if err := blind.sendSigned(ctx, mined); !errors.Is(err, errBroadcastUnknown) || errors.Is(err, errSignedRefused) {
		t.Fatalf("sent again, mined, its receipt unreadable: %v; want it unknown (errBroadcastUnknown), not refused", err)
	}
	// Told apart when the receipt can be read: mined, it is the one (its receipt awaited: success); another
	// transaction took its nonce, it is refused.
	seeing := newSender(c.EthClient, c.ChainID, FeePolicy{CacheFor: time.Second}, time.Now)
	seeing.poll = 10 * time.Millisecond
	if err := seeing.sendSigned(ctx, mined); err != nil {
		t.Fatalf("sent again, mined, its receipt readable: %v; want nil", err)
	}
	other, err := types.SignNewTx(payer.Key, types.LatestSignerForChainID(c.ChainID), &types.DynamicFeeTx{ChainID: c.ChainID, Nonce: nonce,
		GasTipCap: big.NewInt(2 * params.GWei), GasFeeCap: new(big.Int).Add(mined.GasFeeCap(), big.NewInt(params.GWei)), Gas: params.TxGas, To: mined.To(), Value: big.NewInt(99)})
	if err != nil {
		t.Fatal(err)
	}
	if err := seeing.sendSigned(ctx, other); !errors.Is(err, errSignedRefused) {
		t.Fatalf("a transaction whose nonce another took: %v; want refused", err)
	}
}
