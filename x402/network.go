package x402

import (
	"errors"
	"fmt"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
)

// The two networks of the service spec.
const (
	NetworkMainnet = "eip155:723487"
	NetworkTestnet = "eip155:72344"
)

// Version 1 names of the spec's networks. The spec gives none; these are this project's choice and only matter
// to version 1 peers, which a configuration can teach other names through its own Registry.
const (
	V1NameMainnet = "mainnet"
	V1NameTestnet = "testnet"
)

// Permit domain and precision of the payment token on the spec's networks.
const (
	DefaultTokenName     = "Stable Coin"
	DefaultTokenVersion  = "1"
	DefaultTokenDecimals = 6
)

// NamespaceEIP155 is the CAIP-2 namespace of EVM chains.
const NamespaceEIP155 = "eip155"

// ErrCAIP2 is wrapped by every malformed-network-identifier error.
var ErrCAIP2 = errors.New("malformed CAIP-2 network identifier")

// ParseCAIP2 splits a CAIP-2 chain id such as "eip155:723487" into namespace and reference, enforcing the
// CAIP-2 grammar: namespace [-a-z0-9]{3,8}, reference [-_a-zA-Z0-9]{1,32}.
func ParseCAIP2(id string) (namespace, reference string, err error) {
	ns, ref, ok := strings.Cut(id, ":")
	if !ok {
		return "", "", fmt.Errorf("%w: %s has no ':', expected \"namespace:reference\" such as %q", ErrCAIP2, quoteInput(id), NetworkMainnet)
	}
	if len(ns) < 3 || len(ns) > 8 || !allBytes(ns, isNamespaceByte) {
		return "", "", fmt.Errorf("%w: namespace of %s must be 3-8 characters of a-z, 0-9 or '-'", ErrCAIP2, quoteInput(id))
	}
	if len(ref) < 1 || len(ref) > 32 || !allBytes(ref, isReferenceByte) {
		return "", "", fmt.Errorf("%w: reference of %s must be 1-32 characters of a-z, A-Z, 0-9, '-' or '_'", ErrCAIP2, quoteInput(id))
	}
	return ns, ref, nil
}

// ChainID is the EVM chain id of an eip155 CAIP-2 identifier: 723487 for "eip155:723487". The reference must be
// a positive decimal without leading zeros, so each chain has exactly one spelling.
func ChainID(caip2 string) (uint64, error) {
	ns, ref, err := ParseCAIP2(caip2)
	if err != nil {
		return 0, err
	}
	if ns != NamespaceEIP155 {
		return 0, fmt.Errorf("%w: %s is in namespace %q, expected an EVM chain %q", ErrCAIP2, quoteInput(caip2), ns, NamespaceEIP155)
	}
	if !allBytes(ref, isDigit) || ref[0] == '0' {
		return 0, fmt.Errorf("%w: chain id %q of %s must be a positive decimal without leading zeros", ErrCAIP2, ref, quoteInput(caip2))
	}
	id, err := strconv.ParseUint(ref, 10, 64)
	if err != nil {
		return 0, fmt.Errorf("%w: chain id %q of %s does not fit in 64 bits", ErrCAIP2, ref, quoteInput(caip2))
	}
	return id, nil
}

// EIP155 is the CAIP-2 identifier of an EVM chain id: "eip155:72344" for 72344.
func EIP155(chainID uint64) string { return NamespaceEIP155 + ":" + strconv.FormatUint(chainID, 10) }

func isNamespaceByte(c byte) bool { return c == '-' || isDigit(c) || (c >= 'a' && c <= 'z') }

func isReferenceByte(c byte) bool {
	return c == '-' || c == '_' || isDigit(c) || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')
}

func isDigit(c byte) bool { return c >= '0' && c <= '9' }

func isHex(c byte) bool { return isDigit(c) || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F') }

func allBytes(s string, ok func(byte) bool) bool {
	for i := 0; i < len(s); i++ {
		if !ok(s[i]) {
			return false
		}
	}
	return true
}

// IsHexAddress reports whether s is spelled like an EVM address: "0x" and 40 hex digits, any case. It does not
// check an EIP-55 checksum: peers write addresses in any case, and they are compared as 20-byte values.
func IsHexAddress(s string) bool {
	return len(s) == 42 && s[0] == '0' && (s[1] == 'x' || s[1] == 'X') && allBytes(s[2:], isHex)
}

// IsBytes32 reports whether s is spelled like 32 bytes in hex (an EIP-3009 nonce, a transaction hash): "0x"
// and 64 hex digits, any case.
func IsBytes32(s string) bool {
	return len(s) == 66 && s[0] == '0' && (s[1] == 'x' || s[1] == 'X') && allBytes(s[2:], isHex)
}

// IsTxHash reports whether s is spelled like an EVM transaction hash: "0x" and 64 hex digits, any case.
func IsTxHash(s string) bool { return IsBytes32(s) }

// SameAddress reports whether a and b are the same well-formed EVM address, ignoring letter case.
func SameAddress(a, b string) bool {
	return IsHexAddress(a) && IsHexAddress(b) && strings.EqualFold(a[2:], b[2:])
}

// ContainsAddress reports whether list holds addr, compared as SameAddress does.
func ContainsAddress(list []string, addr string) bool {
	return slices.ContainsFunc(list, func(a string) bool { return SameAddress(a, addr) })
}

// Asset is an ERC-20 token a network accepts payment in, with the EIP-2612 permit domain it signs under.
type Asset struct {
	// Address is the token contract, "0x" and 40 hex digits; empty when not known in advance (the spec's
	// networks name their token's domain but not its address).
	Address  string
	Name     string // EIP-712 domain name, e.g. "Stable Coin"
	Version  string // EIP-712 domain version, e.g. "1"
	Decimals uint8
}

// Network is an EVM network payments settle on.
type Network struct {
	CAIP2   string // e.g. "eip155:723487"
	ChainID uint64 // must agree with CAIP2
	Name    string // version 1 network name; empty when version 1 peers are not served
	Assets  []Asset
}

// AssetByAddress finds the network's asset whose contract is addr, comparing addresses as 20-byte values.
func (n Network) AssetByAddress(addr string) (Asset, bool) {
	for _, a := range n.Assets {
		if a.Address != "" && SameAddress(a.Address, addr) {
			return a, true
		}
	}
	return Asset{}, false
}

// KnownNetworks returns the spec's mainnet and testnet: chain ids 723487 and 72344, each with its 6-decimal
// "Stable Coin" / "1" token at a yet unknown address.
func KnownNetworks() []Network {
	token := Asset{Name: DefaultTokenName, Version: DefaultTokenVersion, Decimals: DefaultTokenDecimals}
	return []Network{
		{CAIP2: NetworkMainnet, ChainID: 723487, Name: V1NameMainnet, Assets: []Asset{token}},
		{CAIP2: NetworkTestnet, ChainID: 72344, Name: V1NameTestnet, Assets: []Asset{token}},
	}
}

// Registry holds the networks a gateway or facilitator knows. It is built by its owner (no package-level
// registry exists) and safe for concurrent use: configuration adds, requests look up.
type Registry struct {
	mu     sync.RWMutex
	byID   map[string]*Network
	byName map[string]*Network
}

// NewRegistry returns a registry holding the spec's two networks (KnownNetworks).
func NewRegistry() *Registry {
	r := NewEmptyRegistry()
	for _, n := range KnownNetworks() {
		if err := r.Add(n); err != nil {
			panic("x402: known networks are inconsistent: " + err.Error()) // a bug in this file, not input
		}
	}
	return r
}

// NewEmptyRegistry returns a registry with no networks at all.
func NewEmptyRegistry() *Registry {
	return &Registry{byID: make(map[string]*Network), byName: make(map[string]*Network)}
}

// Add registers a network. ChainID may be left 0 to take it from CAIP2; a network id, version 1 name or asset
// address that is already registered is an error, as is a malformed identifier or address.
func (r *Registry) Add(n Network) error {
	id, err := ChainID(n.CAIP2)
	if err != nil {
		return fmt.Errorf("add network: %w", err)
	}
	if n.ChainID == 0 {
		n.ChainID = id
	} else if n.ChainID != id {
		return fmt.Errorf("add network %s: chain id %d disagrees with the identifier's %d", n.CAIP2, n.ChainID, id)
	}
	if n.Name != "" && strings.Contains(n.Name, ":") {
		return fmt.Errorf("add network %s: version 1 name %q must not contain ':' (that is CAIP-2 form)", n.CAIP2, n.Name)
	}
	assets := n.Assets
	n.Assets = nil
	for _, a := range assets {
		if err := checkAsset(n, a); err != nil {
			return fmt.Errorf("add network %s: %w", n.CAIP2, err)
		}
		n.Assets = append(n.Assets, a)
	}

	r.mu.Lock()
	defer r.mu.Unlock()
	if _, dup := r.byID[n.CAIP2]; dup {
		return fmt.Errorf("add network %s: already registered", n.CAIP2)
	}
	if other, dup := r.byName[n.Name]; dup && n.Name != "" {
		return fmt.Errorf("add network %s: version 1 name %q is already used by %s", n.CAIP2, n.Name, other.CAIP2)
	}
	r.byID[n.CAIP2] = &n
	if n.Name != "" {
		r.byName[n.Name] = &n
	}
	return nil
}

// AddAsset adds an asset to a registered network, such as the token address a configuration names for one of
// the spec's networks.
func (r *Registry) AddAsset(caip2 string, a Asset) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	n, ok := r.byID[caip2]
	if !ok {
		return fmt.Errorf("add asset to %s: network not registered", quoteInput(caip2))
	}
	if err := checkAsset(*n, a); err != nil {
		return fmt.Errorf("add asset to %s: %w", caip2, err)
	}
	// Copy on write: Networks handed out by Lookup share no backing array with the registry.
	n.Assets = append(append([]Asset(nil), n.Assets...), a)
	return nil
}

// checkAsset validates a against the assets n already has.
func checkAsset(n Network, a Asset) error {
	if a.Address == "" {
		return nil
	}
	if !IsHexAddress(a.Address) {
		return fmt.Errorf("asset address %s: expected 0x and 40 hex digits", quoteInput(a.Address))
	}
	if _, dup := n.AssetByAddress(a.Address); dup {
		return fmt.Errorf("asset %s is already registered", a.Address)
	}
	return nil
}

// Lookup finds a network by its CAIP-2 identifier.
func (r *Registry) Lookup(caip2 string) (Network, bool) {
	r.mu.RLock()
	defer r.mu.RUnlock()
	n, ok := r.byID[caip2]
	if !ok {
		return Network{}, false
	}
	return n.clone(), true
}

// ByV1Name finds a network by its version 1 name.
func (r *Registry) ByV1Name(name string) (Network, bool) {
	r.mu.RLock()
	defer r.mu.RUnlock()
	n, ok := r.byName[name]
	if !ok {
		return Network{}, false
	}
	return n.clone(), true
}

// Networks lists every registered network, ordered by CAIP-2 identifier.
func (r *Registry) Networks() []Network {
	r.mu.RLock()
	defer r.mu.RUnlock()
	out := make([]Network, 0, len(r.byID))
	for _, n := range r.byID {
		out = append(out, n.clone())
	}
	sort.Slice(out, func(i, j int) bool { return out[i].CAIP2 < out[j].CAIP2 })
	return out
}

// V1Name is the version 1 name of a CAIP-2 network, for speaking to version 1 peers.
func (r *Registry) V1Name(caip2 string) (string, error) {
	n, ok := r.Lookup(caip2)
	switch {
	case !ok:
		return "", fmt.Errorf("network %s is not registered, so it has no version 1 name", quoteInput(caip2))
	case n.Name == "":
		return "", fmt.Errorf("network %s has no version 1 name configured", caip2)
	}
	return n.Name, nil
}

// CAIP2 is the CAIP-2 identifier of a version 1 network name.
func (r *Registry) CAIP2(v1Name string) (string, error) {
	n, ok := r.ByV1Name(v1Name)
	if !ok {
		return "", fmt.Errorf("version 1 network name %s is not registered", quoteInput(v1Name))
	}
	return n.CAIP2, nil
}

func (n *Network) clone() Network {
	c := *n
	c.Assets = append([]Asset(nil), n.Assets...)
	return c
}
