package caddymodule

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"reflect"
	"slices"
	"strings"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

// A payment presented again for the resource it bought is judged by its journal record, not by the route's terms
// of now, only at the route it was first presented at (gate.Config.Route): a reload that changed the price must
// not strand a payer whose response was cut short, and a payment of a cheap route must not buy an expensive route
// of the same URL (chosen by a header, say) on the strength of its record. Caddy gives a handler no name of its
// place in the routes, so a gate's route is what can be known of it while it is provisioned: its server, its own
// configuration less its terms (routeTerms), and its ordinal among the gates of that server configured alike.
// Handlers are provisioned in config order, one at a time, so the same configuration gives every gate the same
// route on every gateway of a cluster, after a restart, and after a reload that changes only terms; a reload that
// adds or removes a gate configured alike before it renumbers the rest, which then judge the payments taken
// before by their terms (value_mismatch at another price), never by the record of another route.

// routeTerms are the JSON names of a gate's configuration that its route's identity leaves out: its ways to pay
// (every field of GateAccept, and its accept blocks), what may change with them in a reload (price_grace, and
// upto's default_amount), its facilitator, which says who settles, not what is sold, and whose API key may
// differ between gateways, and the settings of how it answers that change nothing of what is sold (max_buffer,
// async_backlog, cors_origins, payment_header, v1_body, payment_identifier, gas_sponsoring, access: the grants already written
// are keyed by the route, though its paths are put back (see route); discovery, which describes the route to
// catalogs; paywall, how the 402 looks in a browser), and an mcp block, which prices the tool calls (each call's
// resource names its tool, so a record of one tool's payment never buys another; that the gate has one is put back):
// a reload that tunes one of them with the price must not strand a payer whose
// response was cut short before it, nor forget the access a payer bought, nor gateways of a cluster tuned apart.
var routeTerms = append(jsonNames(reflect.TypeFor[GateAccept]()),
	"accepts", "price_grace", "default_amount", "facilitator", "facilitator_url", "facilitator_api_key", "facilitator_timeout",
	"max_buffer", "async_backlog", "cors_origins", "payment_header", "v1_body", "payment_identifier", "gas_sponsoring", "access", "discovery",
	"paywall", "mcp")

// jsonNames are the JSON names of t's fields.
func jsonNames(t reflect.Type) []string {
	var names []string
	for f := range t.Fields() {
		if name, _, _ := strings.Cut(f.Tag.Get("json"), ","); name != "" && name != "-" {
			names = append(names, name)
		}
	}
	return names
}

// route names the gate's route (gate.Config.Route), as the file's comment says: called by Provision before it
// changes the configuration, in config order.
func (g *Gate) route(ctx caddy.Context, app *App) (string, error) {
	raw, err := json.Marshal(g)
	if err != nil {
		return "", fmt.Errorf("naming the gate's route: %w", err)
	}
	var config map[string]json.RawMessage
	if err := json.Unmarshal(raw, &config); err != nil {
		return "", fmt.Errorf("naming the gate's route: %w", err)
	}
	for _, name := range routeTerms {
		delete(config, name)
	}
	if g.Access != nil && len(g.Access.Paths) > 0 {
		// What its grants cover is not a term: a grant of its paths is keyed by the route, and a gate of other
		// paths configured alike would otherwise take this route's place (and honour its grants) when a reload
		// adds or removes a gate before them. A reload that changes the paths names another route.
		paths := slices.Clone(g.Access.Paths)
		slices.Sort(paths)
		if config["access_paths"], err = json.Marshal(slices.Compact(paths)); err != nil {
			return "", fmt.Errorf("naming the gate's route: %w", err)
		}
	}
	if g.MCP != nil {
		// The tool prices are terms, but that it sells tool calls is not: an mcp gate is never configured alike
		// with a gate that sells paths, so adding or removing one renumbers none of the other (their grants of
		// access are keyed by the route).
		config["mcp"] = json.RawMessage("true")
	}
	kept, err := json.Marshal(config) // in the order of its names
	if err != nil {
		return "", fmt.Errorf("naming the gate's route: %w", err)
	}
	server := ""
	if srv, ok := ctx.Value(caddyhttp.ServerCtxKey).(*caddyhttp.Server); ok {
		server = srv.Name()
	}
	sum := sha256.Sum256(append([]byte(server+"\x00"), kept...))
	alike := hex.EncodeToString(sum[:16])
	return fmt.Sprintf("%s#%d", alike, app.gateOrdinal(alike)), nil
}

// gateOrdinal counts the gates of this config configured alike (the same server, the same configuration less its
// terms) in the order they are provisioned: 0 for the first. Handlers are provisioned one at a time.
func (a *App) gateOrdinal(alike string) int {
	if a.gatesAlike == nil {
		a.gatesAlike = map[string]int{}
	}
	n := a.gatesAlike[alike]
	a.gatesAlike[alike] = n + 1
	return n
}
