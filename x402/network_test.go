package x402

import (
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
)

func TestParseCAIP2SplitsNamespaceAndReference(t *testing.T) {
	tests := []struct {
		in, ns, ref string
		ok          bool
	}{
		{"eip155:723487", "eip155", "723487", true},
		{"eip155:72344", "eip155", "72344", true},
		{"solana:5eykt4UsFv8P8NJdTREpY1vzqKqZKvdp", "solana", "5eykt4UsFv8P8NJdTREpY1vzqKqZKvdp", true},
		{"cosmos:cosmoshub-3", "cosmos", "cosmoshub-3", true},
		{"eip155", "", "", false},
		{"eip155:", "", "", false},
		{":1", "", "", false},
		{"ab:1", "", "", false},        // namespace too short
		{"abcdefghi:1", "", "", false}, // namespace too long
		{"EIP155:1", "", "", false},    // namespace is lower case
		{"eip155:1:2", "", "", false},  // ':' is not a reference character
		{"eip155:1 ", "", "", false},   // no spaces
		{"eip155:" + strings.Repeat("1", 33), "", "", false},
		{"base-sepolia", "", "", false}, // a version 1 name
	}
	for _, tt := range tests {
		ns, ref, err := ParseCAIP2(tt.in)
		if tt.ok != (err == nil) || ns != tt.ns || ref != tt.ref {
			t.Errorf("ParseCAIP2(%q) = %q, %q, %v", tt.in, ns, ref, err)
		}
		if err != nil && !errors.Is(err, ErrCAIP2) {
			t.Errorf("ParseCAIP2(%q) error %v does not wrap ErrCAIP2", tt.in, err)
		}
	}
}

func TestChainIDReadsEIP155ReferencesOnly(t *testing.T) {
	tests := []struct {
		in   string
		want uint64
		err  string
	}{
		{NetworkMainnet, 723487, ""},
		{NetworkTestnet, 72344, ""},
		{"eip155:1", 1, ""},
		{"eip155:18446744073709551615", 18446744073709551615, ""},
		{"eip155:18446744073709551616", 0, "64 bits"},
		{"eip155:0", 0, "positive"},
		{"eip155:0723487", 0, "leading zeros"},
		{"eip155:abc", 0, "positive decimal"},
		{"solana:5eykt4UsFv8P8NJdTREpY1vzqKqZKvdp", 0, "namespace \"solana\""},
		{"72344", 0, "no ':'"},
	}
	for _, tt := range tests {
		got, err := ChainID(tt.in)
		if tt.err == "" {
			if err != nil || got != tt.want {
				t.Errorf("ChainID(%q) = %d, %v; want %d", tt.in, got, err, tt.want)
			}
			if EIP155(got) != tt.in {
				t.Errorf("EIP155(%d) = %q, want %q", got, EIP155(got), tt.in)
			}
			continue
		}
		if err == nil || !strings.Contains(err.Error(), tt.err) {
			t.Errorf("ChainID(%q) = %d, %v; want an error mentioning %q", tt.in, got, err, tt.err)
		}
	}
}

func TestNewRegistryKnowsTheSpecNetworks(t *testing.T) {
	r := NewRegistry()
	for _, tt := range []struct {
		id, name string
		chain    uint64
	}{{NetworkMainnet, V1NameMainnet, 723487}, {NetworkTestnet, V1NameTestnet, 72344}} {
		n, ok := r.Lookup(tt.id)
		if !ok || n.ChainID != tt.chain || n.Name != tt.name {
			t.Fatalf("Lookup(%s) = %+v, %v", tt.id, n, ok)
		}
		if len(n.Assets) != 1 {
			t.Fatalf("%s has %d assets, want the one token", tt.id, len(n.Assets))
		}
		if a := n.Assets[0]; a.Name != "Stable Coin" || a.Version != "1" || a.Decimals != 6 || a.Address != "" {
			t.Errorf("%s token = %+v", tt.id, a)
		}
		if byName, ok := r.ByV1Name(tt.name); !ok || byName.CAIP2 != tt.id {
			t.Errorf("ByV1Name(%q) = %+v, %v", tt.name, byName, ok)
		}
	}
	if got := r.Networks(); len(got) != 2 || got[0].CAIP2 != NetworkTestnet || got[1].CAIP2 != NetworkMainnet {
		t.Errorf("Networks() = %+v, want testnet then mainnet (sorted by id)", got)
	}
}

func TestRegistryAddsNetworksAndAssetsFromConfiguration(t *testing.T) {
	r := NewRegistry()
	base := Network{CAIP2: "eip155:84532", Name: "base-sepolia", Assets: []Asset{
		{Address: "0x036CbD53842c5426634e7929541eC2318f3dCF7e", Name: "USDC", Version: "2", Decimals: 6},
	}}
	if err := r.Add(base); err != nil {
		t.Fatal(err)
	}
	n, ok := r.ByV1Name("base-sepolia")
	if !ok || n.ChainID != 84532 {
		t.Fatalf("ByV1Name(base-sepolia) = %+v, %v (chain id should come from the identifier)", n, ok)
	}
	a, ok := n.AssetByAddress("0x036cbd53842c5426634e7929541ec2318f3dcf7e")
	if !ok || a.Name != "USDC" {
		t.Errorf("AssetByAddress in lower case = %+v, %v", a, ok)
	}
	token := "0x5FbDB2315678afecb367f032d93F642f64180aa3"
	if err := r.AddAsset(NetworkTestnet, Asset{Address: token, Name: DefaultTokenName, Version: "1", Decimals: 6}); err != nil {
		t.Fatal(err)
	}
	tn, _ := r.Lookup(NetworkTestnet)
	if _, ok := tn.AssetByAddress(token); !ok || len(tn.Assets) != 2 {
		t.Errorf("testnet assets after AddAsset = %+v", tn.Assets)
	}
	if byName, _ := r.ByV1Name(V1NameTestnet); len(byName.Assets) != 2 {
		t.Errorf("the asset is visible by id but not by version 1 name: %+v", byName.Assets)
	}
}

func TestRegistryRefusesDuplicatesAndMalformedEntries(t *testing.T) {
	tests := []struct {
		name string
		n    Network
		want string
	}{
		{"duplicate id", Network{CAIP2: NetworkMainnet}, "already registered"},
		{"duplicate v1 name", Network{CAIP2: "eip155:5", Name: V1NameTestnet}, "already used by eip155:72344"},
		{"malformed id", Network{CAIP2: "eip155-5"}, "malformed CAIP-2"},
		{"not EVM", Network{CAIP2: "solana:5eykt4UsFv8P8NJdTREpY1vzqKqZKvdp"}, "namespace"},
		{"chain id disagrees", Network{CAIP2: "eip155:5", ChainID: 6}, "disagrees"},
		{"v1 name in CAIP-2 form", Network{CAIP2: "eip155:5", Name: "eip155:5"}, "must not contain ':'"},
		{"malformed asset", Network{CAIP2: "eip155:5", Assets: []Asset{{Address: "0x1234"}}}, "40 hex digits"},
		{"duplicate asset", Network{CAIP2: "eip155:5", Assets: []Asset{
			{Address: "0x5FbDB2315678afecb367f032d93F642f64180aa3"}, {Address: "0x5fbdb2315678afecb367f032d93f642f64180aa3"},
		}}, "already registered"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := NewRegistry()
			err := r.Add(tt.n)
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("Add(%+v) = %v, want an error mentioning %q", tt.n, err, tt.want)
			}
			if _, ok := r.Lookup(tt.n.CAIP2); ok && tt.n.CAIP2 != NetworkMainnet {
				t.Errorf("a refused network was registered anyway")
			}
		})
	}
	r := NewRegistry()
	if err := r.AddAsset("eip155:5", Asset{}); err == nil || !strings.Contains(err.Error(), "not registered") {
		t.Errorf("AddAsset to an unknown network = %v", err)
	}
	token := Asset{Address: "0x5FbDB2315678afecb367f032d93F642f64180aa3"}
	if err := r.AddAsset(NetworkMainnet, token); err != nil {
		t.Fatal(err)
	}
	if err := r.AddAsset(NetworkMainnet, token); err == nil {
		t.Error("the same asset was added twice")
	}
}

func TestLookupReturnsACopyTheCallerCannotUseToChangeTheRegistry(t *testing.T) {
	r := NewRegistry()
	n, _ := r.Lookup(NetworkMainnet)
	n.Assets[0].Name = "Changed"
	n.Name = "changed"
	again, _ := r.Lookup(NetworkMainnet)
	if again.Assets[0].Name != DefaultTokenName || again.Name != V1NameMainnet {
		t.Errorf("registry changed through a looked-up copy: %+v", again)
	}
}

func TestRegistryIsSafeForConcurrentUse(t *testing.T) {
	r := NewRegistry()
	var wg sync.WaitGroup
	for i := range 8 {
		wg.Add(2)
		go func() {
			defer wg.Done()
			_ = r.Add(Network{CAIP2: EIP155(uint64(1000 + i))})
			_ = r.AddAsset(NetworkTestnet, Asset{Address: fmt.Sprintf("0x%040x", i+1)})
		}()
		go func() {
			defer wg.Done()
			for range 100 {
				if n, ok := r.Lookup(NetworkTestnet); !ok || n.ChainID != 72344 {
					t.Error("lookup failed during concurrent adds")
					return
				}
				_ = r.Networks()
			}
		}()
	}
	wg.Wait()
	if n, _ := r.Lookup(NetworkTestnet); len(n.Assets) != 9 {
		t.Errorf("testnet has %d assets after 8 concurrent adds, want 9", len(n.Assets))
	}
	if got := len(r.Networks()); got != 10 {
		t.Errorf("%d networks after 8 concurrent adds, want 10", got)
	}
}

func TestAddressHelpersCompareAddressesAsValues(t *testing.T) {
	a := "0x70997970C51812dc3A010C7d01b50e0d17dc79C8"
	tests := []struct {
		a, b string
		want bool
	}{
		{a, strings.ToLower(a), true},
		{a, "0X" + strings.ToUpper(a[2:]), true},
		{a, "0x70997970C51812dc3A010C7d01b50e0d17dc79C9", false},
		{a, a[:41], false},
		{"", "", false},
		{"0xZZ997970C51812dc3A010C7d01b50e0d17dc79C8", "0xZZ997970C51812dc3A010C7d01b50e0d17dc79C8", false},
	}
	for _, tt := range tests {
		if got := SameAddress(tt.a, tt.b); got != tt.want {
			t.Errorf("SameAddress(%q, %q) = %v", tt.a, tt.b, got)
		}
	}
}
