package caddymodule_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math/big"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/ethereum/go-ethereum/common"
	"github.com/ethereum/go-ethereum/common/hexutil"

	"github.com/x402-gateway/caddy-x402/chain/chaintest"
	"github.com/x402-gateway/caddy-x402/chain/contracts"
	"github.com/x402-gateway/caddy-x402/x402"
)

// batchClaimPrice is what each voucher of the batch channel below adds.
const batchClaimPrice = 1000

// batchChannel is one payer's batch-settlement channel to a receiver, on a simulated chain whose ERC-3009 token
// deposits are made in, with the requests a seller's server would post to a facilitator for it.
type batchChannel struct {
	c                           *chaintest.Chain
	token                       common.Address
	payer, receiver, authorizer *chaintest.Account
	rq                          x402.BatchRequirements
	cfg                         contracts.ChannelConfig
	id                          common.Hash
}

func newBatchChannel(c *chaintest.Chain, token common.Address) *batchChannel {
	b := &batchChannel{c: c, token: token, payer: c.Payers[0],
		receiver: chaintest.DeriveAccount("merchant", 0), authorizer: chaintest.DeriveAccount("authorizer", 0)}
	b.rq = x402.BatchRequirements{Scheme: x402.SchemeBatchSettlement, Network: x402.EIP155(c.ChainID.Uint64()), Amount: fmt.Sprint(batchClaimPrice),
		Asset: token.Hex(), PayTo: b.receiver.Address.Hex(), MaxTimeoutSeconds: 300,
		Extra: x402.BatchExtra{ReceiverAuthorizer: b.authorizer.Address.Hex(), WithdrawDelay: contracts.MinWithdrawDelay,
			Name: contracts.USDCoinName, Version: contracts.USDCoinVersion}}
	b.cfg = contracts.ChannelConfig{Payer: b.payer.Address, PayerAuthorizer: b.payer.Address, Receiver: b.receiver.Address,
		ReceiverAuthorizer: b.authorizer.Address, Token: token, WithdrawDelay: contracts.MinWithdrawDelay,
		Salt: common.BigToHash(chaintest.RandomNonce())}
	b.id = chaintest.ChannelID(c.ChainID, b.cfg)
	return b
}

// voucher is the request of the payer's voucher for cumulative.
func (b *batchChannel) voucher(cumulative int64) x402.BatchRequest {
	sig := b.c.SignVoucher(b.payer, b.id, big.NewInt(cumulative))
	wire := &x402.ChannelConfig{Payer: b.cfg.Payer.Hex(), PayerAuthorizer: b.cfg.PayerAuthorizer.Hex(), Receiver: b.cfg.Receiver.Hex(),
		ReceiverAuthorizer: b.cfg.ReceiverAuthorizer.Hex(), Token: b.cfg.Token.Hex(), WithdrawDelay: int64(b.cfg.WithdrawDelay),
		Salt: hexutil.Encode(b.cfg.Salt[:])}
	p := x402.BatchPayment{X402Version: 2, Accepted: b.rq, Payload: x402.BatchPayload{Type: x402.BatchVoucher, ChannelConfig: wire,
		Voucher: &x402.BatchVoucherFields{ChannelID: b.id.Hex(), MaxClaimableAmount: fmt.Sprint(cumulative), Signature: hexutil.Encode(sig)}}}
	return x402.BatchRequest{X402Version: 2, PaymentPayload: p, PaymentRequirements: b.rq}
}

// deposit is the request of the payer's deposit of amount (ERC-3009), with its voucher for cumulative.
func (b *batchChannel) deposit(t *testing.T, amount, cumulative int64) x402.BatchRequest {
	t.Helper()
	salt := common.BigToHash(chaintest.RandomNonce())
	validBefore := new(big.Int).SetUint64(b.c.HeadTime() + 240)
	nonce := contracts.ERC3009DepositNonce(b.id, salt)
	sig := b.c.SignTypedData(b.payer, chaintest.ReceiveAuthorizationTypedData(contracts.USDCoinName, contracts.USDCoinVersion, b.c.ChainID,
		b.token, b.payer.Address, big.NewInt(amount), big.NewInt(0), validBefore, nonce))
	req := b.voucher(cumulative)
	pl := &req.PaymentPayload.Payload
	pl.Type = x402.BatchDeposit
	pl.Deposit = &x402.BatchDepositFields{Amount: fmt.Sprint(amount), Authorization: x402.BatchDepositAuthorization{
		ERC3009Authorization: &x402.BatchERC3009Authorization{ValidAfter: "0", ValidBefore: validBefore.String(), Salt: salt.Hex(), Signature: hexutil.Encode(sig)}}}
	return req
}

// claimedOnChain is the channel's total claimed in the escrow.
func (b *batchChannel) claimedOnChain(t *testing.T) int64 {
	t.Helper()
	data, err := contracts.PackBatchSettlement("channels", b.id)
	if err != nil {
		t.Fatal(err)
	}
	raw, err := b.c.Call(context.Background(), b.c.Deployer.Address, contracts.BatchSettlementAddress, data)
	if err != nil {
		t.Fatal(err)
	}
	out, err := contracts.BatchSettlementABI.Unpack("channels", raw)
	if err != nil {
		t.Fatal(err)
	}
	return out[1].(*big.Int).Int64()
}

// settleBatchAt posts req to the facilitator route at base's /settle and decodes its answer.
func settleBatchAt(t *testing.T, base string, req x402.BatchRequest) x402.BatchSettleResponse {
	t.Helper()
	body, err := json.Marshal(req)
	if err != nil {
		t.Fatal(err)
	}
	resp, err := http.Post(base+"/settle", "application/json", bytes.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	raw, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("POST /settle answered %d: %s", resp.StatusCode, raw)
	}
	out, err := x402.UnmarshalBatchSettleResponse(raw)
	if err != nil {
		t.Fatalf("the /settle answer %s: %v", raw, err)
	}
	return out
}

// TestTheEmbeddedEngineClaimsBatchVouchersWithTheKeyAndEveryCountTheCaddyfileNames: a network's batch block gives
// the engine the receiver authorizer's key (through a placeholder) and claim_every 3. /supported names that
// authorizer; the vouchers the engine accepts (here those of deposits posted to the facilitator route, a first
// deposit and two top-ups: a voucher alone is the server's to keep, not a /settle body) are claimed on chain by it
// once three were accepted since the last claim, in one transaction, and not before: the receiver holds exactly
// what was accepted.
func TestTheEmbeddedEngineClaimsBatchVouchersWithTheKeyAndEveryCountTheCaddyfileNames(t *testing.T) {
	c := chaintest.New(t, chaintest.WithHTTP(), chaintest.WithPayers(2))
	token := c.DeployUSDCoin(big.NewInt(1_000_000_000))
	stop := c.AutoCommit(5 * time.Millisecond)
	t.Cleanup(stop)
	b := newBatchChannel(c, token)
	t.Setenv("X402_TEST_RECEIVER_AUTHORIZER_KEY", hexKey(b.authorizer))
	network := x402.EIP155(c.ChainID.Uint64())
	srv := startCaddy(t, `{
	x402 {
		network `+network+` {
			rpc `+c.RPCURL+`
			asset `+c.Token.Hex()+` name "Stable Coin" version 1 decimals 6
			asset `+token.Hex()+` name "`+contracts.USDCoinName+`" version `+contracts.USDCoinVersion+` decimals 6 eip3009
			wallet_keys `+hexKey(c.Wallets[0])+`
			receipt_poll 5ms
			batch {
				receiver_authorizer_key {env.X402_TEST_RECEIVER_AUTHORIZER_KEY}
				claim_every 3
				claim_after 1h
			}
		}
		journal {{DATA}}/journal.db
	}
}

{{ADDR}} {
	handle_path /facilitator/* {
		x402_facilitator {
			open
		}
	}
}
`)
	base := srv.URL + "/facilitator"

	resp, err := http.Get(base + "/supported")
	if err != nil {
		t.Fatal(err)
	}
	var sup x402.SupportedResponse
	err = json.NewDecoder(resp.Body).Decode(&sup)
	resp.Body.Close()
	if err != nil {
		t.Fatal(err)
	}
	var authorizer string
	for _, k := range sup.Kinds {
		if k.Scheme == x402.SchemeBatchSettlement && k.Network == network {
			authorizer = k.Extra.ReceiverAuthorizer
		}
	}
	if !strings.EqualFold(authorizer, b.authorizer.Address.Hex()) {
		t.Fatalf("/supported names receiver authorizer %q for batch-settlement; want the configured key's %s", authorizer, b.authorizer.Address.Hex())
	}

	sentBefore := c.TxCount(c.Wallets[0].Address)
	received := func() int64 { return c.BalanceOf(token, b.receiver.Address).Int64() }
	waitClaimed := func(want int64) {
		t.Helper()
		deadline := time.Now().Add(15 * time.Second)
		for received() != want || b.claimedOnChain(t) != want {
			if time.Now().After(deadline) {
				t.Fatalf("the receiver holds %d and the channel's total claimed is %d; want %d claimed", received(), b.claimedOnChain(t), want)
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
	// claimLoop looks once a second: past two of its passes, nothing claimed says the count held it back.
	notClaimedYet := func(want int64) {
		t.Helper()
		time.Sleep(2500 * time.Millisecond)
		if got := received(); got != want {
			t.Fatalf("the receiver holds %d; want %d: fewer than claim_every vouchers were accepted since the last claim", got, want)
		}
	}

	for i := int64(1); i <= 3; i++ {
		if i == 3 {
			notClaimedYet(0)
		}
		if s := settleBatchAt(t, base, b.deposit(t, 10*batchClaimPrice, i*batchClaimPrice)); !s.Success || s.Transaction == "" {
			t.Fatalf("deposit %d = %+v; want it sent and its voucher accepted", i, s)
		}
	}
	waitClaimed(3 * batchClaimPrice)
	notClaimedYet(3 * batchClaimPrice) // claimed once
	if sent := c.TxCount(c.Wallets[0].Address) - sentBefore; sent != 4 {
		t.Fatalf("the settlement wallet sent %d transactions; want 4: three deposits and one claim of their three vouchers", sent)
	}
}

// A network's batch block is refused at its line when a value is wrong, and never repeats a key.
func TestBadBatchOptionsAreRefusedNamingTheirCaddyfileLine(t *testing.T) {
	key := strings.Repeat("ab", 32)
	global := func(lines ...string) string {
		return "{\n\tx402 {\n\t\tnetwork eip155:723487 {\n\t\t\tbatch {\n" + strings.Join(lines, "\n") + "\n\t\t\t}\n\t\t}\n\t}\n}\n\n:8080\n\nrespond ok\n"
	}
	for _, tc := range []struct {
		name, caddyfile, line string
		texts                 []string
	}{
		{"a key too short", global("\t\t\t\treceiver_authorizer_key " + key[:60]), "Caddyfile:5", []string{"receiver_authorizer_key"}},
		{"two keys", global("\t\t\t\treceiver_authorizer_key " + key + "," + key), "Caddyfile:5", []string{"receiver_authorizer_key", "want one key"}},
		{"no key", global("\t\t\t\tclaim_every 3"), "Caddyfile:6", []string{"needs receiver_authorizer_key"}},
		{"claim_every 0", global("\t\t\t\treceiver_authorizer_key "+key, "\t\t\t\tclaim_every 0"), "Caddyfile:6", []string{"claim_every \"0\"", "positive number"}},
		{"claim_every words", global("\t\t\t\treceiver_authorizer_key "+key, "\t\t\t\tclaim_every often"), "Caddyfile:6", []string{"claim_every \"often\""}},
		{"claim_amount in dollars", global("\t\t\t\treceiver_authorizer_key "+key, "\t\t\t\tclaim_amount $5"), "Caddyfile:6", []string{"claim_amount \"$5\"", "raw token units"}},
		{"claim_after negative", global("\t\t\t\treceiver_authorizer_key "+key, "\t\t\t\tclaim_after -1s"), "Caddyfile:6", []string{"claim_after \"-1s\"", "positive duration"}},
		{"an unknown option", global("\t\t\t\treceiver_authorizer_key "+key, "\t\t\t\tclaim_when full"), "Caddyfile:6", []string{"unrecognized batch option 'claim_when'"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := adaptError(t, tc.caddyfile, tc.line, tc.texts...)
			if strings.Contains(err.Error(), key[:16]) {
				t.Errorf("the error %q repeats part of the key", err)
			}
		})
	}
}
