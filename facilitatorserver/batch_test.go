package facilitatorserver_test

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"encoding/json"
	"fmt"
	"math/big"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/ethereum/go-ethereum/common"
	"github.com/ethereum/go-ethereum/common/hexutil"

	"github.com/x402-gateway/caddy-x402/chain"
	"github.com/x402-gateway/caddy-x402/chain/chaintest"
	"github.com/x402-gateway/caddy-x402/chain/contracts"
	"github.com/x402-gateway/caddy-x402/chain/journal"
	"github.com/x402-gateway/caddy-x402/facilitatorserver"
	"github.com/x402-gateway/caddy-x402/x402"
)

// batchVoucherBody is a /verify or /settle body of payer's voucher for cumulative, on a channel funded on chain
// with deposit, to a route of price per request.
type batchChannel struct {
	c      *chaintest.Chain
	rq     x402.BatchRequirements
	cfg    contracts.ChannelConfig
	id     common.Hash
	payer  *chaintest.Account
	token  common.Address
	engine *chain.Facilitator
}

func newBatchChannel(t *testing.T, deposit int64) *batchChannel {
	t.Helper()
	c := chaintest.New(t, chaintest.WithPromptCommit())
	token := c.DeployUSDCoin(big.NewInt(1_000_000_000))
	network := x402.EIP155(c.ChainID.Uint64())
	authorizer := chaintest.DeriveAccount("authorizer", 0)
	nc := chain.NetworkConfig{Network: network, Backend: c.Client, ReceiptPoll: 2 * time.Millisecond,
		Assets: []chain.AssetConfig{{Address: token, Name: contracts.USDCoinName, Version: contracts.USDCoinVersion, Decimals: 6}},
		Keys:   []*ecdsa.PrivateKey{c.Wallets[0].Key}, BatchReceiverAuthorizer: authorizer.Key, BatchClaimEvery: 1_000_000, BatchClaimAfter: time.Hour}
	f, err := chain.New(context.Background(), chain.Config{Networks: []chain.NetworkConfig{nc}, Journal: journal.NewMemory(journal.Options{})})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	b := &batchChannel{c: c, payer: c.Payers[0], engine: f}
	b.rq = x402.BatchRequirements{Scheme: x402.SchemeBatchSettlement, Network: network, Amount: fmt.Sprint(price), Asset: token.Hex(),
		PayTo: seller.Hex(), MaxTimeoutSeconds: 300, Extra: x402.BatchExtra{ReceiverAuthorizer: authorizer.Address.Hex(),
			WithdrawDelay: contracts.MinWithdrawDelay, Name: contracts.USDCoinName, Version: contracts.USDCoinVersion}}
	b.cfg = contracts.ChannelConfig{Payer: b.payer.Address, PayerAuthorizer: b.payer.Address, Receiver: seller,
		ReceiverAuthorizer: authorizer.Address, Token: token, WithdrawDelay: contracts.MinWithdrawDelay}
	b.cfg.Salt[31] = 7
	b.id = chaintest.ChannelID(c.ChainID, b.cfg)
	// Funded on chain by anyone's deposit.
	salt := chaintest.RandomNonce()
	validBefore := new(big.Int).SetUint64(c.HeadTime() + 3600)
	nonce := contracts.ERC3009DepositNonce(b.id, common.BigToHash(salt))
	sig := c.SignTypedData(b.payer, chaintest.ReceiveAuthorizationTypedData(contracts.USDCoinName, contracts.USDCoinVersion, c.ChainID,
		token, b.payer.Address, big.NewInt(deposit), big.NewInt(0), validBefore, nonce))
	data, err := contracts.EncodeERC3009CollectorData(big.NewInt(0), validBefore, salt, sig)
	if err != nil {
		t.Fatal(err)
	}
	call, err := contracts.PackBatchDeposit(b.cfg, big.NewInt(deposit), contracts.ERC3009DepositCollectorAddress, data)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.Transact(context.Background(), c.Deployer, contracts.BatchSettlementAddress, call); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.AutoCommit(5 * time.Millisecond)) // the engine's own transactions
	b.token = token
	return b
}

// depositBody is a /settle body of the payer's deposit of amount through the engine, its voucher for cumulative.
func (b *batchChannel) depositBody(t *testing.T, amount, cumulative int64) []byte {
	t.Helper()
	salt := common.BigToHash(chaintest.RandomNonce())
	validBefore := new(big.Int).SetUint64(b.c.HeadTime() + 240)
	nonce := contracts.ERC3009DepositNonce(b.id, salt)
	sig := b.c.SignTypedData(b.payer, chaintest.ReceiveAuthorizationTypedData(contracts.USDCoinName, contracts.USDCoinVersion, b.c.ChainID,
		b.token, b.payer.Address, big.NewInt(amount), big.NewInt(0), validBefore, nonce))
	var req x402.BatchRequest
	if err := json.Unmarshal(b.body(t, cumulative), &req); err != nil {
		t.Fatal(err)
	}
	pl := &req.PaymentPayload.Payload
	pl.Type = x402.BatchDeposit
	pl.Deposit = &x402.BatchDepositFields{Amount: fmt.Sprint(amount), Authorization: x402.BatchDepositAuthorization{
		ERC3009Authorization: &x402.BatchERC3009Authorization{ValidAfter: "0", ValidBefore: validBefore.String(), Salt: salt.Hex(), Signature: hexutil.Encode(sig)}}}
	body, err := json.Marshal(req)
	if err != nil {
		t.Fatal(err)
	}
	return body
}

func (b *batchChannel) body(t *testing.T, cumulative int64) []byte {
	t.Helper()
	sig := b.c.SignVoucher(b.payer, b.id, big.NewInt(cumulative))
	p := x402.BatchPayment{X402Version: 2, Accepted: b.rq, Payload: x402.BatchPayload{Type: x402.BatchVoucher,
		ChannelConfig: &x402.ChannelConfig{Payer: b.cfg.Payer.Hex(), PayerAuthorizer: b.cfg.PayerAuthorizer.Hex(), Receiver: b.cfg.Receiver.Hex(),
			ReceiverAuthorizer: b.cfg.ReceiverAuthorizer.Hex(), Token: b.cfg.Token.Hex(), WithdrawDelay: int64(b.cfg.WithdrawDelay), Salt: hexutil.Encode(b.cfg.Salt[:])},
		Voucher: &x402.BatchVoucherFields{ChannelID: b.id.Hex(), MaxClaimableAmount: fmt.Sprint(cumulative), Signature: hexutil.Encode(sig)}}}
	body, err := json.Marshal(x402.BatchRequest{X402Version: 2, PaymentPayload: p, PaymentRequirements: b.rq})
	if err != nil {
		t.Fatal(err)
	}
	return body
}

func post(t *testing.T, url string, body []byte) (int, []byte) {
	t.Helper()
	resp, err := http.Post(url, "application/json", bytes.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var buf bytes.Buffer
	buf.ReadFrom(resp.Body)
	return resp.StatusCode, buf.Bytes()
}

func TestBatchSettlementIsListedVerifiedAndSettledOverHTTP(t *testing.T) {
	b := newBatchChannel(t, 10*price)
	srv, err := facilitatorserver.New(b.engine, facilitatorserver.Options{})
	if err != nil {
		t.Fatal(err)
	}
	ts := httptest.NewServer(srv)
	t.Cleanup(ts.Close)

	resp, err := http.Get(ts.URL + "/supported")
	if err != nil {
		t.Fatal(err)
	}
	var sup x402.SupportedResponse
	err = json.NewDecoder(resp.Body).Decode(&sup)
	resp.Body.Close()
	if _, ok := sup.SchemeKind(x402.Version2, x402.SchemeBatchSettlement, b.rq.Network, x402.TransferEIP3009); err != nil || !ok {
		t.Fatalf("/supported lists no batch-settlement kind: %+v, %v", sup.Kinds, err)
	}

	status, out := post(t, ts.URL+"/verify", b.body(t, price))
	var v x402.VerifyResponse
	if status != http.StatusOK || json.Unmarshal(out, &v) != nil || !v.IsValid {
		t.Fatalf("/verify of a voucher: %d %s", status, out)
	}
	// A voucher is settled by the resource server, never by /settle (the SDK's wire): refused as a request.
	if status, out := post(t, ts.URL+"/settle", b.body(t, price)); status != http.StatusBadRequest {
		t.Fatalf("/settle of a voucher: %d %s, want 400", status, out)
	}
	// A top-up deposit is settled through the engine, its voucher accepted.
	status, out = post(t, ts.URL+"/settle", b.depositBody(t, 5*price, price))
	s, err := x402.UnmarshalBatchSettleResponse(out)
	if status != http.StatusOK || err != nil || !s.Success || s.Transaction == "" || s.Commitment() != fmt.Sprintf("%s@%d", hexutil.Encode(b.id[:]), price) {
		t.Fatalf("/settle of a deposit: %d %s (%v)", status, out, err)
	}
	// A voucher skipping ahead is refused with the scheme's reason.
	status, out = post(t, ts.URL+"/verify", b.body(t, 3*price))
	if status != http.StatusOK || json.Unmarshal(out, &v) != nil || v.IsValid || v.InvalidReason != x402.ReasonBatchCumulativeAmountMismatch {
		t.Fatalf("/verify of a voucher skipping ahead: %d %s", status, out)
	}
	// A malformed body is a 400 naming the field.
	bad := bytes.Replace(b.body(t, 2*price), []byte(`"signature"`), []byte(`"signatur"`), 1)
	status, out = post(t, ts.URL+"/settle", bad)
	var eb struct{ Error, Field string }
	if status != http.StatusBadRequest || json.Unmarshal(out, &eb) != nil || eb.Field == "" {
		t.Fatalf("a malformed batch body: %d %s", status, out)
	}
}

func TestBatchBodiesAreRefusedByAServerWhoseFacilitatorDoesNotServeTheScheme(t *testing.T) {
	b := newBatchChannel(t, 10*price)
	behind := &countingFacilitator{}
	srv, err := facilitatorserver.New(behind, facilitatorserver.Options{})
	if err != nil {
		t.Fatal(err)
	}
	ts := httptest.NewServer(srv)
	t.Cleanup(ts.Close)
	status, out := post(t, ts.URL+"/verify", b.body(t, price))
	var v x402.VerifyResponse
	if status != http.StatusOK || json.Unmarshal(out, &v) != nil || v.IsValid || v.InvalidReason != x402.ReasonUnsupportedScheme {
		t.Fatalf("/verify of a voucher at a facilitator without the scheme: %d %s", status, out)
	}
	if behind.calls() != 0 {
		t.Fatalf("the facilitator behind was asked %d times", behind.calls())
	}
}
