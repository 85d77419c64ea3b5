package gate

import (
	"strings"
	"testing"
	"time"

	"github.com/x402-gateway/caddy-x402/chain/journal"
	"github.com/x402-gateway/caddy-x402/x402"
)

const (
	testAsset  = "0xFCc9EBb7682E831668990F8333F2Ea453bFDD563"
	testPayTo  = "0x05E11e75E11e75e11E75e11E75E11e75e11e75E1"
	testWallet = "0x457153be03fFe9c157110848Ed97a2B9641bEA91"
)

func testSpec(method string) Offer {
	return Offer{Network: x402.NetworkTestnet, Asset: testAsset, PayTo: testPayTo, Amount: "10000",
		TokenName: "Stable Coin", TokenVersion: "1", Decimals: 6, Method: method, MaxTimeoutSeconds: 300}
}

func testSupported(kinds ...x402.SupportedKind) *x402.SupportedResponse {
	return &x402.SupportedResponse{Kinds: kinds, Extensions: []string{x402.ExtensionEIP2612GasSponsoring},
		Signers: map[string][]string{"eip155:*": {testWallet}}}
}

// noSigners is sup naming no settlement wallet.
func noSigners(sup *x402.SupportedResponse) *x402.SupportedResponse {
	sup.Signers = map[string][]string{}
	return sup
}

func kind(version int, method string) x402.SupportedKind {
	return x402.SupportedKind{X402Version: version, Scheme: "exact", Network: x402.NetworkTestnet, Extra: x402.Extra{AssetTransferMethod: method}}
}

func methodsOf(set *offerSet) string {
	var out []string
	for _, o := range set.offers {
		m := o.req.Extra.AssetTransferMethod
		if o.v1 {
			m += "+v1"
		}
		out = append(out, m)
	}
	return strings.Join(out, " ")
}

func TestOffersFollowWhatTheFacilitatorSupportsPermit2First(t *testing.T) {
	reg := x402.NewRegistry()
	for _, tc := range []struct {
		name  string
		spec  string // method of the spec
		sup   *x402.SupportedResponse
		want  string
		gasSp bool
	}{
		{"nothing known, nothing explicit", "", nil, "", false},
		{"nothing known, explicit permit2", "permit2", nil, "permit2", false},
		{"nothing known, explicit erc2612 goes to version 1 clients too", "erc2612", nil, "erc2612+v1", false},
		{"both supported", "", testSupported(kind(2, "erc2612"), kind(1, "erc2612"), kind(2, "permit2")), "permit2 erc2612+v1", true},
		{"only permit2 supported", "", testSupported(kind(2, "permit2")), "permit2", true},
		{"erc2612 without version 1", "", testSupported(kind(2, "erc2612")), "erc2612", false},
		{"erc2612 with no signer to name as spender (a cluster instance holding no wallet)", "", noSigners(testSupported(kind(2, "erc2612"), kind(2, "permit2"))), "permit2", true},
		{"a kind without a method is the standard kind: permit2, never erc2612", "", testSupported(kind(2, "")), "permit2", true},
		{"eip3009 is not offered for a token not known to have it", "", testSupported(kind(2, "permit2"), kind(2, "eip3009")), "permit2", true},
		{"an explicit eip3009 is offered", "eip3009", testSupported(kind(2, "")), "eip3009", false},
		{"explicit method the facilitator lacks is still offered", "erc2612", testSupported(kind(2, "permit2")), "erc2612", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			set := buildOffers([]Offer{testSpec(tc.spec)}, tc.sup, reg, time.Time{})
			if got := methodsOf(set); got != tc.want {
				t.Fatalf("offers = %q, want %q", got, tc.want)
			}
			if _, ok := set.extensions[x402.ExtensionEIP2612GasSponsoring]; ok != tc.gasSp {
				t.Errorf("gas sponsoring declared = %v, want %v", ok, tc.gasSp)
			}
		})
	}
}

func TestERC2612OffersNameTheSettlementWalletsInTurn(t *testing.T) {
	sup := testSupported(kind(2, "erc2612"))
	sup.Signers = map[string][]string{x402.NetworkTestnet: {"0x1111111111111111111111111111111111111111", "0x2222222222222222222222222222222222222222"}}
	set := buildOffers([]Offer{testSpec("")}, sup, x402.NewRegistry(), time.Time{})
	var seen []string
	for turn := range uint64(3) {
		seen = append(seen, set.paymentRequired(x402.ResourceInfo{URL: "http://x/"}, "", turn).Accepts[0].Extra.Spender)
	}
	if seen[0] == seen[1] || seen[0] != seen[2] {
		t.Fatalf("spenders over three answers = %v, want the two wallets alternating", seen)
	}
}

func TestAPaymentMatchesTheOfferItEchoesComparingAddressesAsBytesAndAmountsAsNumbers(t *testing.T) {
	set := buildOffers([]Offer{testSpec("")}, testSupported(kind(2, "permit2"), kind(2, "erc2612")), x402.NewRegistry(), time.Time{})
	offered := set.offers[0].req
	for _, tc := range []struct {
		name   string
		edit   func(a *x402.PaymentRequirements)
		reason string // "" = matches
	}{
		{"verbatim", func(*x402.PaymentRequirements) {}, ""},
		{"addresses in lower case", func(a *x402.PaymentRequirements) {
			a.Asset, a.PayTo = strings.ToLower(a.Asset), strings.ToLower(a.PayTo)
		}, ""},
		{"no method named: the payload's shape tells", func(a *x402.PaymentRequirements) { a.Extra.AssetTransferMethod = "" }, ""},
		{"other amount", func(a *x402.PaymentRequirements) { a.Amount = "10001" }, x402.ReasonValueMismatch},
		{"amount with a plus", func(a *x402.PaymentRequirements) { a.Amount = "+10000" }, x402.ReasonValueMismatch},
		{"other recipient", func(a *x402.PaymentRequirements) { a.PayTo = testWallet }, x402.ReasonRecipientMismatch},
		{"recipient not an address", func(a *x402.PaymentRequirements) { a.PayTo = "seller" }, x402.ReasonRecipientMismatch},
		{"other network", func(a *x402.PaymentRequirements) { a.Network = x402.NetworkMainnet }, x402.ReasonInvalidNetwork},
		{"other scheme", func(a *x402.PaymentRequirements) { a.Scheme = "upto" }, x402.ReasonUnsupportedScheme},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := x402.PaymentPayload{X402Version: 2, Accepted: offered, Payload: x402.ExactEVMPayload{Signature: "0x00",
				Permit2Authorization: &x402.Permit2Authorization{From: testWallet, Nonce: "1"}}}
			tc.edit(&p.Accepted)
			req, _, mm := set.match(&p)
			switch {
			case tc.reason == "" && mm != nil:
				t.Fatalf("no match: %v", mm)
			case tc.reason == "" && req.PaymentRequirements != offered:
				t.Fatalf("the facilitator would get %+v, want the gate's own requirement %+v", req.PaymentRequirements, offered)
			case tc.reason != "" && (mm == nil || mm.Reason != tc.reason):
				t.Fatalf("mismatch = %v, want %s", mm, tc.reason)
			}
		})
	}
}

func TestTheGateRecordOfAPaymentIsNotTheEngineRecordOfIt(t *testing.T) {
	p := x402.ExactEVMPayload{Permit2Authorization: &x402.Permit2Authorization{From: testWallet, Nonce: "77"}}
	id, ok := gateID(x402.NetworkTestnet, x402.TransferPermit2, testAsset, p)
	if !ok {
		t.Fatal("no id for a payment with payer and nonce")
	}
	if engine := journal.PaymentID(x402.NetworkTestnet, x402.TransferPermit2, testAsset, testWallet, "77"); id == engine {
		t.Fatal("the gate's record would overwrite the engine's settlement record of the same payment")
	}
	lower, _ := gateID(x402.NetworkTestnet, x402.TransferPermit2, strings.ToLower(testAsset),
		x402.ExactEVMPayload{Permit2Authorization: &x402.Permit2Authorization{From: strings.ToLower(testWallet), Nonce: "77"}})
	if lower != id {
		t.Error("the spelling of an address changes the gate's id of a payment")
	}
	if _, ok := gateID(x402.NetworkTestnet, x402.TransferPermit2, testAsset, x402.ExactEVMPayload{}); ok {
		t.Error("a payment without an authorization got an id")
	}
}

func TestSamePayloadIgnoresTheCaseOfHexButNotTheValues(t *testing.T) {
	a := x402.ExactEVMPayload{Signature: "0xABCD", Permit2Authorization: &x402.Permit2Authorization{From: testWallet, Nonce: "1"}}
	b := a
	b.Signature = "0xabcd"
	c := x402.ExactEVMPayload{Signature: "0xABCD", Permit2Authorization: &x402.Permit2Authorization{From: testWallet, Nonce: "2"}}
	if !samePayload(a, b) || samePayload(a, c) {
		t.Fatalf("samePayload: case change %v (want true), other nonce %v (want false)", samePayload(a, b), samePayload(a, c))
	}
}

func TestAnEIP3009TokenIsOfferedByEIP3009AfterPermit2(t *testing.T) {
	spec := testSpec("")
	spec.EIP3009 = true
	for _, tc := range []struct {
		name string
		sup  *x402.SupportedResponse
		want string
	}{
		{"by a facilitator naming every method", testSupported(kind(2, "erc2612"), kind(2, "eip3009"), kind(2, "permit2")), "permit2 eip3009 erc2612"},
		{"by a standard facilitator", testSupported(kind(2, "")), "permit2 eip3009"},
		{"by a facilitator without eip3009", testSupported(kind(2, "permit2")), "permit2"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := methodsOf(buildOffers([]Offer{spec}, tc.sup, x402.NewRegistry(), time.Time{})); got != tc.want {
				t.Fatalf("offers = %q, want %q", got, tc.want)
			}
		})
	}
}

// A facilitator that takes erc20ApprovalGasSponsoring has it declared beside permit2 offers, with the schema the
// public SDK declares; one that does not, or an offer set with no permit2 offer, declares nothing of it.
func TestTheApprovalSponsoringExtensionIsDeclaredOnlyWithPermit2OffersOfAFacilitatorThatTakesIt(t *testing.T) {
	reg := x402.NewRegistry()
	with := testSupported(kind(2, "permit2"), kind(2, "erc2612"))
	with.Extensions = append(with.Extensions, x402.ExtensionERC20ApprovalGasSponsoring)
	for _, tc := range []struct {
		name string
		spec string
		sup  *x402.SupportedResponse
		want bool
	}{
		{"taken, permit2 offered", "", with, true},
		{"taken, only erc2612 offered", "erc2612", with, false},
		{"not taken", "", testSupported(kind(2, "permit2")), false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			set := buildOffers([]Offer{testSpec(tc.spec)}, tc.sup, reg, time.Time{})
			decl, ok := set.extensions[x402.ExtensionERC20ApprovalGasSponsoring]
			if ok != tc.want {
				t.Fatalf("approval sponsoring declared = %v, want %v", ok, tc.want)
			}
			if ok && !strings.Contains(string(decl), `"signedTransaction"`) {
				t.Fatalf("declaration %s has no signedTransaction in its schema", decl)
			}
		})
	}
}
