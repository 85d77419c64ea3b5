package chain_test

import (
	"context"
	"crypto/ecdsa"
	"encoding/json"
	"math/big"
	"strings"
	"testing"
	"time"

	"github.com/ethereum/go-ethereum/common"
	"github.com/ethereum/go-ethereum/common/math"
	"github.com/ethereum/go-ethereum/crypto"
	"github.com/ethereum/go-ethereum/signer/core/apitypes"

	"github.com/x402-gateway/caddy-x402/chain"
	"github.com/x402-gateway/caddy-x402/chain/chaintest"
	"github.com/x402-gateway/caddy-x402/chain/contracts"
	"github.com/x402-gateway/caddy-x402/x402"
)

// rejection is one way the facilitator must refuse a payment: build signs the payment (changing the chain first
// where the path needs it, as a payer would), and Verify and Settle must both answer with the reason.
type rejection struct {
	name string
	// methods the path applies to; each gets a subtest of its own, named "<method>: <name>".
	methods []string
	build   func(fx *fixture, payer *chaintest.Account, method string) x402.VerifyRequest
	reason  string
	// reasonPermit2 is the permit2 payment's reason where it differs from reason.
	reasonPermit2 string
	// message is a part the refusal's message must contain.
	message string
	// noPayer: the payload names no payer the facilitator can read, so the answers name none.
	noPayer bool
	// unapproved: the payer has not approved Permit2 (every other payer has).
	unapproved bool
}

var (
	both        = []string{x402.TransferPermit2, x402.TransferERC2612}
	permit2Only = []string{x402.TransferPermit2}
	erc2612Only = []string{x402.TransferERC2612}
)

// expand gives every method of every rejection a case of its own.
func expand(rs []rejection) []rejection {
	var out []rejection
	for _, r := range rs {
		for _, m := range r.methods {
			c := r
			c.name, c.methods = m+": "+r.name, []string{m}
			if m == x402.TransferPermit2 && r.reasonPermit2 != "" {
				c.reason = r.reasonPermit2
			}
			out = append(out, c)
		}
	}
	return out
}

// Addresses that belong to nobody in the harness.
var (
	stranger = common.HexToAddress("0x5742a9e45742a9e45742a9e45742a9e45742a9e4")
	sink     = common.HexToAddress("0x51c051c051c051c051c051c051c051c051c051c0")
)

// TestRejectedPaymentsAreRefusedByVerifyAndSettleAndMoveNothing walks every rejection path of the verifier in
// the order of x402-wire-facts section 5, for both transfer methods, on one simulated chain: each case has a
// payer of its own, so what one case does to the chain cannot make another pass or fail.
func TestRejectedPaymentsAreRefusedByVerifyAndSettleAndMoveNothing(t *testing.T) {
	cases := expand(rejections())
	if len(cases) < 25 {
		t.Fatalf("%d rejection paths, want at least 25", len(cases))
	}
	fx := newFixture(t, fixtureOpts{
		chainOpts:      []chaintest.Option{chaintest.WithPayers(len(cases))},
		autoCommit:     -1, // nothing here may be mined: a broadcast shows up in the pending nonces
		receiptTimeout: 2 * time.Second,
	})
	runRejections(t, fx, cases)
}

// runRejections runs each case as a subtest with payer number i of the fixture's chain.
func runRejections(t *testing.T, fx *fixture, cases []rejection) {
	for i, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			sub := *fx
			sub.t = t
			if !tc.unapproved {
				sub.approvePermit2(fx.c.Payers[i])
			}
			assertRejected(t, &sub, fx.c.Payers[i], tc)
		})
	}
}

// TestRejectedPaymentsThatOnlyTheSimulationCatchesMoveNothing covers the last check: a payment that passes every
// static check and chain read but whose settlement call reverts. With these contracts that happens when the
// facilitator is configured with a permit domain the token does not have (version "2" for a version "1" token):
// the signature verifies against the configured domain, and the token refuses the permit.
func TestRejectedPaymentsThatOnlyTheSimulationCatchesMoveNothing(t *testing.T) {
	misconfigured := func(rq x402.PaymentRequirements) x402.PaymentRequirements {
		rq.Extra.Version = "2"
		return rq
	}
	cases := expand([]rejection{{
		name:    "an erc2612 permit the token refuses fails the simulation",
		methods: erc2612Only,
		build: func(fx *fixture, payer *chaintest.Account, method string) x402.VerifyRequest {
			return fx.erc2612(payer, misconfigured(fx.requirements(method)), chain.ERC2612Options{})
		},
		reason:  x402.ReasonSimulationFailed,
		message: "simulating the settlement call failed",
	}, {
		name:    "a permit2 payment whose gas-sponsoring permit the token refuses fails the simulation",
		methods: permit2Only,
		build: func(fx *fixture, payer *chaintest.Account, method string) x402.VerifyRequest {
			req := fx.permit2(payer, misconfigured(fx.requirements(method)), chain.Permit2Options{})
			if err := chain.AddGasSponsoring(&req.PaymentPayload, payer.Key, fx.c.ChainID, "", "", fx.c.TokenNonce(payer.Address)); err != nil {
				fx.t.Fatal(err)
			}
			return req
		},
		reason:     x402.ReasonPermit2SimulationFailed,
		message:    "simulating the settlement call failed",
		unapproved: true,
	}})
	fx := newFixture(t, fixtureOpts{
		chainOpts:      []chaintest.Option{chaintest.WithPayers(len(cases))},
		autoCommit:     -1,
		receiptTimeout: 2 * time.Second,
		tune:           func(_ *fixture, nc *chain.NetworkConfig) { nc.Assets[0].Version = "2" },
	})
	runRejections(t, fx, cases)
}

// TestARejectedPaymentReusingTheNonceOfASettledOneIsNotAnsweredWithThatSettlement: a payer who signs a second,
// different payment with the nonce of one already settled (to another seller, or for more) must be refused, not
// handed the first payment's transaction as if this one had settled.
func TestARejectedPaymentReusingTheNonceOfASettledOneIsNotAnsweredWithThatSettlement(t *testing.T) {
	for _, method := range []string{x402.TransferPermit2, x402.TransferERC2612} {
		t.Run(method, func(t *testing.T) {
			fx := newFixture(t, fixtureOpts{})
			payer := fx.c.Payers[0]
			fx.approvePermit2(payer)
			rq := fx.requirements(method)
			var first, second x402.VerifyRequest
			if method == x402.TransferPermit2 {
				nonce := chaintest.RandomNonce()
				first = fx.permit2(payer, rq, chain.Permit2Options{Nonce: nonce})
				// The same Permit2 nonce, another seller: a different signed payment.
				elsewhere := rq
				elsewhere.PayTo = stranger.Hex()
				second = fx.permit2(payer, elsewhere, chain.Permit2Options{Nonce: nonce})
			} else {
				nonce := fx.c.TokenNonce(payer.Address)
				first = fx.erc2612(payer, rq, chain.ERC2612Options{TokenNonce: nonce})
				// The same permit nonce, another spender wallet: a different signed payment.
				second = fx.erc2612(payer, rq, chain.ERC2612Options{TokenNonce: nonce, Spender: fx.c.Wallets[1].Address})
			}
			if s := fx.settle(first); !s.Success {
				t.Fatalf("settling the first payment = %+v", s)
			}
			payerBefore, strangerBefore := fx.c.TokenBalance(payer.Address), fx.c.TokenBalance(stranger)
			want := x402.ReasonNonceAlreadyUsed
			if method == x402.TransferPermit2 {
				want = x402.ReasonPermit2InvalidNonce
			}
			if v := fx.verify(second); v.IsValid || v.InvalidReason != want {
				t.Fatalf("verify of the second payment = %+v, want %s", v, want)
			}
			if s := fx.settle(second); s.Success || s.ErrorReason != want || s.Transaction != "" {
				t.Fatalf("settle of the second payment = %+v, want %s with no transaction", s, want)
			}
			if fx.c.TokenBalance(payer.Address).Cmp(payerBefore) != 0 || fx.c.TokenBalance(stranger).Cmp(strangerBefore) != 0 {
				t.Fatal("tokens moved for the second payment")
			}
		})
	}
}

// assertRejected builds the case's payment, then checks that Verify and Settle both refuse it with the case's
// reason, that Settle sent nothing, and that no token moved.
func assertRejected(t *testing.T, fx *fixture, payer *chaintest.Account, tc rejection) {
	req := tc.build(fx, payer, tc.methods[0])
	payerBefore, sellerBefore := fx.c.TokenBalance(payer.Address), fx.c.TokenBalance(fx.payTo)
	sentBefore := fx.sentByWallets()

	v := fx.verify(req)
	if v.IsValid || v.InvalidReason != tc.reason {
		t.Fatalf("verify = valid %v, reason %q (%s); want reason %q", v.IsValid, v.InvalidReason, v.InvalidMessage, tc.reason)
	}
	if v.InvalidMessage == "" || !strings.Contains(v.InvalidMessage, tc.message) {
		t.Fatalf("verify message = %q, want a message containing %q", v.InvalidMessage, tc.message)
	}
	wantPayer := payer.Address.Hex()
	if tc.noPayer {
		wantPayer = ""
	}
	if v.Payer != wantPayer {
		t.Fatalf("verify payer = %q, want %q", v.Payer, wantPayer)
	}
	t.Logf("%s: %s", v.InvalidReason, v.InvalidMessage)

	s := fx.settle(req)
	if s.Success || s.ErrorReason != tc.reason || s.ErrorMessage == "" {
		t.Fatalf("settle = success %v, reason %q (%s); want reason %q", s.Success, s.ErrorReason, s.ErrorMessage, tc.reason)
	}
	if s.Transaction != "" {
		t.Fatalf("settle answered transaction %q for a refused payment, want none", s.Transaction)
	}
	if s.Payer != wantPayer || s.Network != req.PaymentRequirements.Network {
		t.Fatalf("settle names payer %q on %q, want %q on %q", s.Payer, s.Network, wantPayer, req.PaymentRequirements.Network)
	}

	for i, n := range fx.sentByWallets() {
		if n != sentBefore[i] {
			t.Fatalf("wallet %s sent %d transactions (pending included) for a refused payment", fx.c.Wallets[i].Address.Hex(), n-sentBefore[i])
		}
	}
	if got := fx.c.TokenBalance(payer.Address); got.Cmp(payerBefore) != 0 {
		t.Fatalf("payer balance went from %s to %s", payerBefore, got)
	}
	if got := fx.c.TokenBalance(fx.payTo); got.Cmp(sellerBefore) != 0 {
		t.Fatalf("seller balance went from %s to %s", sellerBefore, got)
	}
}

// sentByWallets is how many transactions each settlement wallet has sent, counting those still in the pool.
func (fx *fixture) sentByWallets() []uint64 {
	fx.t.Helper()
	out := make([]uint64, len(fx.c.Wallets))
	for i, w := range fx.c.Wallets {
		n, err := fx.c.Client.PendingNonceAt(context.Background(), w.Address)
		if err != nil {
			fx.t.Fatalf("reading the pending nonce of %s: %v", w.Address.Hex(), err)
		}
		out[i] = n
	}
	return out
}

// pay signs a payment of payer for rq by rq's method, the way a public client would.
func (fx *fixture) pay(payer *chaintest.Account, rq x402.PaymentRequirements) x402.VerifyRequest {
	fx.t.Helper()
	if rq.Extra.AssetTransferMethod == x402.TransferPermit2 {
		return fx.permit2(payer, rq, chain.Permit2Options{})
	}
	return fx.erc2612(payer, rq, chain.ERC2612Options{})
}

// digest is the EIP-712 digest the payload's signature must sign, recomputed from the payload as it stands.
func (fx *fixture) digest(req x402.VerifyRequest) common.Hash {
	fx.t.Helper()
	if a := req.PaymentPayload.Payload.Permit2Authorization; a != nil {
		t, _, err := chain.Permit2TransferFromPayload(a)
		if err != nil {
			fx.t.Fatal(err)
		}
		return chain.Permit2Digest(chain.Permit2DomainSeparator(fx.c.ChainID, contracts.Permit2Address), t)
	}
	p, err := chain.PermitFromAuthorization(req.PaymentPayload.Payload.Authorization)
	if err != nil {
		fx.t.Fatal(err)
	}
	return chain.PermitDigest(chain.PermitDomainSeparator(contracts.StableCoinName, contracts.StableCoinVersion, fx.c.ChainID, fx.c.Token), p)
}

// resign signs the payload as it stands with key, as a payer who edits a payment before sending it would.
func (fx *fixture) resign(req *x402.VerifyRequest, key *ecdsa.PrivateKey) {
	fx.t.Helper()
	sig, err := chain.SignDigest(key, fx.digest(*req))
	if err != nil {
		fx.t.Fatal(err)
	}
	req.PaymentPayload.Payload.Signature = sig.String()
}

// highS replaces the payload's signature by its malleated twin (n - s, v flipped), which recovers the same
// key in plain ecrecover; the test fails if it does not, as the case would then prove nothing.
func (fx *fixture) highS(req *x402.VerifyRequest, payer *chaintest.Account) {
	fx.t.Helper()
	sig := common.FromHex(req.PaymentPayload.Payload.Signature)
	s := new(big.Int).SetBytes(sig[32:64])
	twin := make([]byte, 65)
	copy(twin, sig[:32])
	new(big.Int).Sub(crypto.S256().Params().N, s).FillBytes(twin[32:64])
	twin[64] = 27 + (28 - sig[64]) // 27 <-> 28
	recID := append(append([]byte{}, twin[:64]...), twin[64]-27)
	d := fx.digest(*req)
	pub, err := crypto.SigToPub(d[:], recID)
	if err != nil || crypto.PubkeyToAddress(*pub) != payer.Address {
		fx.t.Fatalf("the high-s twin does not recover the payer (%v): the case would prove nothing", err)
	}
	req.PaymentPayload.Payload.Signature = "0x" + common.Bytes2Hex(twin)
}

// editRequirements changes the requirements and the payload's echo of them alike.
func editRequirements(req *x402.VerifyRequest, edit func(*x402.PaymentRequirements)) {
	edit(&req.PaymentRequirements)
	edit(&req.PaymentPayload.Accepted)
}

// sponsorTerms are the fields of an eip2612GasSponsoring permit, signed as given by signer.
type sponsorTerms struct {
	signer                  *chaintest.Account
	from, asset, spender    common.Address
	amount, nonce, deadline *big.Int
}

// sponsor adds the gas-sponsoring extension to a permit2 payment: edit changes the terms a public client
// signs before they are signed, editInfo the extension after.
func (fx *fixture) sponsor(req *x402.VerifyRequest, payer *chaintest.Account, edit func(*sponsorTerms), editInfo func(*x402.EIP2612GasSponsoringInfo)) {
	fx.t.Helper()
	deadline, _ := new(big.Int).SetString(req.PaymentPayload.Payload.Permit2Authorization.Deadline, 10)
	st := sponsorTerms{
		signer: payer, from: payer.Address, asset: fx.c.Token, spender: contracts.Permit2Address,
		amount: big.NewInt(price), nonce: fx.c.TokenNonce(payer.Address), deadline: deadline,
	}
	if edit != nil {
		edit(&st)
	}
	permit := chain.Permit{Owner: st.from, Spender: st.spender, Value: st.amount, Nonce: st.nonce, Deadline: st.deadline}
	sig, err := chain.SignDigest(st.signer.Key, chain.PermitDigest(chain.PermitDomainSeparator(contracts.StableCoinName, contracts.StableCoinVersion, fx.c.ChainID, st.asset), permit))
	if err != nil {
		fx.t.Fatal(err)
	}
	info := x402.EIP2612GasSponsoringInfo{
		From: st.from.Hex(), Asset: st.asset.Hex(), Spender: st.spender.Hex(), Amount: st.amount.String(),
		Nonce: st.nonce.String(), Deadline: st.deadline.String(), Signature: sig.String(), Version: "1",
	}
	if editInfo != nil {
		editInfo(&info)
	}
	raw, err := json.Marshal(map[string]any{"info": info})
	if err != nil {
		fx.t.Fatal(err)
	}
	req.PaymentPayload.Extensions = map[string]json.RawMessage{x402.ExtensionEIP2612GasSponsoring: raw}
}

// eip3009LookAlike is what a client that does not know erc2612 sends for an erc2612 requirement: a signed
// EIP-3009 TransferWithAuthorization to payTo in the erc2612 payload's JSON shape.
func (fx *fixture) eip3009LookAlike(payer *chaintest.Account, rq x402.PaymentRequirements) x402.VerifyRequest {
	fx.t.Helper()
	nonce := common.BigToHash(chaintest.RandomNonce())
	validBefore := big.NewInt(int64(fx.c.HeadTime()) + rq.MaxTimeoutSeconds)
	td := apitypes.TypedData{
		Types: apitypes.Types{
			"EIP712Domain": {
				{Name: "name", Type: "string"}, {Name: "version", Type: "string"},
				{Name: "chainId", Type: "uint256"}, {Name: "verifyingContract", Type: "address"},
			},
			"TransferWithAuthorization": {
				{Name: "from", Type: "address"}, {Name: "to", Type: "address"}, {Name: "value", Type: "uint256"},
				{Name: "validAfter", Type: "uint256"}, {Name: "validBefore", Type: "uint256"}, {Name: "nonce", Type: "bytes32"},
			},
		},
		PrimaryType: "TransferWithAuthorization",
		Domain: apitypes.TypedDataDomain{
			Name: contracts.StableCoinName, Version: contracts.StableCoinVersion,
			ChainId: (*math.HexOrDecimal256)(fx.c.ChainID), VerifyingContract: fx.c.Token.Hex(),
		},
		Message: apitypes.TypedDataMessage{
			"from": payer.Address.Hex(), "to": fx.payTo.Hex(), "value": rq.Amount,
			"validAfter": "0", "validBefore": validBefore.String(), "nonce": nonce.Hex(),
		},
	}
	return x402.VerifyRequest{X402Version: 2, PaymentRequirements: rq, PaymentPayload: x402.PaymentPayload{
		X402Version: 2, Accepted: rq,
		Payload: x402.ExactEVMPayload{
			Signature: "0x" + common.Bytes2Hex(fx.c.SignTypedData(payer, td)),
			Authorization: &x402.EIP2612Authorization{
				From: payer.Address.Hex(), To: fx.payTo.Hex(), Value: rq.Amount,
				ValidAfter: "0", ValidBefore: validBefore.String(), Nonce: nonce.Hex(),
			},
		},
	}}
}

// headPlus is chain time plus d seconds.
func (fx *fixture) headPlus(d int64) *big.Int { return big.NewInt(int64(fx.c.HeadTime()) + d) }

// transact sends a transaction of from and seals it, failing the test if it reverts.
func (fx *fixture) transact(from *chaintest.Account, to common.Address, data []byte, err error) {
	fx.t.Helper()
	if err != nil {
		fx.t.Fatal(err)
	}
	if _, err := fx.c.Transact(context.Background(), from, to, data); err != nil {
		fx.t.Fatal(err)
	}
}

// signed signs a valid payment and then edits the request as it would travel.
func signed(edit func(fx *fixture, req *x402.VerifyRequest)) func(*fixture, *chaintest.Account, string) x402.VerifyRequest {
	return func(fx *fixture, payer *chaintest.Account, method string) x402.VerifyRequest {
		req := fx.pay(payer, fx.requirements(method))
		edit(fx, &req)
		return req
	}
}

// signedUnder signs a valid payment and then changes the requirements and their echo alike.
func signedUnder(edit func(*x402.PaymentRequirements)) func(*fixture, *chaintest.Account, string) x402.VerifyRequest {
	return signed(func(_ *fixture, req *x402.VerifyRequest) { editRequirements(req, edit) })
}

// signedFor signs a payment for requirements edited, and presents it with the requirements unchanged.
func signedFor(edit func(*x402.PaymentRequirements)) func(*fixture, *chaintest.Account, string) x402.VerifyRequest {
	return func(fx *fixture, payer *chaintest.Account, method string) x402.VerifyRequest {
		rq := fx.requirements(method)
		other := rq
		edit(&other)
		req := fx.pay(payer, other)
		req.PaymentRequirements, req.PaymentPayload.Accepted = rq, rq
		return req
	}
}

// signedWith signs a payment with the given options (the zero value of the other method's options is unused).
func signedWith(p2 func(fx *fixture) chain.Permit2Options, e2612 func(fx *fixture) chain.ERC2612Options) func(*fixture, *chaintest.Account, string) x402.VerifyRequest {
	return func(fx *fixture, payer *chaintest.Account, method string) x402.VerifyRequest {
		rq := fx.requirements(method)
		if method == x402.TransferPermit2 {
			return fx.permit2(payer, rq, p2(fx))
		}
		return fx.erc2612(payer, rq, e2612(fx))
	}
}

// deadline signs with the given deadline for either method.
func deadline(d func(fx *fixture) *big.Int) func(*fixture, *chaintest.Account, string) x402.VerifyRequest {
	return signedWith(
		func(fx *fixture) chain.Permit2Options { return chain.Permit2Options{Deadline: d(fx)} },
		func(fx *fixture) chain.ERC2612Options { return chain.ERC2612Options{Deadline: d(fx)} })
}

// sponsored signs a permit2 payment of a payer without Permit2 allowance and adds a gas-sponsoring permit.
func sponsored(edit func(fx *fixture, st *sponsorTerms), editInfo func(*x402.EIP2612GasSponsoringInfo)) func(*fixture, *chaintest.Account, string) x402.VerifyRequest {
	return func(fx *fixture, payer *chaintest.Account, method string) x402.VerifyRequest {
		req := fx.pay(payer, fx.requirements(method))
		fx.sponsor(&req, payer, func(st *sponsorTerms) {
			if edit != nil {
				edit(fx, st)
			}
		}, editInfo)
		return req
	}
}

// other is a key that is not the payer's.
var other = chaintest.DeriveAccount("reject-other", 0)

// rejections lists the rejection paths in the verifier's order (x402-wire-facts section 5).
func rejections() []rejection {
	return []rejection{
		// Version.
		{
			name: "an unsupported x402Version is refused", methods: both, reason: x402.ReasonInvalidX402Version, message: "not supported",
			build: signed(func(_ *fixture, req *x402.VerifyRequest) { req.X402Version, req.PaymentPayload.X402Version = 3, 3 }),
		}, {
			name: "a payload whose x402Version differs from the request's is refused", methods: both, reason: x402.ReasonInvalidX402Version,
			message: "paymentPayload.x402Version",
			build:   signed(func(_ *fixture, req *x402.VerifyRequest) { req.PaymentPayload.X402Version = 1 }),
		}, {
			name: "a permit2 payment under x402Version 1 is refused", methods: permit2Only, reason: x402.ReasonInvalidX402Version,
			message: "need x402Version 2",
			build:   signed(func(_ *fixture, req *x402.VerifyRequest) { req.X402Version, req.PaymentPayload.X402Version = 1, 1 }),
		},

		// Scheme.
		{
			name: "a scheme other than exact and upto is unsupported", methods: both, reason: x402.ReasonUnsupportedScheme, message: `"stream"`,
			build: signedUnder(func(rq *x402.PaymentRequirements) { rq.Scheme = "stream" }),
		}, {
			name: "a payment for another scheme than the requirements' is refused", methods: both, reason: x402.ReasonInvalidScheme,
			message: "the payment is for scheme",
			build:   signed(func(_ *fixture, req *x402.VerifyRequest) { req.PaymentPayload.Accepted.Scheme = "upto" }),
		},

		// Network.
		{
			name: "a network this facilitator does not serve is refused", methods: both, reason: x402.ReasonInvalidNetwork, message: "eip155:1",
			build: signedUnder(func(rq *x402.PaymentRequirements) { rq.Network = "eip155:1" }),
		}, {
			name: "a payment for another network than the requirements' is refused", methods: both, reason: x402.ReasonInvalidNetwork,
			message: "the payment is for network",
			build:   signed(func(_ *fixture, req *x402.VerifyRequest) { req.PaymentPayload.Accepted.Network = "eip155:1" }),
		},

		// Requirements.
		{
			name: "an asset the network does not accept is refused", methods: both, reason: x402.ReasonInvalidPaymentRequirements,
			message: "not accepted",
			build: func(fx *fixture, payer *chaintest.Account, method string) x402.VerifyRequest {
				rq := fx.requirements(method)
				rq.Asset = stranger.Hex()
				return fx.pay(payer, rq)
			},
		}, {
			name: "a payTo that is no address is refused", methods: both, reason: x402.ReasonInvalidPaymentRequirements, message: "payTo",
			build: signedUnder(func(rq *x402.PaymentRequirements) { rq.PayTo = "0x5e11e7" }),
		}, {
			name: "a zero payTo is refused before a permit is spent on it", methods: both, reason: x402.ReasonInvalidPaymentRequirements, message: "zero address",
			build: signedUnder(func(rq *x402.PaymentRequirements) { rq.PayTo = "0x0000000000000000000000000000000000000000" }),
		}, {
			name: "a zero amount is refused", methods: both, reason: x402.ReasonInvalidPaymentRequirements, message: "positive",
			build: signedUnder(func(rq *x402.PaymentRequirements) { rq.Amount = "0" }),
		}, {
			name: "a decimal-point amount is refused", methods: both, reason: x402.ReasonInvalidPaymentRequirements, message: `"0.01"`,
			build: signedUnder(func(rq *x402.PaymentRequirements) { rq.Amount = "0.01" }),
		}, {
			name: "an unknown assetTransferMethod is refused", methods: both, reason: x402.ReasonInvalidPaymentRequirements, message: `"upto"`,
			build: signedUnder(func(rq *x402.PaymentRequirements) { rq.Extra.AssetTransferMethod = "upto" }),
		},

		// Payload shape.
		{
			name: "a payload without its authorization is refused, naming no payer", methods: both, reason: x402.ReasonInvalidPayload,
			message: "is missing", noPayer: true,
			build: signed(func(_ *fixture, req *x402.VerifyRequest) {
				req.PaymentPayload.Payload.Authorization, req.PaymentPayload.Payload.Permit2Authorization = nil, nil
			}),
		}, {
			name: "the other method's payload is refused", methods: both, reason: x402.ReasonInvalidPayload, message: "but the payload carries",
			build: func(fx *fixture, payer *chaintest.Account, method string) x402.VerifyRequest {
				otherMethod := x402.TransferERC2612
				if method == x402.TransferERC2612 {
					otherMethod = x402.TransferPermit2
				}
				req := fx.pay(payer, fx.requirements(otherMethod))
				rq := fx.requirements(method)
				req.PaymentRequirements, req.PaymentPayload.Accepted = rq, rq
				return req
			},
		}, {
			name: "a from that is no address is refused, naming no payer", methods: both, reason: x402.ReasonInvalidPayload, message: ".from",
			noPayer: true,
			build: signed(func(_ *fixture, req *x402.VerifyRequest) {
				bad := "0x" + strings.Repeat("zz", 20)
				if a := req.PaymentPayload.Payload.Authorization; a != nil {
					a.From = bad
				} else {
					req.PaymentPayload.Payload.Permit2Authorization.From = bad
				}
			}),
		}, {
			name: "an authorization.to one digit short is refused", methods: erc2612Only, reason: x402.ReasonInvalidPayload, message: "authorization.to",
			build: signed(func(_ *fixture, req *x402.VerifyRequest) {
				a := req.PaymentPayload.Payload.Authorization
				a.To = a.To[:41]
			}),
		}, {
			name: "a permitted.token that is no address is refused", methods: permit2Only, reason: x402.ReasonInvalidPayload,
			message: "permit2Authorization.permitted.token",
			build: signed(func(_ *fixture, req *x402.VerifyRequest) {
				req.PaymentPayload.Payload.Permit2Authorization.Permitted.Token = "USDS"
			}),
		}, {
			name: "a hexadecimal value is refused", methods: erc2612Only, reason: x402.ReasonInvalidPayload, message: "authorization.value",
			build: signed(func(_ *fixture, req *x402.VerifyRequest) { req.PaymentPayload.Payload.Authorization.Value = "0x2710" }),
		}, {
			name: "a deadline in exponent notation is refused", methods: permit2Only, reason: x402.ReasonInvalidPayload,
			message: "permit2Authorization.deadline",
			build: signed(func(_ *fixture, req *x402.VerifyRequest) {
				req.PaymentPayload.Payload.Permit2Authorization.Deadline = "2e9"
			}),
		}, {
			name: "a 64-byte signature is refused", methods: erc2612Only, reason: x402.ReasonInvalidPayload, message: "65 bytes",
			build: signed(func(_ *fixture, req *x402.VerifyRequest) {
				req.PaymentPayload.Payload.Signature = req.PaymentPayload.Payload.Signature[:2+128]
			}),
		}, {
			// Not 65 bytes, it may be a contract wallet's: the chain says the payer has no code.
			name: "a 64-byte signature of a payer that is no contract wallet is refused", methods: permit2Only,
			reason: x402.ReasonPermit2InvalidSignature, message: "has no code",
			build: signed(func(_ *fixture, req *x402.VerifyRequest) {
				req.PaymentPayload.Payload.Signature = req.PaymentPayload.Payload.Signature[:2+128]
			}),
		}, {
			name: "an EIP-3009 transferWithAuthorization look-alike is refused saying an EIP-2612 permit is expected", methods: erc2612Only,
			reason: x402.ReasonInvalidPayload, message: "EIP-2612 permit whose spender is one of the facilitator's settlement wallets",
			build: func(fx *fixture, payer *chaintest.Account, method string) x402.VerifyRequest {
				return fx.eip3009LookAlike(payer, fx.requirements(method))
			},
		},

		// Recipient and spender.
		{
			name: "a witness paying someone other than payTo is refused", methods: permit2Only, reason: x402.ReasonPermit2RecipientMismatch,
			message: "witness.to",
			build:   signedFor(func(rq *x402.PaymentRequirements) { rq.PayTo = stranger.Hex() }),
		}, {
			name: "a permit whose spender is not a settlement wallet is refused", methods: erc2612Only, reason: x402.ReasonRecipientMismatch,
			message: "settlement wallets",
			build:   signedWith(nil, func(*fixture) chain.ERC2612Options { return chain.ERC2612Options{Spender: stranger} }),
		}, {
			name: "a Permit2 spender other than the x402 proxy is refused", methods: permit2Only, reason: x402.ReasonPermit2InvalidSpender,
			message: contracts.ProxyAddress.Hex(),
			build:   signedWith(func(*fixture) chain.Permit2Options { return chain.Permit2Options{Proxy: stranger} }, nil),
		},

		// Amount, exactly.
		{
			name: "a payment of one unit more than required is refused", methods: both,
			reason: x402.ReasonValueMismatch, reasonPermit2: x402.ReasonPermit2AmountMismatch, message: "exactly",
			build: signedFor(func(rq *x402.PaymentRequirements) { rq.Amount = big.NewInt(price + 1).String() }),
		}, {
			name: "a payment of one unit less than required is refused", methods: both,
			reason: x402.ReasonValueMismatch, reasonPermit2: x402.ReasonPermit2AmountMismatch, message: "exactly",
			build: signedFor(func(rq *x402.PaymentRequirements) { rq.Amount = big.NewInt(price - 1).String() }),
		},

		// Asset.
		{
			name: "a Permit2 permit for another token is refused", methods: permit2Only, reason: x402.ReasonPermit2TokenMismatch,
			message: "permitted.token",
			build:   signedFor(func(rq *x402.PaymentRequirements) { rq.Asset = stranger.Hex() }),
		},

		// Time window, by chain time.
		{
			name: "a deadline already passed is refused as Permit expired", methods: both,
			reason: x402.ReasonValidBefore, reasonPermit2: x402.ReasonPermit2DeadlineExpired, message: x402.MessagePermitExpired,
			build: deadline(func(fx *fixture) *big.Int { return fx.headPlus(-1) }),
		}, {
			name: "a deadline only 5 s ahead of chain time is refused", methods: both,
			reason: x402.ReasonValidBefore, reasonPermit2: x402.ReasonPermit2DeadlineExpired, message: "needs 6s more to be mined",
			build: deadline(func(fx *fixture) *big.Int { return fx.headPlus(5) }),
		}, {
			name: "a deadline ahead of the wall clock but behind chain time is refused", methods: both,
			reason: x402.ReasonValidBefore, reasonPermit2: x402.ReasonPermit2DeadlineExpired, message: x402.MessagePermitExpired,
			build: func(fx *fixture, payer *chaintest.Account, method string) x402.VerifyRequest {
				wall := time.Now()
				d := big.NewInt(wall.Unix() + 120)
				req := deadline(func(*fixture) *big.Int { return d })(fx, payer, method)
				if ahead := wall.Unix() + 300 - int64(fx.c.HeadTime()); ahead > 0 {
					fx.c.AdjustTime(time.Duration(ahead) * time.Second)
				}
				if now := time.Now().Unix(); d.Int64() <= now || int64(fx.c.HeadTime()) <= d.Int64() {
					fx.t.Fatalf("deadline %s must lie between the wall clock %d and chain time %d", d, now, fx.c.HeadTime())
				}
				return req
			},
		}, {
			name: "a validAfter in the future of chain time is refused", methods: permit2Only, reason: x402.ReasonPermit2NotYetValid,
			message: "the earliest time of the next block",
			build:   signedWith(func(fx *fixture) chain.Permit2Options { return chain.Permit2Options{ValidAfter: fx.headPlus(60)} }, nil),
		},

		// Signature.
		{
			name: "a signature by another key than the payer's is refused", methods: both,
			reason: x402.ReasonInvalidSignature, reasonPermit2: x402.ReasonPermit2InvalidSignature, message: "it recovers " + other.Address.Hex(),
			build: signed(func(fx *fixture, req *x402.VerifyRequest) { fx.resign(req, other.Key) }),
		}, {
			name: "a deadline changed after signing is refused", methods: both,
			reason: x402.ReasonInvalidSignature, reasonPermit2: x402.ReasonPermit2InvalidSignature, message: "signature is not",
			build: signed(func(_ *fixture, req *x402.VerifyRequest) {
				later := func(s string) string {
					d, _ := new(big.Int).SetString(s, 10)
					return d.Add(d, big.NewInt(1)).String()
				}
				if a := req.PaymentPayload.Payload.Authorization; a != nil {
					a.ValidBefore = later(a.ValidBefore)
				} else {
					a := req.PaymentPayload.Payload.Permit2Authorization
					a.Deadline = later(a.Deadline)
				}
			}),
		}, {
			name: "the high-s twin of a valid signature is refused", methods: both,
			reason: x402.ReasonInvalidSignature, reasonPermit2: x402.ReasonPermit2InvalidSignature, message: "low-s",
			build: func(fx *fixture, payer *chaintest.Account, method string) x402.VerifyRequest {
				req := fx.pay(payer, fx.requirements(method))
				fx.highS(&req, payer)
				return req
			},
		},

		// Nonce.
		{
			name: "a permit whose token nonce was already used is refused", methods: erc2612Only, reason: x402.ReasonNonceAlreadyUsed,
			message: "already used",
			build: func(fx *fixture, payer *chaintest.Account, method string) x402.VerifyRequest {
				req := fx.pay(payer, fx.requirements(method))
				// The payer spends the same token nonce on a permit of its own before the payment arrives.
				p := fx.c.SignERC2612Permit(payer, stranger, big.NewInt(0), fx.headPlus(600).Uint64())
				v, r, s := p.Signature[64], [32]byte(p.Signature[:32]), [32]byte(p.Signature[32:64])
				data, err := contracts.StableCoinABI.Pack("permit", p.Owner, p.Spender, p.Value, p.Deadline, v, r, s)
				fx.transact(payer, fx.c.Token, data, err)
				return req
			},
		}, {
			name: "a permit whose token nonce is ahead of the token's is refused", methods: erc2612Only, reason: x402.ReasonInvalidPayload,
			message: "ahead",
			build: signedWith(nil, func(fx *fixture) chain.ERC2612Options {
				return chain.ERC2612Options{TokenNonce: big.NewInt(1)} // fresh payers are at 0
			}),
		}, {
			name: "a Permit2 nonce the payer invalidated is refused", methods: permit2Only, reason: x402.ReasonPermit2InvalidNonce,
			message: "already used",
			build: func(fx *fixture, payer *chaintest.Account, method string) x402.VerifyRequest {
				nonce := chaintest.RandomNonce()
				word, bit := new(big.Int).Rsh(nonce, 8), new(big.Int).And(nonce, big.NewInt(0xff))
				data, err := contracts.Permit2ABI.Pack("invalidateUnorderedNonces", word, new(big.Int).Lsh(big.NewInt(1), uint(bit.Uint64())))
				fx.transact(payer, contracts.Permit2Address, data, err)
				if !fx.c.Permit2NonceUsed(payer.Address, nonce) {
					fx.t.Fatal("invalidateUnorderedNonces left the nonce unused")
				}
				return fx.permit2(payer, fx.requirements(method), chain.Permit2Options{Nonce: nonce})
			},
		},

		// Balance.
		{
			name: "a payer one unit short of the amount is refused", methods: both, reason: x402.ReasonInsufficientFunds, message: "balance",
			build: func(fx *fixture, payer *chaintest.Account, method string) x402.VerifyRequest {
				req := fx.pay(payer, fx.requirements(method))
				keep := big.NewInt(price - 1)
				fx.c.TransferToken(payer, sink, new(big.Int).Sub(fx.c.TokenBalance(payer.Address), keep))
				return req
			},
		},

		// Permit2 allowance.
		{
			name: "a payer without Permit2 allowance and without the extension is refused", methods: permit2Only,
			reason: x402.ReasonPermit2AllowanceRequired, message: x402.ExtensionEIP2612GasSponsoring, unapproved: true,
			build: func(fx *fixture, payer *chaintest.Account, method string) x402.VerifyRequest {
				return fx.pay(payer, fx.requirements(method))
			},
		},

		// Gas-sponsoring extension, for a payer without Permit2 allowance.
		{
			name: "a gas-sponsoring extension whose info is not an object is refused", methods: permit2Only,
			reason: x402.ReasonInvalidEIP2612ExtensionFormat, message: "must be", unapproved: true,
			build: signed(func(_ *fixture, req *x402.VerifyRequest) {
				req.PaymentPayload.Extensions = map[string]json.RawMessage{x402.ExtensionEIP2612GasSponsoring: json.RawMessage(`{"info":"approve please"}`)}
			}),
		}, {
			name: "a gas-sponsoring extension with a non-decimal amount is refused", methods: permit2Only,
			reason: x402.ReasonInvalidEIP2612ExtensionFormat, message: "info.amount", unapproved: true,
			build: sponsored(nil, func(info *x402.EIP2612GasSponsoringInfo) { info.Amount = "ten thousand" }),
		}, {
			name: "a gas-sponsoring permit from another owner than the payer is refused", methods: permit2Only,
			reason: x402.ReasonEIP2612FromMismatch, message: "info.from", unapproved: true,
			build: sponsored(func(_ *fixture, st *sponsorTerms) { st.signer, st.from = other, other.Address }, nil),
		}, {
			name: "a gas-sponsoring permit for another token is refused", methods: permit2Only,
			reason: x402.ReasonEIP2612AssetMismatch, message: "info.asset", unapproved: true,
			build: sponsored(func(_ *fixture, st *sponsorTerms) { st.asset = stranger }, nil),
		}, {
			name: "a gas-sponsoring permit whose spender is not Permit2 is refused", methods: permit2Only,
			reason: x402.ReasonEIP2612SpenderNotPermit2, message: "info.spender", unapproved: true,
			build: sponsored(func(_ *fixture, st *sponsorTerms) { st.spender = contracts.ProxyAddress }, nil),
		}, {
			name: "a gas-sponsoring permit for another amount is refused", methods: permit2Only,
			reason: x402.ReasonPermit2EIP2612AmountMismatch, message: "info.amount", unapproved: true,
			build: sponsored(func(_ *fixture, st *sponsorTerms) { st.amount = big.NewInt(price + 1) }, nil),
		}, {
			name: "a gas-sponsoring permit whose deadline passed is refused", methods: permit2Only,
			reason: x402.ReasonEIP2612DeadlineExpired, message: "info.deadline", unapproved: true,
			build: sponsored(func(fx *fixture, st *sponsorTerms) { st.deadline = fx.headPlus(-1) }, nil),
		}, {
			name: "a gas-sponsoring permit signed by another key is refused", methods: permit2Only,
			reason: x402.ReasonInvalidEIP2612ExtensionFormat, message: "info.signature is not", unapproved: true,
			build: sponsored(func(_ *fixture, st *sponsorTerms) { st.signer = other }, nil),
		}, {
			name: "a gas-sponsoring permit with a stale token nonce is refused", methods: permit2Only,
			reason: x402.ReasonInvalidEIP2612ExtensionFormat, message: "info.nonce", unapproved: true,
			build: sponsored(func(_ *fixture, st *sponsorTerms) { st.nonce = new(big.Int).Add(st.nonce, big.NewInt(1)) }, nil),
		},
	}
}
