package gate

import (
	"encoding/json"
	"fmt"
	"slices"

	"github.com/x402-gateway/caddy-x402/x402"
)

// gasSponsoringExtensions are the gas-sponsoring extensions a gate declares where its facilitator takes them,
// and Config.GasSponsoring may name.
var gasSponsoringExtensions = []string{x402.ExtensionEIP2612GasSponsoring, x402.ExtensionERC20ApprovalGasSponsoring}

// CheckGasSponsoring says what is wrong with a Config.GasSponsoring: a name that is not a gas-sponsoring
// extension, or one named twice.
func CheckGasSponsoring(names []string) error {
	for i, n := range names {
		if !slices.Contains(gasSponsoringExtensions, n) {
			return fmt.Errorf("gas_sponsoring %q is not a gas-sponsoring extension; want %q or %q", n, x402.ExtensionEIP2612GasSponsoring, x402.ExtensionERC20ApprovalGasSponsoring)
		}
		if slices.Contains(names[:i], n) {
			return fmt.Errorf("gas_sponsoring names %q twice", n)
		}
	}
	return nil
}

// withholdGasSponsoring removes from a 402's extensions the gas-sponsoring extensions the facilitator takes and
// the gate does not declare (Config.GasSponsoring). It declares none the facilitator does not take: a payment
// relying on one would be refused.
func withholdGasSponsoring(ext map[string]json.RawMessage, declared []string) {
	for _, n := range gasSponsoringExtensions {
		if !slices.Contains(declared, n) {
			delete(ext, n)
		}
	}
}

// undeclaredGasSponsoring lists the gas-sponsoring extensions a payment carries that the gate does not declare
// (Config.GasSponsoring; all are declared when it is nil). They never reach the facilitator (declaredPayload): a
// payment relying on one is judged without it, and refused for the allowance it lacks before any gas is spent.
func (x *exchange) undeclaredGasSponsoring(ext map[string]json.RawMessage) []string {
	declared := x.g.cfg.GasSponsoring
	if declared == nil {
		return nil
	}
	var out []string
	for _, n := range gasSponsoringExtensions {
		if _, ok := ext[n]; ok && !slices.Contains(declared, n) {
			out = append(out, n)
		}
	}
	return out
}
