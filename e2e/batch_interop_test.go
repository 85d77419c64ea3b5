package e2e

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/rand"
	"encoding/json"
	"errors"
	"math/big"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/ethereum/go-ethereum/common"
	"github.com/ethereum/go-ethereum/common/hexutil"
	"github.com/ethereum/go-ethereum/crypto"

	"github.com/x402-gateway/caddy-x402/chain"
	"github.com/x402-gateway/caddy-x402/chain/contracts"
	"github.com/x402-gateway/caddy-x402/chain/devchain"
	"github.com/x402-gateway/caddy-x402/internal/needs"
	"github.com/x402-gateway/caddy-x402/x402"
)

// batchChainID is the chain the batch-settlement signatures of TestBatchSettlementSignaturesInteroperateWithTheTypeScriptSDK
// are for (the dev chain's id); no chain runs there: the signatures and the channel's terms are checked off chain
// on both sides.
var batchChainID = big.NewInt(72344)

// batchSpec is what batch-vectors.mjs signs with: the route's terms and the keys, fresh for each run.
type batchSpec struct {
	Network            string `json:"network"`
	Asset              string `json:"asset"`
	PayTo              string `json:"payTo"`
	ReceiverAuthorizer string `json:"receiverAuthorizer"`
	WithdrawDelay      int64  `json:"withdrawDelay"`
	Amount             string `json:"amount"`
	TokenName          string `json:"tokenName"`
	TokenVersion       string `json:"tokenVersion"`
	PayerKey           string `json:"payerKey"`
	VoucherKey         string `json:"voucherKey"`
	Salt               string `json:"salt"`
}

// runBatchVectors runs batch-vectors.mjs in mode with input on stdin (keys never go in arguments) and decodes its
// JSON output into out.
func runBatchVectors(t *testing.T, node, sdk, mode string, input, out any) {
	t.Helper()
	in, err := json.Marshal(input)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, node, "batch-vectors.mjs", mode)
	cmd.Dir, cmd.Env, cmd.Stdin = sdk, childEnv(t), bytes.NewReader(in)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		t.Fatalf("node batch-vectors.mjs %s: %v\nstderr:\n%s", mode, err, stderr.String())
	}
	if err := json.Unmarshal(stdout.Bytes(), out); err != nil {
		t.Fatalf("node batch-vectors.mjs %s printed %q: %v", mode, stdout.String(), err)
	}
}

func newKey(t *testing.T) *ecdsa.PrivateKey {
	t.Helper()
	k, err := crypto.GenerateKey()
	if err != nil {
		t.Fatal(err)
	}
	return k
}

func randomBytes32(t *testing.T) common.Hash {
	var h common.Hash
	if _, err := rand.Read(h[:]); err != nil {
		t.Fatal(err)
	}
	return h
}

// signHash signs digest with key as wallets do: 65 bytes, v of 27 or 28.
func signHash(t *testing.T, key *ecdsa.PrivateKey, digest common.Hash) string {
	t.Helper()
	sig, err := crypto.Sign(digest[:], key)
	if err != nil {
		t.Fatal(err)
	}
	sig[64] += 27
	return hexutil.Encode(sig)
}

// The public TypeScript SDK's batch-settlement client and our Go code sign and verify each other's vouchers
// and deposits: what the SDK's client signs passes Go's off-chain checks, and what Go signs passes the SDK
// facilitator's own verification (its signature and channel checks, over a stub chain that reports the
// channel's balance), while a voucher whose amount differs from what was signed fails on both sides.
func TestBatchSettlementSignaturesInteroperateWithTheTypeScriptSDK(t *testing.T) {
	npm := needs.Command(t, "npm", "apt-get install nodejs npm")
	node := needs.Command(t, "node", "apt-get install nodejs")
	sdk := installTypeScriptClient(t, npm)

	payer, voucherKey, authorizer := newKey(t), newKey(t), newKey(t)
	spec := batchSpec{
		Network: "eip155:72344", Asset: "0x5FbDB2315678afecb367f032d93F642f64180aa3",
		PayTo: crypto.PubkeyToAddress(newKey(t).PublicKey).Hex(), ReceiverAuthorizer: crypto.PubkeyToAddress(authorizer.PublicKey).Hex(),
		WithdrawDelay: 900, Amount: "1000", TokenName: "Stable Coin", TokenVersion: "1",
		PayerKey: hexutil.Encode(crypto.FromECDSA(payer)), VoucherKey: hexutil.Encode(crypto.FromECDSA(voucherKey)),
		Salt: randomBytes32(t).Hex(),
	}

	t.Run("the SDK signs, Go verifies", func(t *testing.T) {
		var signed struct {
			Payments []struct {
				Name      string          `json:"name"`
				Payment   json.RawMessage `json:"payment"`
				ChannelID string          `json:"channelId"`
			} `json:"payments"`
		}
		runBatchVectors(t, node, sdk, "sign", spec, &signed)
		var names []string
		for _, s := range signed.Payments {
			names = append(names, s.Name)
			p, err := x402.UnmarshalBatchPayment(s.Payment)
			if err != nil {
				t.Fatalf("%s: the SDK's payment does not decode: %v", s.Name, err)
			}
			terms, err := chain.NewBatchTerms(p.Accepted, batchChainID, time.Minute)
			if err != nil {
				t.Fatal(err)
			}
			ch, err := chain.ParseChannelConfig(*p.Payload.ChannelConfig)
			if err != nil {
				t.Fatal(err)
			}
			if id := chain.ChannelID(terms.Domain, ch); id != common.HexToHash(s.ChannelID) {
				t.Fatalf("%s: Go's channel id %s, the SDK's %s", s.Name, id.Hex(), s.ChannelID)
			}
			cumulative, _ := x402.ParseAmount(p.Payload.Voucher.MaxClaimableAmount)
			view := chain.ChannelView{Balance: big.NewInt(1_000_000), TotalClaimed: new(big.Int), Charged: new(big.Int).Sub(cumulative, terms.Price), ReadAt: time.Now()}
			switch p.Payload.Type {
			case x402.BatchRefund:
				view.Charged = cumulative
			case x402.BatchDeposit:
				if r := terms.CheckDepositAuthorization(&p, time.Now()); r != nil {
					t.Fatalf("%s: Go refuses the SDK's deposit authorization: %v", s.Name, r)
				}
			}
			if _, err := terms.CheckVoucher(&p, view, time.Now()); err != nil {
				t.Fatalf("%s: Go refuses the SDK's voucher: %v", s.Name, err)
			}
			// The same voucher claiming one unit more than it signed is not the payer's.
			p.Payload.Voucher.MaxClaimableAmount = new(big.Int).Add(cumulative, big.NewInt(1)).String()
			view.Charged = new(big.Int).Add(view.Charged, big.NewInt(1))
			var r *chain.BatchRefusal
			if _, err := terms.CheckVoucher(&p, view, time.Now()); !errors.As(err, &r) || r.Reason != x402.ReasonBatchInvalidVoucherSignature {
				t.Fatalf("%s: a voucher with its amount raised: %v, want %s", s.Name, err, x402.ReasonBatchInvalidVoucherSignature)
			}
		}
		for _, want := range []string{"deposit-eip3009", "deposit-permit2", "voucher-payer", "voucher-authorizer", "refund"} {
			if !strings.Contains(strings.Join(names, " "), want) {
				t.Errorf("the SDK signed %v, no %s", names, want)
			}
		}
	})

	t.Run("Go signs, the SDK verifies", func(t *testing.T) {
		rq := x402.BatchRequirements{Scheme: x402.SchemeBatchSettlement, Network: spec.Network, Amount: spec.Amount, Asset: spec.Asset,
			PayTo: spec.PayTo, MaxTimeoutSeconds: 300, Extra: x402.BatchExtra{ReceiverAuthorizer: spec.ReceiverAuthorizer,
				WithdrawDelay: spec.WithdrawDelay, Name: spec.TokenName, Version: spec.TokenVersion}}
		domain := chain.BatchDomainSeparator(batchChainID)
		channel := func(authorizer common.Address) x402.ChannelConfig {
			return x402.ChannelConfig{Payer: crypto.PubkeyToAddress(payer.PublicKey).Hex(), PayerAuthorizer: authorizer.Hex(),
				Receiver: spec.PayTo, ReceiverAuthorizer: spec.ReceiverAuthorizer, Token: spec.Asset, WithdrawDelay: spec.WithdrawDelay, Salt: spec.Salt}
		}
		voucher := func(cfg x402.ChannelConfig, key *ecdsa.PrivateKey, kind string, cumulative int64) x402.BatchPayment {
			ch, err := chain.ParseChannelConfig(cfg)
			if err != nil {
				t.Fatal(err)
			}
			id := chain.ChannelID(domain, ch)
			sig := signHash(t, key, chain.VoucherDigest(domain, id, big.NewInt(cumulative)))
			return x402.BatchPayment{X402Version: 2, Accepted: rq, Payload: x402.BatchPayload{Type: kind, ChannelConfig: &cfg,
				Voucher: &x402.BatchVoucherFields{ChannelID: id.Hex(), MaxClaimableAmount: big.NewInt(cumulative).String(), Signature: sig}}}
		}
		withAuthorizer := channel(crypto.PubkeyToAddress(voucherKey.PublicKey))
		payerSigns := channel(common.Address{})

		deposit := func(method string) x402.BatchPayment {
			p := voucher(withAuthorizer, voucherKey, x402.BatchDeposit, 1000)
			id := common.HexToHash(p.Payload.Voucher.ChannelID)
			amount, validBefore := big.NewInt(10_000), big.NewInt(time.Now().Unix()+300)
			from, token := crypto.PubkeyToAddress(payer.PublicKey), common.HexToAddress(spec.Asset)
			p.Payload.Deposit = &x402.BatchDepositFields{Amount: amount.String()}
			if method == x402.TransferPermit2 {
				p.Accepted.Extra.AssetTransferMethod = x402.TransferPermit2
				nonce := new(big.Int).SetBytes(randomBytes32(t).Bytes())
				p.Payload.Deposit.Authorization.Permit2Authorization = &x402.BatchPermit2Authorization{
					From: from.Hex(), Permitted: x402.TokenPermissions{Token: token.Hex(), Amount: amount.String()},
					Spender: contracts.Permit2DepositCollectorAddress.Hex(), Nonce: nonce.String(), Deadline: validBefore.String(),
					Witness:   x402.BatchPermit2Witness{ChannelID: id.Hex()},
					Signature: signHash(t, payer, chain.DepositPermit2Digest(batchChainID, token, amount, nonce, validBefore, id)),
				}
				return p
			}
			salt := randomBytes32(t)
			digest := chain.ReceiveAuthorizationDigest(chain.PermitDomainSeparator(spec.TokenName, spec.TokenVersion, batchChainID, token),
				from, contracts.ERC3009DepositCollectorAddress, amount, new(big.Int), validBefore, contracts.ERC3009DepositNonce(id, salt))
			p.Payload.Deposit.Authorization.ERC3009Authorization = &x402.BatchERC3009Authorization{
				ValidAfter: "0", ValidBefore: validBefore.String(), Salt: salt.Hex(), Signature: signHash(t, payer, digest)}
			return p
		}
		raised := voucher(withAuthorizer, voucherKey, x402.BatchVoucher, 3000)
		raised.Payload.Voucher.MaxClaimableAmount = "3001"
		badDeposit := deposit(x402.TransferEIP3009)
		badDeposit.Payload.Deposit.Authorization.ERC3009Authorization.ValidBefore = "1" + badDeposit.Payload.Deposit.Authorization.ERC3009Authorization.ValidBefore

		type item struct {
			Name         string                 `json:"name"`
			Payment      x402.BatchPayment      `json:"payment"`
			Requirements x402.BatchRequirements `json:"requirements"`
			Balance      string                 `json:"balance"`
			TotalClaimed string                 `json:"totalClaimed"`
		}
		items := []item{
			{Name: "voucher signed by the payer authorizer", Payment: voucher(withAuthorizer, voucherKey, x402.BatchVoucher, 3000)},
			{Name: "voucher signed by the payer (no authorizer)", Payment: voucher(payerSigns, payer, x402.BatchVoucher, 3000)},
			{Name: "refund", Payment: voucher(withAuthorizer, voucherKey, x402.BatchRefund, 3000)},
			{Name: "deposit eip3009", Payment: deposit(x402.TransferEIP3009), Balance: "0"},
			{Name: "deposit permit2", Payment: deposit(x402.TransferPermit2), Balance: "0"},
			{Name: "voucher with its amount raised", Payment: raised},
			{Name: "deposit with its validBefore changed", Payment: badDeposit, Balance: "0"},
		}
		want := map[string]string{
			"voucher with its amount raised":       x402.ReasonBatchInvalidVoucherSignature,
			"deposit with its validBefore changed": x402.ReasonBatchInvalidReceiveAuthorization,
		}
		for i := range items {
			items[i].Requirements = items[i].Payment.Accepted
			if items[i].Balance == "" {
				items[i].Balance = "10000"
			}
			items[i].TotalClaimed = "0"
			// Each payment goes to node as a client would send it: through our encoder and decoder.
			doc, err := json.Marshal(items[i].Payment)
			if err != nil {
				t.Fatal(err)
			}
			if _, err := x402.UnmarshalBatchPayment(doc); err != nil {
				t.Fatalf("%s: our own payment does not decode: %v", items[i].Name, err)
			}
		}
		var verdicts []struct {
			Name          string `json:"name"`
			IsValid       bool   `json:"isValid"`
			InvalidReason string `json:"invalidReason"`
		}
		runBatchVectors(t, node, sdk, "verify", items, &verdicts)
		if len(verdicts) != len(items) {
			t.Fatalf("%d verdicts for %d payments", len(verdicts), len(items))
		}
		for _, v := range verdicts {
			switch reason, bad := want[v.Name]; {
			case bad && (v.IsValid || v.InvalidReason != reason):
				t.Errorf("%s: the SDK says valid=%v %q, want %s", v.Name, v.IsValid, v.InvalidReason, reason)
			case !bad && !v.IsValid:
				t.Errorf("%s: the SDK refuses Go's signature: %s", v.Name, v.InvalidReason)
			}
		}
	})
}

// The SDK's batch-settlement facilitator verifies a deposit against a running dev chain: it reads the channel,
// the payer's token balance, a pending withdrawal and the refund nonce in one Multicall3 tryAggregate (at the
// canonical address, as on any network), then simulates the deposit through our escrow and collector. A payer
// the SDK's client signed for with the dev chain's funded key passes; a payer with no tokens is refused for its
// balance, which only a read that answered can say.
func TestTheSDKsBatchSettlementFacilitatorVerifiesADepositOnTheDevChain(t *testing.T) {
	npm := needs.Command(t, "npm", "apt-get install nodejs npm")
	node := needs.Command(t, "node", "apt-get install nodejs")
	sdk := installTypeScriptClient(t, npm)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	dev, err := devchain.Start(ctx, devchain.Config{Listen: "127.0.0.1:0"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := dev.Close(); err != nil {
			t.Errorf("closing the dev chain: %v", err)
		}
	})

	type item struct {
		Name         string          `json:"name"`
		Payment      json.RawMessage `json:"payment"`
		Requirements json.RawMessage `json:"requirements"`
		RPC          string          `json:"rpc"`
	}
	var items []item
	for _, payer := range []struct {
		name string
		key  *ecdsa.PrivateKey
	}{{"funded payer", devchain.PayerKey()}, {"payer without tokens", newKey(t)}} {
		spec := batchSpec{
			Network: dev.Network(), Asset: devchain.EIP3009TokenAddress.Hex(),
			PayTo: crypto.PubkeyToAddress(newKey(t).PublicKey).Hex(), ReceiverAuthorizer: crypto.PubkeyToAddress(newKey(t).PublicKey).Hex(),
			WithdrawDelay: 900, Amount: "1000", TokenName: contracts.USDCoinName, TokenVersion: contracts.USDCoinVersion,
			PayerKey: hexutil.Encode(crypto.FromECDSA(payer.key)), VoucherKey: hexutil.Encode(crypto.FromECDSA(newKey(t))),
			Salt: randomBytes32(t).Hex(),
		}
		var signed struct {
			Payments []struct {
				Name    string          `json:"name"`
				Payment json.RawMessage `json:"payment"`
			} `json:"payments"`
		}
		runBatchVectors(t, node, sdk, "sign", spec, &signed)
		for _, s := range signed.Payments {
			if s.Name != "deposit-eip3009" {
				continue
			}
			var p struct {
				Accepted json.RawMessage `json:"accepted"`
			}
			if err := json.Unmarshal(s.Payment, &p); err != nil {
				t.Fatal(err)
			}
			items = append(items, item{Name: payer.name, Payment: s.Payment, Requirements: p.Accepted, RPC: dev.RPCURL()})
		}
	}
	if len(items) != 2 {
		t.Fatalf("the SDK signed %d eip3009 deposits, want 2", len(items))
	}
	var verdicts []struct {
		Name          string `json:"name"`
		IsValid       bool   `json:"isValid"`
		InvalidReason string `json:"invalidReason"`
	}
	runBatchVectors(t, node, sdk, "verify", items, &verdicts)
	want := map[string]string{"funded payer": "", "payer without tokens": x402.ReasonBatchInsufficientBalance}
	if len(verdicts) != len(want) {
		t.Fatalf("%d verdicts, want %d", len(verdicts), len(want))
	}
	for _, v := range verdicts {
		if reason := want[v.Name]; v.IsValid != (reason == "") || v.InvalidReason != reason {
			t.Errorf("%s: the SDK's facilitator says valid=%v %q, want valid=%v %q", v.Name, v.IsValid, v.InvalidReason, reason == "", reason)
		}
	}
}
