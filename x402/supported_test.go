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

func TestKindMatchesVersionNetworkAndMethodAndReadsAMissingMethodAsERC2612(t *testing.T) {
	s := SupportedResponse{Kinds: []SupportedKind{
		{X402Version: 2, Scheme: SchemeExact, Network: "eip155:72344", Extra: Extra{AssetTransferMethod: TransferPermit2}},
		{X402Version: 1, Scheme: SchemeExact, Network: "eip155:72344"},
	}}
	if _, ok := s.Kind(2, "eip155:72344", TransferPermit2); !ok {
		t.Error("permit2 v2 not found")
	}
	if _, ok := s.Kind(1, "eip155:72344", TransferERC2612); !ok {
		t.Error("a kind without a method is not read as erc2612")
	}
	for _, miss := range []struct {
		v       int
		network string
		method  string
	}{{1, "eip155:72344", TransferPermit2}, {2, "eip155:72344", TransferERC2612}, {2, "eip155:1", TransferPermit2}} {
		if _, ok := s.Kind(miss.v, miss.network, miss.method); ok {
			t.Errorf("Kind%v found a kind that is not there", miss)
		}
	}
}
