package x402

import (
	"slices"
	"strings"
)

// Kind finds the kind that serves `exact` payments of version on network by the asset transfer method (see
// SchemeKind).
func (s *SupportedResponse) Kind(version int, network, method string) (SupportedKind, bool) {
	return s.SchemeKind(version, SchemeExact, network, method)
}

// SchemeKind finds the kind that serves payments of scheme and version on network by the asset transfer method.
// A kind that names no method is the standard EVM kind of the public SDKs: for `exact` it serves eip3009 and,
// for a requirement that says so, permit2, never erc2612, which only a kind naming it serves; for `upto` it
// serves permit2, the only method that scheme has. A kind naming the method is preferred to the standard one.
// A nil response (no /supported answer yet) serves nothing.
func (s *SupportedResponse) SchemeKind(version int, scheme, network, method string) (SupportedKind, bool) {
	if s == nil {
		return SupportedKind{}, false
	}
	if scheme == SchemeUpto && method != TransferPermit2 {
		return SupportedKind{}, false
	}
	var standard *SupportedKind
	for i, k := range s.Kinds {
		if k.X402Version != version || k.Scheme != scheme || k.Network != network {
			continue
		}
		switch km := k.Extra.AssetTransferMethod; {
		case km == method:
			return k, true
		case km == "" && standard == nil && (method == TransferPermit2 || method == TransferEIP3009):
			standard = &s.Kinds[i]
		}
	}
	if standard != nil {
		return *standard, true
	}
	return SupportedKind{}, false
}

// SignersFor lists the facilitator's settlement addresses on network: those listed under the network itself and
// under every pattern that matches it ("eip155:*", "*"), each once, in a stable order.
func (s *SupportedResponse) SignersFor(network string) []string {
	if s == nil {
		return nil
	}
	var out []string
	patterns := make([]string, 0, len(s.Signers))
	for p := range s.Signers {
		patterns = append(patterns, p)
	}
	slices.Sort(patterns)
	for _, p := range patterns {
		prefix, wildcard := strings.CutSuffix(p, "*")
		if p != network && !(wildcard && strings.HasPrefix(network, prefix)) {
			continue
		}
		for _, a := range s.Signers[p] {
			if !ContainsAddress(out, a) {
				out = append(out, a)
			}
		}
	}
	return out
}
