package x402

import (
	"reflect"
	"testing"
)

func TestSignersForCollectsTheNetworkAndEveryMatchingPatternOnce(t *testing.T) {
	s := SupportedResponse{Signers: map[string][]string{
		"eip155:72344": {"0x00000000000000000000000000000000000000a1"},
		"eip155:*":     {"0x00000000000000000000000000000000000000A1", "0x00000000000000000000000000000000000000b2"},
		"*":            {"0x00000000000000000000000000000000000000c3"},
		"eip155:1":     {"0x00000000000000000000000000000000000000d4"},
		"solana:*":     {"0x00000000000000000000000000000000000000e5"},
	}}
	for _, tc := range []struct {
		network string
		want    []string
	}{
		{"eip155:72344", []string{"0x00000000000000000000000000000000000000c3", "0x00000000000000000000000000000000000000A1", "0x00000000000000000000000000000000000000b2"}},
		{"eip155:1", []string{"0x00000000000000000000000000000000000000c3", "0x00000000000000000000000000000000000000A1", "0x00000000000000000000000000000000000000b2", "0x00000000000000000000000000000000000000d4"}},
		{"eip155:723487", []string{"0x00000000000000000000000000000000000000c3", "0x00000000000000000000000000000000000000A1", "0x00000000000000000000000000000000000000b2"}},
	} {
		if got := s.SignersFor(tc.network); !reflect.DeepEqual(got, tc.want) {
			t.Errorf("SignersFor(%s) = %v, want %v", tc.network, got, tc.want)
		}
	}
	if got := (*SupportedResponse)(nil).SignersFor("eip155:1"); got != nil {
		t.Errorf("no signers: %v", got)
	}
}

func TestKindMatchesVersionNetworkAndMethodAndReadsAMissingMethodAsTheStandardKind(t *testing.T) {
	named := SupportedKind{X402Version: 2, Scheme: SchemeExact, Network: "eip155:72344", Extra: Extra{AssetTransferMethod: TransferPermit2, Name: "named"}}
	s := SupportedResponse{Kinds: []SupportedKind{
		{X402Version: 2, Scheme: SchemeExact, Network: "eip155:72344"}, // the public SDKs' standard kind
		named,
		{X402Version: 1, Scheme: SchemeExact, Network: "eip155:84532", Extra: Extra{AssetTransferMethod: TransferERC2612}},
	}}
	if k, ok := s.Kind(2, "eip155:72344", TransferPermit2); !ok || k.Extra.Name != "named" {
		t.Errorf("permit2 v2 = %+v, %v; want the kind naming permit2 before the standard one", k, ok)
	}
	if k, ok := s.Kind(2, "eip155:72344", TransferEIP3009); !ok || k.Extra.AssetTransferMethod != "" {
		t.Errorf("eip3009 v2 = %+v, %v; want the standard kind", k, ok)
	}
	if _, ok := s.Kind(1, "eip155:84532", TransferERC2612); !ok {
		t.Error("a kind naming erc2612 does not serve erc2612")
	}
	for _, miss := range []struct {
		v       int
		network string
		method  string
	}{
		{2, "eip155:72344", TransferERC2612}, // the standard kind never serves erc2612
		{1, "eip155:72344", TransferPermit2}, {2, "eip155:1", TransferPermit2}, {1, "eip155:84532", TransferEIP3009},
	} {
		if _, ok := s.Kind(miss.v, miss.network, miss.method); ok {
			t.Errorf("Kind%v found a kind that is not there", miss)
		}
	}
}

func TestAnUptoKindServesPermit2OnlyAndNamesItsFacilitatorAddress(t *testing.T) {
	s := &SupportedResponse{Kinds: []SupportedKind{
		{X402Version: 2, Scheme: SchemeExact, Network: "eip155:1"},
		{X402Version: 2, Scheme: SchemeUpto, Network: "eip155:1", Extra: Extra{FacilitatorAddress: "0x00000000000000000000000000000000000000aa"}},
	}}
	if k, ok := s.SchemeKind(2, SchemeUpto, "eip155:1", TransferPermit2); !ok || k.Extra.FacilitatorAddress == "" {
		t.Fatalf("upto permit2: got %+v, %v", k, ok)
	}
	for _, m := range []string{TransferEIP3009, TransferERC2612} {
		if _, ok := s.SchemeKind(2, SchemeUpto, "eip155:1", m); ok {
			t.Errorf("upto %s is served; upto has permit2 only", m)
		}
	}
	if k, ok := s.Kind(2, "eip155:1", TransferPermit2); !ok || k.Scheme != SchemeExact {
		t.Errorf("exact permit2: got %+v, %v", k, ok)
	}
	if _, ok := (&SupportedResponse{Kinds: s.Kinds[:1]}).SchemeKind(2, SchemeUpto, "eip155:1", TransferPermit2); ok {
		t.Error("an exact kind serves upto")
	}
}
