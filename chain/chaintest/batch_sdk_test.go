package chaintest

import (
	"bytes"
	"encoding/json"
	"math/big"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/ethereum/go-ethereum/common"
	"github.com/ethereum/go-ethereum/common/hexutil"

	"github.com/x402-gateway/caddy-x402/chain/contracts"
)

// sdkVector is testdata/batch-settlement-sdk-vector.json, written by `node e2e/interop/batch-vectors.mjs
// chaintest` with the public @x402/evm 2.27 SDK for chaintest's payer, merchant, authorizer and USDCoin: what
// the SDK's client signs for a deposit and vouchers, what its facilitator signs for a claim batch and a refund,
// and its contract ABI.
type sdkVector struct {
	ChainID       int64          `json:"chainId"`
	Token         common.Address `json:"token"`
	ChannelConfig struct {
		Payer              common.Address `json:"payer"`
		PayerAuthorizer    common.Address `json:"payerAuthorizer"`
		Receiver           common.Address `json:"receiver"`
		ReceiverAuthorizer common.Address `json:"receiverAuthorizer"`
		Token              common.Address `json:"token"`
		WithdrawDelay      uint64         `json:"withdrawDelay"`
		Salt               common.Hash    `json:"salt"`
	} `json:"channelConfig"`
	ChannelID common.Hash `json:"channelId"`
	Deposit   struct {
		Voucher sdkVoucher `json:"voucher"`
		Deposit struct {
			Amount        string `json:"amount"`
			Authorization struct {
				ERC3009 struct {
					ValidAfter  string        `json:"validAfter"`
					ValidBefore string        `json:"validBefore"`
					Salt        string        `json:"salt"`
					Signature   hexutil.Bytes `json:"signature"`
				} `json:"erc3009Authorization"`
			} `json:"authorization"`
		} `json:"deposit"`
	} `json:"deposit"`
	Voucher                  sdkVoucher    `json:"voucher"`
	ClaimAuthorizerSignature hexutil.Bytes `json:"claimAuthorizerSignature"`
	Refund                   struct {
		Nonce     string        `json:"nonce"`
		Amount    string        `json:"amount"`
		Signature hexutil.Bytes `json:"signature"`
	} `json:"refund"`
	ABI []struct {
		Signature string `json:"signature"`
		ID        string `json:"id"`
	} `json:"abi"`
}

type sdkVoucher struct {
	ChannelID          common.Hash   `json:"channelId"`
	MaxClaimableAmount string        `json:"maxClaimableAmount"`
	Signature          hexutil.Bytes `json:"signature"`
}

func loadSDKVector(t *testing.T) *sdkVector {
	t.Helper()
	raw, err := os.ReadFile(filepath.Join("testdata", "batch-settlement-sdk-vector.json"))
	if err != nil {
		t.Fatal(err)
	}
	var v sdkVector
	if err := json.Unmarshal(raw, &v); err != nil {
		t.Fatalf("parsing the SDK vector: %v", err)
	}
	return &v
}

func dec(t *testing.T, s string) *big.Int {
	t.Helper()
	n, ok := new(big.Int).SetString(s, 0)
	if !ok {
		t.Fatalf("not a number: %q", s)
	}
	return n
}

func TestBatchSettlementABICoversEverySDKCall(t *testing.T) {
	v := loadSDKVector(t)
	if len(v.ABI) < 15 {
		t.Fatalf("the SDK vector lists %d ABI items", len(v.ABI))
	}
	for _, item := range v.ABI {
		name := item.Signature[:strings.IndexByte(item.Signature, '(')]
		id := common.FromHex(item.ID)
		if m, ok := contracts.BatchSettlementABI.Methods[name]; ok {
			if !bytes.Equal(m.ID, id) {
				t.Errorf("%s: our selector is %x (%s), the SDK's %s (%s)", name, m.ID, m.Sig, item.ID, item.Signature)
			}
			continue
		}
		if e, ok := contracts.BatchSettlementABI.Events[name]; ok {
			if !bytes.Equal(e.ID[:], id) {
				t.Errorf("event %s: our topic is %s (%s), the SDK's %s (%s)", name, e.ID, e.Sig, item.ID, item.Signature)
			}
			continue
		}
		t.Errorf("our ABI lacks %s, which the SDK calls", item.Signature)
	}
}

// TestBatchSDKSignedDepositVoucherClaimAndRefundWorkOnOurContracts replays what the SDK signed: our Go signer
// produces the same signatures byte for byte (both sign deterministically, RFC 6979), and our contracts accept
// the SDK's own, moving exactly the signed amounts.
func TestBatchSDKSignedDepositVoucherClaimAndRefundWorkOnOurContracts(t *testing.T) {
	v := loadSDKVector(t)
	fx := newBatchFixture(t)
	if fx.c.ChainID.Int64() != v.ChainID || fx.token != v.Token {
		t.Fatalf("the vector was made for chain %d and USDCoin %s; the fixture has %s and %s: regenerate it (node e2e/interop/batch-vectors.mjs chaintest OUT.json)",
			v.ChainID, v.Token, fx.c.ChainID, fx.token)
	}
	cc := v.ChannelConfig
	cfg := contracts.ChannelConfig{Payer: cc.Payer, PayerAuthorizer: cc.PayerAuthorizer, Receiver: cc.Receiver,
		ReceiverAuthorizer: cc.ReceiverAuthorizer, Token: cc.Token, WithdrawDelay: cc.WithdrawDelay, Salt: cc.Salt}
	if cfg.Payer != fx.payer.Address || cfg.Receiver != fx.receiver.Address || cfg.ReceiverAuthorizer != fx.authorizer.Address {
		t.Fatalf("the vector's accounts are not chaintest's payer, merchant and authorizer")
	}

	// Channel id: the SDK's computeChannelId, ours, and the contract's agree.
	id := ChannelID(fx.c.ChainID, cfg)
	if id != v.ChannelID {
		t.Errorf("channel id %s, the SDK's %s", id, v.ChannelID)
	}
	if out := fx.view(t, "getChannelId", cfg); common.Hash(out[0].([32]byte)) != v.ChannelID {
		t.Errorf("the contract's channel id %x, the SDK's %s", out[0], v.ChannelID)
	}

	// Our signer signs what the SDK signs.
	auth := v.Deposit.Deposit.Authorization.ERC3009
	amount, validAfter, validBefore, salt := dec(t, v.Deposit.Deposit.Amount), dec(t, auth.ValidAfter), dec(t, auth.ValidBefore), dec(t, auth.Salt)
	nonce := contracts.ERC3009DepositNonce(id, common.BigToHash(salt))
	for _, c := range []struct {
		what      string
		ours, sdk []byte
	}{
		{"deposit voucher", fx.c.SignVoucher(fx.payer, id, dec(t, v.Deposit.Voucher.MaxClaimableAmount)), v.Deposit.Voucher.Signature},
		{"voucher", fx.c.SignVoucher(fx.payer, id, dec(t, v.Voucher.MaxClaimableAmount)), v.Voucher.Signature},
		{"ReceiveWithAuthorization", fx.c.SignTypedData(fx.payer, ReceiveAuthorizationTypedData(contracts.USDCoinName, contracts.USDCoinVersion,
			fx.c.ChainID, fx.token, fx.payer.Address, amount, validAfter, validBefore, nonce)), auth.Signature},
		{"refund", fx.c.SignRefund(fx.authorizer, id, dec(t, v.Refund.Nonce), dec(t, v.Refund.Amount)), v.Refund.Signature},
	} {
		if !bytes.Equal(c.ours, c.sdk) {
			t.Errorf("%s: our signature %x, the SDK's %x", c.what, c.ours, c.sdk)
		}
	}
	max := dec(t, v.Voucher.MaxClaimableAmount)
	rows := []contracts.VoucherClaim{{Voucher: contracts.Voucher{Channel: cfg, MaxClaimableAmount: max}, Signature: v.Voucher.Signature, TotalClaimed: max}}
	if ours := fx.c.SignClaimBatch(fx.authorizer, rows); !bytes.Equal(ours, v.ClaimAuthorizerSignature) {
		t.Errorf("claim batch: our signature %x, the SDK's %x", ours, v.ClaimAuthorizerSignature)
	}

	// The SDK's signatures on our contracts, as its facilitator sends them.
	collectorData, err := contracts.EncodeERC3009CollectorData(validAfter, validBefore, salt, auth.Signature)
	if err != nil {
		t.Fatal(err)
	}
	data, _ := contracts.PackBatchDeposit(cfg, amount, contracts.ERC3009DepositCollectorAddress, collectorData)
	fx.mustSend(t, fx.relayer, data, "the SDK's deposit")
	if bal, _ := fx.channelState(t, id); bal != amount.Int64() {
		t.Errorf("channel balance %d after the SDK's deposit, want %s", bal, amount)
	}
	data, _ = contracts.PackClaimWithSignature(rows, v.ClaimAuthorizerSignature)
	fx.mustSend(t, fx.relayer, data, "the SDK's claim")
	data, _ = contracts.PackBatchSettle(fx.receiver.Address, fx.token)
	fx.mustSend(t, fx.relayer, data, "settle")
	if got := fx.balance(fx.receiver.Address); got != max.Int64() {
		t.Errorf("receiver holds %d, want %s", got, max)
	}
	data, _ = contracts.PackRefundWithSignature(cfg, dec(t, v.Refund.Amount), dec(t, v.Refund.Nonce), v.Refund.Signature)
	fx.mustSend(t, fx.relayer, data, "the SDK's refund")
	if got := fx.balance(fx.payer.Address); got != batchMint-max.Int64() {
		t.Errorf("payer holds %d after the refund, want %d (all but the claimed %s)", got, batchMint-max.Int64(), max)
	}
	fx.escrowHolds(t, 0)
}
