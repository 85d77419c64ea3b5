package chain

import (
	"context"
	"math/big"
	"testing"
	"time"

	"github.com/ethereum/go-ethereum"
	"github.com/ethereum/go-ethereum/common"
	"github.com/ethereum/go-ethereum/core/types"
	"github.com/ethereum/go-ethereum/crypto"
)

// payerNode answers what reconciliation reads of a payer: its nonces and pending balance; it knows no transaction.
type payerNode struct {
	Backend
	mined, pending uint64
	pendingBalance *big.Int
}

func (b *payerNode) TransactionByHash(context.Context, common.Hash) (*types.Transaction, bool, error) {
	return nil, false, ethereum.NotFound
}

func (b *payerNode) TransactionReceipt(context.Context, common.Hash) (*types.Receipt, error) {
	return nil, ethereum.NotFound
}

func (b *payerNode) NonceAt(context.Context, common.Address, *big.Int) (uint64, error) {
	return b.mined, nil
}

func (b *payerNode) PendingNonceAt(context.Context, common.Address) (uint64, error) {
	return b.pending, nil
}

func (b *payerNode) PendingBalanceAt(context.Context, common.Address) (*big.Int, error) {
	return b.pendingBalance, nil
}

// Reconciliation's judgement of a recorded gas money for a payer's approval (nonce 0) the node does not know: sent
// while the payer lacks the approval's gas and nothing else of the payer's takes the nonce; never once another of
// its transactions mined at that nonce (the approval can never mine), nor while one is on its way (found by review:
// the pending balance is what the other approval's own gas money leaves, short of this one's gas, and the payer was
// sent gas money a second time for one nonce; and waiting for it held the wallet's later nonces).
func TestReconciliationFundsARecordedApprovalOnlyWhileNothingElseTakesItsNonce(t *testing.T) {
	key, err := crypto.GenerateKey()
	if err != nil {
		t.Fatal(err)
	}
	payer, chainID, token := crypto.PubkeyToAddress(key.PublicKey), big.NewInt(1337), common.HexToAddress("0x1")
	approval, err := types.SignNewTx(key, types.LatestSignerForChainID(chainID), &types.DynamicFeeTx{
		ChainID: chainID, Nonce: 0, GasTipCap: big.NewInt(1e8), GasFeeCap: big.NewInt(1e9), Gas: 70_000, To: &token})
	if err != nil {
		t.Fatal(err)
	}
	short := new(big.Int).Mul(big.NewInt(70_000-46_000), big.NewInt(1e9)) // what another approval's gas money left
	enough := new(big.Int).Mul(big.NewInt(70_000), big.NewInt(1e9))
	for _, tc := range []struct {
		name           string
		mined, pending uint64
		balance        *big.Int
		want           bool
	}{
		{name: "nothing else of the payer's, short of gas", balance: short, want: true},
		{name: "nothing else of the payer's, its gas there", balance: enough},
		{name: "another transaction mined at its nonce", mined: 1, pending: 1, balance: short},
		{name: "another transaction on its way at its nonce", pending: 1, balance: short},
	} {
		t.Run(tc.name, func(t *testing.T) {
			node := &payerNode{mined: tc.mined, pending: tc.pending, pendingBalance: tc.balance}
			n := &network{backend: node, sender: newSender(node, chainID, FeePolicy{}, time.Now)}
			needed, err := payerLacksGas(context.Background(), n, payer, approval)
			if needed != tc.want || err != nil {
				t.Fatalf("payerLacksGas = %v, %v; want %v", needed, err, tc.want)
			}
		})
	}
}
