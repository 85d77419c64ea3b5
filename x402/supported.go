package x402

import (
	"slices"
	"strings"
)

// Kind finds the kind that serves `exact` payments of version on network by the asset transfer method. A kind
// that names no method predates the field and serves EIP-2612-shaped payments (erc2612). A nil response
// (no /supported answer yet) serves nothing.
func (s *SupportedResponse) Kind(version int, network, method string) (SupportedKind, bool) {
	if s == nil {
		return SupportedKind{}, false
	}
	for _, k := range s.Kinds {
		km := k.Extra.AssetTransferMethod
		if km == "" {
			km = TransferERC2612
		}
		if k.X402Version == version && k.Scheme == SchemeExact && k.Network == network && km == method {
			return k, true
		}
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
