package chain

import (
	"context"
	"crypto/ecdsa"
	"encoding/json"
	"errors"
	"math/big"
	"math/rand/v2"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/ethereum/go-ethereum/common"
	"github.com/ethereum/go-ethereum/crypto"

	"github.com/x402-gateway/caddy-x402/chain/chaintest"
	"github.com/x402-gateway/caddy-x402/chain/contracts"
	"github.com/x402-gateway/caddy-x402/chain/journal"
	"github.com/x402-gateway/caddy-x402/x402"
)

func randHash(r *rand.Rand) common.Hash {
	var h common.Hash
	for i := range h {
		h[i] = byte(r.Uint32())
	}
	return h
}

func randUint128(r *rand.Rand) *big.Int {
	return new(big.Int).And(randUint256(r), maxUint128)
}

// The hand-rolled batch-settlement digests are go-ethereum's apitypes hashing of chaintest's typed data, the
// SDK's types (which chaintest's tests hold against the contract's typehashes and the SDK's own signatures).
func TestBatchDigestsMatchGoEthereumTypedDataHashing(t *testing.T) {
	r := rand.New(rand.NewPCG(40, 31))
	randChannel := func() contracts.ChannelConfig {
		return contracts.ChannelConfig{Payer: randAddress(r), PayerAuthorizer: randAddress(r), Receiver: randAddress(r),
			ReceiverAuthorizer: randAddress(r), Token: randAddress(r), WithdrawDelay: r.Uint64() & (1<<40 - 1), Salt: randHash(r)}
	}
	for i := range 200 {
		chainID := randChainID(r)
		domain := BatchDomainSeparator(chainID)
		ch := randChannel()
		if got, want := ChannelID(domain, ch), referenceDigest(t, chaintest.ChannelConfigTypedData(chainID, ch)); got != want {
			t.Fatalf("case %d: channel id %s, apitypes %s", i, got, want)
		}

		id, amount, nonce, claimed := randHash(r), randUint128(r), randUint256(r), randUint128(r)
		if got, want := VoucherDigest(domain, id, amount), referenceDigest(t, chaintest.VoucherTypedData(chainID, id, amount)); got != want {
			t.Fatalf("case %d: voucher digest %s, apitypes %s", i, got, want)
		}
		if got, want := RefundDigest(domain, id, nonce, amount), referenceDigest(t, chaintest.RefundTypedData(chainID, id, nonce, amount)); got != want {
			t.Fatalf("case %d: refund digest %s, apitypes %s", i, got, want)
		}
		entries := make([]ClaimEntry, r.IntN(4))
		claims := make([]contracts.VoucherClaim, len(entries))
		for j := range entries {
			cfg, max := randChannel(), randUint128(r)
			entries[j] = ClaimEntry{ChannelID: ChannelID(domain, cfg), MaxClaimableAmount: max, TotalClaimed: claimed}
			claims[j] = contracts.VoucherClaim{Voucher: contracts.Voucher{Channel: cfg, MaxClaimableAmount: max}, TotalClaimed: claimed}
		}
		if got, want := ClaimBatchDigest(domain, entries), referenceDigest(t, chaintest.ClaimBatchTypedData(chainID, claims)); got != want {
			t.Fatalf("case %d (%d claims): claim batch digest %s, apitypes %s", i, len(entries), got, want)
		}

		name, version, token := randString(r), randString(r), randAddress(r)
		from, value, after, before, n := randAddress(r), randUint256(r), randUint256(r), randUint256(r), randHash(r)
		td := chaintest.ReceiveAuthorizationTypedData(name, version, chainID, token, from, value, after, before, n)
		if got := ReceiveAuthorizationDigest(PermitDomainSeparator(name, version, chainID, token), from, contracts.ERC3009DepositCollectorAddress, value, after, before, n); got != referenceDigest(t, td) {
			t.Fatalf("case %d: receive authorization digest %s, apitypes %s", i, got, referenceDigest(t, td))
		}

		td = chaintest.DepositPermit2TypedData(chainID, token, value, nonce, before, id)
		if got := DepositPermit2Digest(chainID, token, value, nonce, before, id); got != referenceDigest(t, td) {
			t.Fatalf("case %d: deposit permit2 digest %s, apitypes %s", i, got, referenceDigest(t, td))
		}
	}
}

// sdkSigned is testdata/batch-sdk-signed.json: payments the public TypeScript SDK's batch-settlement client
// signed (e2e/interop/batch-vectors.mjs sign), kept so that this test checks them with no node.
type sdkSigned struct {
	Payments []struct {
		Name      string          `json:"name"`
		Payment   json.RawMessage `json:"payment"`
		ChannelID string          `json:"channelId"`
	} `json:"payments"`
}

// sdkChainID is the chain the vectors were signed for (eip155:72344, the dev chain).
var sdkChainID = big.NewInt(72344)

// readSDKSigned reads testdata/batch-sdk-signed.json.
func readSDKSigned(t *testing.T) sdkSigned {
	t.Helper()
	raw, err := os.ReadFile("testdata/batch-sdk-signed.json")
	if err != nil {
		t.Fatal(err)
	}
	var vectors sdkSigned
	if err := json.Unmarshal(raw, &vectors); err != nil {
		t.Fatal(err)
	}
	return vectors
}

func TestVouchersAndDepositsTheTypeScriptSDKSignedVerifyInGo(t *testing.T) {
	vectors := readSDKSigned(t)
	if len(vectors.Payments) < 5 {
		t.Fatalf("%d vectors, expected deposits of both methods, two vouchers and a refund", len(vectors.Payments))
	}
	for _, v := range vectors.Payments {
		t.Run(v.Name, func(t *testing.T) {
			p, err := x402.UnmarshalBatchPayment(v.Payment)
			if err != nil {
				t.Fatalf("the SDK's payment does not decode: %v", err)
			}
			checkSDKPayment(t, &p, v.ChannelID)
		})
	}
}

// checkSDKPayment checks a payment as the SDK's client signed it: its channel id is ours, its voucher passes
// CheckVoucher with the state the client assumed, its deposit authorization passes CheckDepositAuthorization.
func checkSDKPayment(t *testing.T, p *x402.BatchPayment, channelID string) {
	t.Helper()
	terms, err := NewBatchTerms(p.Accepted, sdkChainID, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	ch, err := ParseChannelConfig(*p.Payload.ChannelConfig)
	if err != nil {
		t.Fatal(err)
	}
	if got := ChannelID(terms.Domain, ch); got != common.HexToHash(channelID) {
		t.Fatalf("channel id %s, the SDK computed %s", got, channelID)
	}
	cumulative, _ := x402.ParseAmount(p.Payload.Voucher.MaxClaimableAmount)
	view := ChannelView{Balance: new(big.Int).Mul(cumulative, big.NewInt(10)), TotalClaimed: new(big.Int), ReadAt: time.Now()}
	view.Charged = new(big.Int).Sub(cumulative, terms.Price)
	switch p.Payload.Type {
	case x402.BatchRefund:
		view.Charged = cumulative
	case x402.BatchDeposit:
		view.Balance, _ = x402.ParseAmount(p.Payload.Deposit.Amount)
		now := sdkSigningTime(t, p)
		if r := terms.CheckDepositAuthorization(p, now); r != nil {
			t.Fatalf("deposit authorization refused: %v", r)
		}
	}
	av, err := terms.CheckVoucher(p, view, time.Now())
	if err != nil {
		t.Fatalf("voucher refused: %v", err)
	}
	if av.Charge.Cmp(new(big.Int).Sub(cumulative, view.Charged)) != 0 || av.ChannelID != ChannelID(terms.Domain, ch) {
		t.Fatalf("accepted voucher %+v", av)
	}
}

// sdkSigningTime is a moment the deposit's authorization was valid: its end minus the requirement's timeout,
// which is when the SDK signed it.
func sdkSigningTime(t *testing.T, p *x402.BatchPayment) time.Time {
	a := p.Payload.Deposit.Authorization
	end := ""
	if a.ERC3009Authorization != nil {
		end = a.ERC3009Authorization.ValidBefore
	} else {
		end = a.Permit2Authorization.Deadline
	}
	n, err := x402.ParseUint256(end)
	if err != nil {
		t.Fatal(err)
	}
	return time.Unix(n.Int64()-p.Accepted.MaxTimeoutSeconds, 0)
}

// batchFixture is a channel on the dev chain's id, with keys, and a voucher payment builder.
type batchFixture struct {
	payerKey, authKey *ecdsa.PrivateKey
	terms             *BatchTerms
	rq                x402.BatchRequirements
	cfg               x402.ChannelConfig
}

func newBatchFixture(t testing.TB) *batchFixture {
	t.Helper()
	payer, _ := crypto.HexToECDSA("5de4111afa1a4b94908f83103eb1f1706367c2e68ca870fc3fb9a804cdab365a")
	auth, _ := crypto.HexToECDSA("7c852118294e51e653712a81e05800f419141751be58f605c371e15141b007a6")
	rq := x402.BatchRequirements{Scheme: x402.SchemeBatchSettlement, Network: "eip155:72344", Amount: "1000",
		Asset: "0x5FbDB2315678afecb367f032d93F642f64180aa3", PayTo: "0x70997970C51812dc3A010C7d01b50e0d17dc79C8",
		MaxTimeoutSeconds: 300, Extra: x402.BatchExtra{ReceiverAuthorizer: "0x90F79bf6EB2c4f870365E785982E1f101E93b906", WithdrawDelay: 900}}
	terms, err := NewBatchTerms(rq, sdkChainID, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	return &batchFixture{payerKey: payer, authKey: auth, terms: terms, rq: rq, cfg: x402.ChannelConfig{
		Payer: crypto.PubkeyToAddress(payer.PublicKey).Hex(), PayerAuthorizer: crypto.PubkeyToAddress(auth.PublicKey).Hex(),
		Receiver: rq.PayTo, ReceiverAuthorizer: rq.Extra.ReceiverAuthorizer, Token: rq.Asset, WithdrawDelay: 900,
		Salt: "0x00000000000000000000000000000000000000000000000000000000000000a1"}}
}

// voucher signs a voucher payment of cfg for cumulative with key.
func (f *batchFixture) voucher(t testing.TB, cfg x402.ChannelConfig, key *ecdsa.PrivateKey, cumulative int64) *x402.BatchPayment {
	t.Helper()
	ch, err := ParseChannelConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	id := ChannelID(f.terms.Domain, ch)
	sig, err := SignVoucher(key, f.terms.Domain, id, big.NewInt(cumulative))
	if err != nil {
		t.Fatal(err)
	}
	return &x402.BatchPayment{X402Version: 2, Accepted: f.rq, Payload: x402.BatchPayload{Type: x402.BatchVoucher,
		ChannelConfig: &cfg, Voucher: &x402.BatchVoucherFields{ChannelID: id.Hex(), MaxClaimableAmount: big.NewInt(cumulative).String(), Signature: sig.hex()}}}
}

// The adversarial table of the issue, off chain: each voucher is refused with the SDK's reason, and the one
// that should pass passes.
func TestCheckVoucherRefusesWhatTheChannelDoesNotCover(t *testing.T) {
	f := newBatchFixture(t)
	now := time.Unix(1_800_000_000, 0)
	view := func(balance, claimed, charged int64) ChannelView {
		return ChannelView{Balance: big.NewInt(balance), TotalClaimed: big.NewInt(claimed), Charged: big.NewInt(charged), ReadAt: now}
	}
	otherReceiver := f.cfg
	otherReceiver.Receiver = "0x15d34AAf54267DB7D7c367839AAf71A00a2C6A65"
	otherAuthorizer := f.cfg
	otherAuthorizer.ReceiverAuthorizer = "0x15d34AAf54267DB7D7c367839AAf71A00a2C6A65"
	otherToken := f.cfg
	otherToken.Token = "0x15d34AAf54267DB7D7c367839AAf71A00a2C6A65"
	otherDelay := f.cfg
	otherDelay.WithdrawDelay = 1800
	payerSigns := f.cfg
	payerSigns.PayerAuthorizer = "0x0000000000000000000000000000000000000000"

	anotherChannel := f.voucher(t, f.cfg, f.authKey, 3000)
	other := f.cfg
	other.Salt = "0x00000000000000000000000000000000000000000000000000000000000000a2"
	anotherChannel.Payload.Voucher.ChannelID = f.voucher(t, other, f.authKey, 3000).Payload.Voucher.ChannelID
	anotherChain := f.voucher(t, f.cfg, f.authKey, 3000)
	anotherChain.Accepted.Network = "eip155:8453"
	wrongSigner := f.voucher(t, f.cfg, f.payerKey, 3000)
	forged := f.voucher(t, f.cfg, f.authKey, 3000)
	forged.Payload.Voucher.MaxClaimableAmount = "4000" // signed for 3000
	refund := f.voucher(t, f.cfg, f.authKey, 2000)
	refund.Payload.Type = x402.BatchRefund
	overflow := f.voucher(t, f.cfg, f.authKey, 3000)
	overflow.Payload.Voucher.MaxClaimableAmount = new(big.Int).Lsh(big.NewInt(1), 128).String()

	withdrawing := view(10_000, 0, 2000)
	withdrawing.WithdrawRequestedAt = now.Add(-899 * time.Second) // finalizable in 1 s, inside the claim margin
	withdrawingLater := withdrawing
	withdrawingLater.WithdrawRequestedAt = now // 15 minutes to claim
	partly := withdrawing
	partly.WithdrawAmount = big.NewInt(7000) // 3000 stay

	for _, tc := range []struct {
		name   string
		p      *x402.BatchPayment
		view   ChannelView
		reason string // "" passes
	}{
		{"the next voucher", f.voucher(t, f.cfg, f.authKey, 3000), view(10_000, 0, 2000), ""},
		{"a voucher below the last cumulative amount", f.voucher(t, f.cfg, f.authKey, 1000), view(10_000, 0, 2000), x402.ReasonBatchCumulativeAmountMismatch},
		{"the last voucher again (a replay)", f.voucher(t, f.cfg, f.authKey, 2000), view(10_000, 0, 2000), x402.ReasonBatchCumulativeAmountMismatch},
		{"a voucher skipping ahead", f.voucher(t, f.cfg, f.authKey, 5000), view(10_000, 0, 2000), x402.ReasonBatchCumulativeAmountMismatch},
		{"a voucher above the deposit", f.voucher(t, f.cfg, f.authKey, 3000), view(2500, 0, 2000), x402.ReasonBatchCumulativeExceedsBalance},
		{"a voucher at or below what was claimed", f.voucher(t, f.cfg, f.authKey, 3000), view(10_000, 3000, 2000), x402.ReasonBatchCumulativeBelowClaimed},
		{"a channel with no deposit", f.voucher(t, f.cfg, f.authKey, 3000), view(0, 0, 2000), x402.ReasonBatchChannelNotFound},
		{"a voucher for another channel", anotherChannel, view(10_000, 0, 2000), x402.ReasonBatchChannelIDMismatch},
		{"another network", anotherChain, view(10_000, 0, 2000), x402.ReasonBatchNetworkMismatch},
		{"another receiver", f.voucher(t, otherReceiver, f.authKey, 3000), view(10_000, 0, 2000), x402.ReasonBatchReceiverMismatch},
		{"another receiver authorizer", f.voucher(t, otherAuthorizer, f.authKey, 3000), view(10_000, 0, 2000), x402.ReasonBatchReceiverAuthorizerMismatch},
		{"another asset", f.voucher(t, otherToken, f.authKey, 3000), view(10_000, 0, 2000), x402.ReasonBatchTokenMismatch},
		{"another withdraw delay", f.voucher(t, otherDelay, f.authKey, 3000), view(10_000, 0, 2000), x402.ReasonBatchWithdrawDelayMismatch},
		{"signed by the payer, not the channel's authorizer", wrongSigner, view(10_000, 0, 2000), x402.ReasonBatchInvalidVoucherSignature},
		{"an amount other than the one signed", forged, view(10_000, 0, 2000), x402.ReasonBatchInvalidVoucherSignature},
		{"an amount beyond uint128", overflow, view(10_000, 0, 2000), x402.ReasonInvalidPayload},
		{"a channel naming no authorizer, signed by its payer", f.voucher(t, payerSigns, f.payerKey, 3000), view(10_000, 0, 2000), ""},
		{"a channel naming no authorizer, signed by another key", f.voucher(t, payerSigns, f.authKey, 3000), view(10_000, 0, 2000), x402.ReasonBatchInvalidVoucherSignature},
		{"a withdrawn channel (finalizable before a claim lands)", f.voucher(t, f.cfg, f.authKey, 3000), withdrawing, x402.ReasonBatchCumulativeExceedsBalance},
		{"a withdrawal pending, its delay still ahead", f.voucher(t, f.cfg, f.authKey, 3000), withdrawingLater, ""},
		{"a partial withdrawal leaving enough", f.voucher(t, f.cfg, f.authKey, 3000), partly, ""},
		{"a refund at the charged amount", refund, view(10_000, 0, 2000), ""},
		{"a refund above the charged amount", refund, view(10_000, 0, 1000), x402.ReasonBatchCumulativeAmountMismatch},
	} {
		t.Run(tc.name, func(t *testing.T) {
			av, err := f.terms.CheckVoucher(tc.p, tc.view, now)
			if tc.reason == "" {
				if err != nil {
					t.Fatalf("refused: %v", err)
				}
				if av.Cumulative.String() != tc.p.Payload.Voucher.MaxClaimableAmount {
					t.Fatalf("accepted cumulative %s, signed %s", av.Cumulative, tc.p.Payload.Voucher.MaxClaimableAmount)
				}
				return
			}
			var r *BatchRefusal
			if !errors.As(err, &r) || r.Reason != tc.reason {
				t.Fatalf("got %v, want a refusal %s", err, tc.reason)
			}
			if r.Message == "" {
				t.Fatal("a refusal without a message")
			}
		})
	}
}

// A channel naming no payer authorizer whose payer has code is refused off chain, whoever signed: its code
// judges the voucher when the claim runs (see TestCheckVoucherRefusesAVoucherTheChannelsContractPayerJudges).
func TestCheckVoucherRefusesAPayerWithCodeWithoutAPayerAuthorizer(t *testing.T) {
	f := newBatchFixture(t)
	cfg := f.cfg
	cfg.PayerAuthorizer = "0x0000000000000000000000000000000000000000"
	p := f.voucher(t, cfg, f.payerKey, 1000)
	_, err := f.terms.CheckVoucher(p, ChannelView{Balance: big.NewInt(5000), PayerHasCode: true, ReadAt: time.Now()}, time.Now())
	var r *BatchRefusal
	if !errors.As(err, &r) || r.Reason != x402.ReasonBatchInvalidVoucherSignature || !strings.Contains(r.Message, "payerAuthorizer") {
		t.Fatalf("got %v, want a refusal %s naming the payerAuthorizer", err, x402.ReasonBatchInvalidVoucherSignature)
	}
}

// BenchmarkCheckVoucher is the off-chain check of one voucher, which a voucher-paid request costs besides its
// journal write: compare with BenchmarkRecoverSigner, its signature check alone.
func BenchmarkCheckVoucher(b *testing.B) {
	f := newBatchFixture(b)
	p := f.voucher(b, f.cfg, f.authKey, 3000)
	now := time.Now()
	view := ChannelView{Balance: big.NewInt(10_000), TotalClaimed: new(big.Int), Charged: big.NewInt(2000), ReadAt: now}
	b.ReportAllocs()
	for b.Loop() {
		if _, err := f.terms.CheckVoucher(p, view, now); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkRecoverSignerOfAVoucher(b *testing.B) {
	f := newBatchFixture(b)
	p := f.voucher(b, f.cfg, f.authKey, 3000)
	sig, _ := ParseSignature(p.Payload.Voucher.Signature)
	digest := VoucherDigest(f.terms.Domain, common.HexToHash(p.Payload.Voucher.ChannelID), big.NewInt(3000))
	b.ReportAllocs()
	for b.Loop() {
		if _, err := RecoverSigner(digest, sig); err != nil {
			b.Fatal(err)
		}
	}
}

// sdkPayment is the named payment of testdata/batch-sdk-signed.json, decoded.
func sdkPayment(t *testing.T, name string) *x402.BatchPayment {
	t.Helper()
	for _, v := range readSDKSigned(t).Payments {
		if v.Name == name {
			p, err := x402.UnmarshalBatchPayment(v.Payment)
			if err != nil {
				t.Fatal(err)
			}
			return &p
		}
	}
	t.Fatalf("no vector %s", name)
	return nil
}

func TestCheckDepositAuthorizationRefusesWhatTheCollectorWouldNotTake(t *testing.T) {
	const other = "0x15d34AAf54267DB7D7c367839AAf71A00a2C6A65"
	for _, tc := range []struct {
		name, vector string
		edit         func(p *x402.BatchPayment)
		late         time.Duration // after the SDK signed it
		reason       string
	}{
		{"an ERC-3009 deposit as signed", "deposit-eip3009", func(*x402.BatchPayment) {}, 0, ""},
		{"a Permit2 deposit as signed", "deposit-permit2", func(*x402.BatchPayment) {}, 0, ""},
		{"an ERC-3009 deposit of another amount", "deposit-eip3009", func(p *x402.BatchPayment) { p.Payload.Deposit.Amount = "20000" }, 0, x402.ReasonBatchInvalidReceiveAuthorization},
		{"an ERC-3009 deposit with another salt (another nonce)", "deposit-eip3009", func(p *x402.BatchPayment) {
			p.Payload.Deposit.Authorization.ERC3009Authorization.Salt = "0x" + strings.Repeat("ab", 32)
		}, 0, x402.ReasonBatchInvalidReceiveAuthorization},
		{"an ERC-3009 deposit into another channel", "deposit-eip3009", func(p *x402.BatchPayment) { p.Payload.Voucher.ChannelID = "0x" + strings.Repeat("cd", 32) }, 0, x402.ReasonBatchInvalidReceiveAuthorization},
		{"an ERC-3009 deposit about to expire", "deposit-eip3009", func(*x402.BatchPayment) {}, 296 * time.Second, x402.ReasonBatchValidBefore},
		{"an ERC-3009 deposit not valid yet", "deposit-eip3009", func(p *x402.BatchPayment) {
			p.Payload.Deposit.Authorization.ERC3009Authorization.ValidAfter = "9999999999"
		}, 0, x402.ReasonBatchValidAfter},
		{"an ERC-3009 deposit with no token domain", "deposit-eip3009", func(p *x402.BatchPayment) { p.Accepted.Extra.Name = "" }, 0, x402.ReasonBatchMissingEIP712Domain},
		{"a permit2 requirement paid by ERC-3009", "deposit-eip3009", func(p *x402.BatchPayment) { p.Accepted.Extra.AssetTransferMethod = x402.TransferPermit2 }, 0, x402.ReasonBatchPermit2AuthorizationRequired},
		{"an eip3009 requirement paid by Permit2", "deposit-permit2", func(p *x402.BatchPayment) { p.Accepted.Extra.AssetTransferMethod = "" }, 0, x402.ReasonBatchERC3009AuthorizationRequired},
		{"a Permit2 deposit spent by another", "deposit-permit2", func(p *x402.BatchPayment) { p.Payload.Deposit.Authorization.Permit2Authorization.Spender = other }, 0, x402.ReasonBatchPermit2InvalidSpender},
		{"a Permit2 deposit from another", "deposit-permit2", func(p *x402.BatchPayment) { p.Payload.Deposit.Authorization.Permit2Authorization.From = other }, 0, x402.ReasonBatchPermit2InvalidSignature},
		{"a Permit2 deposit of another token", "deposit-permit2", func(p *x402.BatchPayment) {
			p.Payload.Deposit.Authorization.Permit2Authorization.Permitted.Token = other
		}, 0, x402.ReasonBatchTokenMismatch},
		{"a Permit2 deposit for less than the deposit", "deposit-permit2", func(p *x402.BatchPayment) { p.Payload.Deposit.Amount = "20000" }, 0, x402.ReasonBatchPermit2AmountMismatch},
		{"a Permit2 deposit witnessing another channel", "deposit-permit2", func(p *x402.BatchPayment) {
			p.Payload.Deposit.Authorization.Permit2Authorization.Witness.ChannelID = "0x" + strings.Repeat("cd", 32)
		}, 0, x402.ReasonBatchChannelIDMismatch},
		{"a Permit2 deposit about to expire", "deposit-permit2", func(*x402.BatchPayment) {}, 296 * time.Second, x402.ReasonBatchPermit2DeadlineExpired},
		{"a Permit2 deposit with another nonce", "deposit-permit2", func(p *x402.BatchPayment) { p.Payload.Deposit.Authorization.Permit2Authorization.Nonce = "7" }, 0, x402.ReasonBatchPermit2InvalidSignature},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := sdkPayment(t, tc.vector)
			now := sdkSigningTime(t, p).Add(tc.late)
			tc.edit(p)
			// The edits of accepted stand for the route's requirement: the terms are built from it.
			terms, err := NewBatchTerms(p.Accepted, sdkChainID, time.Minute)
			if err != nil {
				t.Fatal(err)
			}
			r := terms.CheckDepositAuthorization(p, now)
			switch {
			case tc.reason == "" && r != nil:
				t.Fatalf("refused: %v", r)
			case tc.reason != "" && (r == nil || r.Reason != tc.reason):
				t.Fatalf("got %v, want %s", r, tc.reason)
			}
		})
	}
}

// A voucher signed with v as 0 or 1 passes, and what a claim would carry is the contract's form, v 27 or 28.
func TestAnAcceptedVoucherCarriesItsSignatureAsTheContractRecoversIt(t *testing.T) {
	f := newBatchFixture(t)
	p := f.voucher(t, f.cfg, f.authKey, 3000)
	sig := p.Payload.Voucher.Signature
	v := sig[len(sig)-2:]
	p.Payload.Voucher.Signature = sig[:len(sig)-2] + map[string]string{"1b": "00", "1c": "01"}[v]
	av, err := f.terms.CheckVoucher(p, ChannelView{Balance: big.NewInt(10_000), Charged: big.NewInt(2000), ReadAt: time.Now()}, time.Now())
	if err != nil {
		t.Fatal(err)
	}
	if got := av.Signature.hex(); got != sig {
		t.Fatalf("accepted signature %s, want %s (v %s)", got, sig, v)
	}
}

// The channel a payment names, parsed once, is the contract's own: packed as it is into the escrow's calldata,
// the contract hashes it to the id ChannelID computes and the SDK signed for, and a claim row of it packs.
func TestAChannelParsedFromTheWireIsTheContractsChannel(t *testing.T) {
	c := chaintest.New(t, chaintest.WithChainID(sdkChainID.Uint64()))
	for _, name := range []string{"voucher-payer", "voucher-authorizer", "deposit-permit2"} {
		p := sdkPayment(t, name)
		ch, err := ParseChannelConfig(*p.Payload.ChannelConfig)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		if again, _ := ParseChannelConfig(*p.Payload.ChannelConfig); again != ch {
			t.Fatalf("%s: the same channel config parsed twice differs: %+v, %+v", name, ch, again)
		}
		data, err := contracts.PackBatchSettlement("getChannelId", ch)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		raw, err := c.Call(context.Background(), c.Deployer.Address, contracts.BatchSettlementAddress, data)
		if err != nil {
			t.Fatalf("%s: getChannelId: %v", name, err)
		}
		out, err := contracts.BatchSettlementABI.Unpack("getChannelId", raw)
		if err != nil {
			t.Fatal(err)
		}
		onChain, ours, sdk := common.Hash(out[0].([32]byte)), ChannelID(BatchDomainSeparator(c.ChainID), ch), common.HexToHash(p.Payload.Voucher.ChannelID)
		if onChain != ours || ours != sdk {
			t.Errorf("%s: the contract's channel id %s, ChannelID %s, the SDK's %s", name, onChain, ours, sdk)
		}
		claim := contracts.VoucherClaim{Voucher: contracts.Voucher{Channel: ch, MaxClaimableAmount: big.NewInt(3000)}, Signature: []byte{1}, TotalClaimed: big.NewInt(3000)}
		if _, err := contracts.PackClaim([]contracts.VoucherClaim{claim}); err != nil {
			t.Errorf("%s: a claim of the parsed channel does not pack: %v", name, err)
		}
	}
}

// A voucher's journal id, which a gate computes through the journal package (it imports no engine), is the one
// the engine first wrote: the escrow's canonical address and the "batch-voucher" slot, whatever the case of the
// channel id.
func TestBatchVoucherIDIsTheJournalsAndStaysAsFirstWritten(t *testing.T) {
	ch := common.HexToHash("0xABCDEF0000000000000000000000000000000000000000000000000000001234")
	cum := big.NewInt(12345)
	want := journal.PaymentID("eip155:8453", "batch-voucher", contracts.BatchSettlementAddress.Hex(), ch.Hex(), cum.String())
	if got := BatchVoucherID("eip155:8453", ch, cum); got != want {
		t.Fatalf("BatchVoucherID = %s, want %s as first written", got, want)
	}
	if got := journal.BatchVoucherID("eip155:8453", "0xABCDEF0000000000000000000000000000000000000000000000000000001234", "12345"); got != want {
		t.Fatalf("journal.BatchVoucherID of an upper-case channel id = %s, want %s", got, want)
	}
}

// A channel memo answers as ParseChannelConfig and ChannelID do, under each domain apart, for a configuration it
// remembers and one it does not, and a nil one (terms made outside an engine) the same; a configuration that does
// not parse is refused every time and never remembered; what it remembers stays within channelMemoSize. An
// engine's terms share their network's memo.
func TestAChannelMemoAnswersAsTheParseAndTheIdAndRemembersWithinItsBound(t *testing.T) {
	r := rand.New(rand.NewPCG(7, 11))
	addr := func() string { return common.BytesToAddress(randHash(r).Bytes()).Hex() }
	cfg := x402.ChannelConfig{Payer: addr(), Receiver: addr(), ReceiverAuthorizer: addr(), Token: addr(),
		PayerAuthorizer: "0x0000000000000000000000000000000000000000", WithdrawDelay: 3600, Salt: randHash(r).Hex()}
	memo := newChannelMemo()
	for _, domain := range []common.Hash{randHash(r), randHash(r)} {
		want, err := ParseChannelConfig(cfg)
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range []*channelMemo{memo, memo, nil} { // works it out, remembers, remembers nothing
			ch, id, err := m.of(domain, cfg)
			if err != nil || ch != want || id != ChannelID(domain, want) {
				t.Fatalf("of = %+v %s %v; want %+v %s", ch, id.Hex(), err, want, ChannelID(domain, want).Hex())
			}
		}
	}
	if len(memo.m) != 2 {
		t.Fatalf("the memo holds %d configurations, want the one configuration under each of two domains", len(memo.m))
	}
	bad := cfg
	bad.Token = "0x12"
	for _, m := range []*channelMemo{memo, memo, nil} {
		if _, _, err := m.of(common.Hash{1}, bad); err == nil || !strings.Contains(err.Error(), "channelConfig.token") {
			t.Fatalf("a configuration whose token is no address: %v, want it refused naming channelConfig.token", err)
		}
	}
	if len(memo.m) != 2 {
		t.Fatalf("the memo remembered a configuration that does not parse (%d entries)", len(memo.m))
	}
	for i := range channelMemoSize + 10 {
		c := cfg
		c.WithdrawDelay = int64(3600 + i)
		if _, _, err := memo.of(common.Hash{2}, c); err != nil {
			t.Fatal(err)
		}
		if len(memo.m) > channelMemoSize {
			t.Fatalf("the memo holds %d configurations, want at most %d", len(memo.m), channelMemoSize)
		}
	}
	n := &network{chainID: big.NewInt(84532), batch: &batchNetwork{margin: time.Minute, channels: memo, terms: map[x402.BatchRequirements]*BatchTerms{}}}
	rq := x402.BatchRequirements{Network: "eip155:84532", Amount: "1000", PayTo: addr(), Asset: addr()}
	rq.Extra.ReceiverAuthorizer = addr()
	terms, err := n.batchTerms(rq)
	if err != nil {
		t.Fatal(err)
	}
	if terms.channels != memo {
		t.Fatal("an engine's terms do not share their network's channel memo")
	}
}
