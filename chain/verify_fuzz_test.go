package chain_test

import (
	"encoding/json"
	"go/ast"
	"go/parser"
	"go/token"
	"math/big"
	"path/filepath"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/ethereum/go-ethereum/common"
	"github.com/ethereum/go-ethereum/crypto"

	"github.com/x402-gateway/caddy-x402/chain"
	"github.com/x402-gateway/caddy-x402/chain/chaintest"
	"github.com/x402-gateway/caddy-x402/chain/contracts"
	"github.com/x402-gateway/caddy-x402/x402"
)

// The checks Verify runs before the chain, on any request body a client could send: a refusal carries one of the
// x402 package's reason codes and a message, and an accepted payment is on this facilitator's terms and signed by
// the payer it names, as the test recomputes the signed message and recovers its signer with go-ethereum.
func FuzzParseRefusesWithAKnownReasonOrRecoversThePayer(f *testing.F) {
	fx := newFixture(f, fixtureOpts{autoCommit: -1})
	reasons := reasonCodes(f)
	payer := fx.c.Payers[0]
	p2 := fx.permit2(payer, fx.requirements(x402.TransferPermit2), chain.Permit2Options{})
	erc := fx.erc2612(payer, fx.requirements(x402.TransferERC2612), chain.ERC2612Options{TokenNonce: big.NewInt(0)})
	gasless := fx.permit2(fx.c.PayerNoGas, fx.requirements(x402.TransferPermit2), chain.Permit2Options{})
	fx.sponsor(&gasless, fx.c.PayerNoGas, nil, nil)
	valid := []x402.VerifyRequest{p2, erc, gasless}

	shapeOnly := fx.permit2(payer, fx.requirements(""), chain.Permit2Options{}) // the method comes from the payload's shape
	v1 := fx.erc2612(payer, fx.requirements(x402.TransferERC2612), chain.ERC2612Options{TokenNonce: big.NewInt(1)})
	v1.X402Version, v1.PaymentPayload.X402Version = x402.Version1, x402.Version1
	eip3009Pay, err := chain.SignEIP3009Payment(payer.Key, fx.requirements(x402.TransferEIP3009), fx.c.ChainID, chain.EIP3009Options{Now: fx.chainNow()})
	if err != nil {
		f.Fatal(err)
	}
	valid = append(valid, shapeOnly, v1, x402.VerifyRequest{X402Version: 2, PaymentPayload: eip3009Pay, PaymentRequirements: fx.requirements(x402.TransferEIP3009)})
	for _, req := range valid {
		if _, reason, message := fx.f.ParseForTest(req); reason != "" {
			f.Fatalf("a valid seed is refused: %s: %s", reason, message)
		}
	}

	both := p2
	both.PaymentPayload.Payload.Authorization = erc.PaymentPayload.Payload.Authorization
	eip3009 := erc
	lookalike := *erc.PaymentPayload.Payload.Authorization
	lookalike.Nonce = "0x" + strings.Repeat("ab", 32)
	eip3009.PaymentPayload.Payload.Authorization = &lookalike
	badSponsor := fx.permit2(fx.c.PayerNoGas, fx.requirements(x402.TransferPermit2), chain.Permit2Options{})
	fx.sponsor(&badSponsor, fx.c.PayerNoGas, nil, func(info *x402.EIP2612GasSponsoringInfo) { info.Amount = "10001" })
	if got, _, _ := fx.f.ParseForTest(badSponsor); got.SponsorReason != x402.ReasonPermit2EIP2612AmountMismatch {
		f.Fatalf("a sponsoring permit of another amount left the problem %q", got.SponsorReason)
	}
	v1Permit2 := p2
	v1Permit2.X402Version, v1Permit2.PaymentPayload.X402Version = x402.Version1, x402.Version1
	for _, req := range append(valid, both, eip3009, badSponsor, v1Permit2, x402.VerifyRequest{}) {
		body, err := json.Marshal(req)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(body, uint8(0), "")
		f.Add(body, uint8(9), "10000")
	}
	check := func(t *testing.T, req x402.VerifyRequest) {
		got, reason, message := fx.f.ParseForTest(req)
		if reason != "" || message != "" {
			if !reasons[reason] || message == "" {
				t.Fatalf("refused with reason %q and message %q: want a known reason code and a message", reason, message)
			}
			return
		}
		checkParsedPayment(t, fx, req, got, reasons)
	}
	// The request is tried as the body gives it, then with one of its string fields set to value: most mutations
	// of the body's bytes break its JSON, while an edited field reaches every check behind the ones it passes.
	f.Fuzz(func(t *testing.T, body []byte, field uint8, value string) {
		var req x402.VerifyRequest
		if json.Unmarshal(body, &req) != nil {
			return
		}
		check(t, req)
		if fields := stringFields(reflect.ValueOf(&req), nil); len(fields) > 0 {
			*fields[int(field)%len(fields)] = value
			check(t, req)
		}
	})
}

// stringFields lists the string fields of the value v points to, in order, through structs and non-nil pointers.
func stringFields(v reflect.Value, out []*string) []*string {
	switch v.Kind() {
	case reflect.Pointer:
		if !v.IsNil() {
			return stringFields(v.Elem(), out)
		}
	case reflect.Struct:
		for i := range v.NumField() {
			out = stringFields(v.Field(i), out)
		}
	case reflect.String:
		out = append(out, v.Addr().Interface().(*string))
	}
	return out
}

// checkParsedPayment fails unless an accepted payment is on the fixture's terms and its signature, over the
// message the test rebuilds from the request, recovers the payer the engine read.
func checkParsedPayment(t *testing.T, fx *fixture, req x402.VerifyRequest, got chain.ParsedPayment, reasons map[string]bool) {
	t.Helper()
	rq, pp := req.PaymentRequirements, req.PaymentPayload
	if (req.X402Version != x402.Version1 && req.X402Version != x402.Version2) || pp.X402Version != req.X402Version ||
		rq.Scheme != x402.SchemeExact || pp.Accepted.Scheme != rq.Scheme || rq.Network != fx.net || pp.Accepted.Network != rq.Network ||
		rq.MaxTimeoutSeconds <= 0 {
		t.Fatalf("accepted a payment whose version, scheme, network or timeout is not this facilitator's: %+v", req)
	}
	token, err := chain.ParseAddress("asset", rq.Asset)
	if err != nil || token != fx.c.Token {
		t.Fatalf("accepted a payment in asset %q, want %s", rq.Asset, fx.c.Token)
	}
	payTo, err := chain.ParseAddress("payTo", rq.PayTo)
	if err != nil || payTo == (common.Address{}) || payTo != got.PayTo {
		t.Fatalf("accepted a payment to %q (read as %s)", rq.PayTo, got.PayTo)
	}
	amount, err := x402.ParseAmount(rq.Amount)
	if err != nil || amount.Sign() <= 0 || got.Amount.Cmp(amount) != 0 {
		t.Fatalf("accepted a payment of amount %q (read as %v)", rq.Amount, got.Amount)
	}
	if got.Method != x402.TransferMethod(rq, pp.Payload) {
		t.Fatalf("read method %q, the requirement and payload say %q", got.Method, x402.TransferMethod(rq, pp.Payload))
	}
	var digest common.Hash
	switch got.Method {
	case x402.TransferPermit2:
		tr, owner, err := chain.Permit2TransferFromPayload(pp.Payload.Permit2Authorization)
		if err != nil || req.X402Version != x402.Version2 || owner != got.Payer || tr.Spender != contracts.ProxyAddress || tr.To != payTo ||
			tr.Token != token || tr.Amount.Cmp(amount) != 0 {
			t.Fatalf("accepted a permit2 payment not on the requirements' terms (%v): %+v", err, pp.Payload.Permit2Authorization)
		}
		digest = chain.Permit2Digest(chain.Permit2DomainSeparator(fx.c.ChainID, contracts.Permit2Address), tr)
	case x402.TransferERC2612:
		permit, err := chain.PermitFromAuthorization(pp.Payload.Authorization)
		if err != nil || permit.Owner != got.Payer || permit.Value.Cmp(amount) != 0 ||
			!slices.ContainsFunc(fx.c.Wallets, func(w *chaintest.Account) bool { return w.Address == permit.Spender }) {
			t.Fatalf("accepted an erc2612 payment not on the requirements' terms (%v): %+v", err, pp.Payload.Authorization)
		}
		digest = chain.PermitDigest(chain.PermitDomainSeparator(contracts.StableCoinName, contracts.StableCoinVersion, fx.c.ChainID, token), permit)
	case x402.TransferEIP3009:
		a, err := chain.TransferAuthorizationFromPayload(pp.Payload.Authorization)
		if err != nil || a.From != got.Payer || a.To != payTo || a.Value.Cmp(amount) != 0 ||
			(rq.Extra.Name != "" && rq.Extra.Name != contracts.StableCoinName) || (rq.Extra.Version != "" && rq.Extra.Version != contracts.StableCoinVersion) {
			t.Fatalf("accepted an eip3009 payment not on the requirements' terms (%v): %+v", err, pp.Payload.Authorization)
		}
		digest = chain.TransferAuthorizationDigest(chain.PermitDomainSeparator(contracts.StableCoinName, contracts.StableCoinVersion, fx.c.ChainID, token), a)
	default:
		t.Fatalf("accepted a payment of method %q", got.Method)
	}
	if got.ContractSignature {
		// Left to the chain, which asks the payer's wallet; only permit2 and eip3009 contracts can.
		if got.Method == x402.TransferERC2612 || len(common.FromHex(pp.Payload.Signature)) < 64 {
			t.Fatalf("a %s signature of %d bytes was left to the chain", got.Method, len(common.FromHex(pp.Payload.Signature)))
		}
		return
	}
	sig, err := chain.ParseSignature(pp.Payload.Signature)
	if err != nil {
		t.Fatalf("accepted a payment whose signature does not parse: %v", err)
	}
	pub, err := crypto.SigToPub(digest[:], append(sig[:64:64], sig[64]-27))
	if err != nil || crypto.PubkeyToAddress(*pub) != got.Payer {
		t.Fatalf("accepted a payment whose signature does not recover its payer %s (%v)", got.Payer, err)
	}
	if claimed := x402.ClaimedPayer(req); claimed != got.Payer.Hex() {
		t.Fatalf("read payer %s, the payload names %q", got.Payer, claimed)
	}
	if (got.SponsorReason == "") != (got.SponsorMessage == "") || (got.SponsorReason != "" && !reasons[got.SponsorReason]) {
		t.Fatalf("gas sponsoring problem with reason %q and message %q: want a known reason code and a message", got.SponsorReason, got.SponsorMessage)
	}
}

// reasonCodes are the values of the x402 package's Reason constants, read from its source so that a code added
// there is known here without a second list to keep.
func reasonCodes(tb testing.TB) map[string]bool {
	tb.Helper()
	file, err := parser.ParseFile(token.NewFileSet(), filepath.Join("..", "x402", "reasons.go"), nil, 0)
	if err != nil {
		tb.Fatal(err)
	}
	codes := map[string]bool{}
	for _, decl := range file.Decls {
		gen, ok := decl.(*ast.GenDecl)
		if !ok || gen.Tok != token.CONST {
			continue
		}
		for _, spec := range gen.Specs {
			vs := spec.(*ast.ValueSpec)
			for i, name := range vs.Names {
				lit, ok := vs.Values[i].(*ast.BasicLit)
				if !strings.HasPrefix(name.Name, "Reason") || !ok || lit.Kind != token.STRING {
					continue
				}
				code, err := strconv.Unquote(lit.Value)
				if err != nil {
					tb.Fatal(err)
				}
				codes[code] = true
			}
		}
	}
	if !codes[x402.ReasonInvalidPayload] || !codes[x402.ReasonPermit2InvalidSignature] {
		tb.Fatalf("read %d reason codes from x402/reasons.go, not the ones it holds", len(codes))
	}
	return codes
}
