package caddymodule

import (
	"context"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
)

// routesOf names the routes of gates provisioned in order into one config's app, as Provision does.
func routesOf(t *testing.T, gates ...*Gate) []string {
	t.Helper()
	app, ctx := new(App), caddy.Context{Context: context.Background()}
	var routes []string
	for _, g := range gates {
		r, err := g.route(ctx, app)
		if err != nil {
			t.Fatal(err)
		}
		routes = append(routes, r)
	}
	return routes
}

func TestAGatesRouteStaysThroughAChangeOfItsTermsAndTellsGatesConfiguredAlikeApart(t *testing.T) {
	cheap := func(amount, payTo string) *Gate {
		return &Gate{GateAccept: GateAccept{Amount: amount, PayTo: payTo}, MaxBuffer: 1 << 20}
	}
	before := routesOf(t, cheap("100", "0x01"), cheap("10000", "0x01"),
		&Gate{GateAccept: GateAccept{Amount: "100"}, MaxBuffer: 1 << 20, Description: "the files"})
	if before[0] == before[1] || before[0] == before[2] || before[1] == before[2] {
		t.Fatalf("three gates of one config, two alike but for their price, one described otherwise, have routes %q; want three", before)
	}

	// A reload (or another gateway of the cluster) with other terms, another facilitator and a grace.
	reloaded := cheap("200", "0x02")
	reloaded.Price, reloaded.Network, reloaded.PriceGrace, reloaded.DefaultAmount = "", "eip155:1", caddy.Duration(1), "zero"
	reloaded.FacilitatorURL, reloaded.FacilitatorAPIKey = "https://facilitator.example", "{env.KEY}"
	reloaded.Accepts = []*GateAccept{{Network: "eip155:2"}}
	after := routesOf(t, reloaded, cheap("20000", "0x02"),
		&Gate{GateAccept: GateAccept{Amount: "300"}, MaxBuffer: 1 << 20, Description: "the files"})
	for i := range before {
		if after[i] != before[i] {
			t.Errorf("gate %d's route after its terms changed: %q, want %q as before", i, after[i], before[i])
		}
	}

	// What a gate serves and how is its route's: another settle mode or description is another route.
	settled := cheap("100", "0x01")
	settled.Settle = SettleAsync
	described := cheap("100", "0x01")
	described.Description = "the premium files"
	for _, r := range routesOf(t, settled, described) {
		if r == before[0] {
			t.Errorf("a gate configured otherwise than the first has its route %q", r)
		}
	}
}

// A reload that changes a gate's price and, with it, a setting of how it answers (max_buffer, cors_origins,
// async_backlog, payment_header, v1_body) keeps its route: a payment settled and cut short before the reload is
// judged by its record after it (found by a review of issue 28: such a reload answered it 402 value_mismatch).
func TestAGatesRouteStaysThroughAReloadOfItsPriceAndHowItAnswers(t *testing.T) {
	before := routesOf(t, &Gate{GateAccept: GateAccept{Amount: "100", PayTo: "0x01"}, MaxBuffer: 1 << 20})
	tuned := &Gate{GateAccept: GateAccept{Amount: "200", PayTo: "0x01"}, MaxBuffer: 2 << 20, AsyncBacklog: 7,
		CORSOrigins: []string{"https://a.example"}, PaymentHeader: "X-Pay", V1Body: true}
	if after := routesOf(t, tuned); after[0] != before[0] {
		t.Errorf("the route after a reload of the price and how the gate answers: %q, before %q", after[0], before[0])
	}
}

// A reload that turns access on, or changes how long and how often it lets in, keeps the route: the grants already
// written are keyed by it, and a payer whose grant stands must not be asked to pay again by a reload that
// lengthened it. The paths a grant covers are not a term: gates covering other paths are never configured alike,
// so that adding or removing a gate before them cannot hand one's grants to the other (review of s49).
func TestAGatesRouteStaysThroughAReloadOfItsAccess(t *testing.T) {
	before := routesOf(t, &Gate{GateAccept: GateAccept{Amount: "100", PayTo: "0x01"}})
	if after := routesOf(t, &Gate{GateAccept: GateAccept{Amount: "100", PayTo: "0x01"}, Access: &GateAccess{For: caddy.Duration(time.Hour)}}); after[0] != before[0] {
		t.Errorf("the route after a reload that turned access on: %q, before %q", after[0], before[0])
	}
	paths := routesOf(t, &Gate{GateAccept: GateAccept{Amount: "100", PayTo: "0x01"}, Access: &GateAccess{For: caddy.Duration(time.Hour), Paths: []string{"/b/*", "/a/*"}}})
	longer := &GateAccess{For: caddy.Duration(2 * time.Hour), Requests: 5, Paths: []string{"/a/*", "/b/*", "/a/*"}}
	if after := routesOf(t, &Gate{GateAccept: GateAccept{Amount: "200", PayTo: "0x01"}, Access: longer}); after[0] != paths[0] {
		t.Errorf("the route after a reload of the price and access to %+v: %q, before %q", *longer, after[0], paths[0])
	}
	if paths[0] == before[0] {
		t.Errorf("a gate whose grants cover /a/* and /b/* has the route of one without access, %q", paths[0])
	}
	if other := routesOf(t, &Gate{GateAccept: GateAccept{Amount: "100", PayTo: "0x01"}, Access: &GateAccess{For: caddy.Duration(time.Hour), Paths: []string{"/c/*"}}}); other[0] == paths[0] {
		t.Errorf("gates whose grants cover other paths have one route, %q", other[0])
	}
}

// A reload that retitles the paywall (or changes its logo, colour, template) keeps the route: how the 402 looks in
// a browser sells nothing, and the grants a payer bought are keyed by the route (the money-invariant run's browser
// lane: a sign-in refused "no payment bought access here" after a reload that retitled the page and back).
func TestAGatesRouteStaysThroughAReloadOfItsPaywall(t *testing.T) {
	before := routesOf(t, &Gate{GateAccept: GateAccept{Amount: "100", PayTo: "0x01"}})
	styled := &Gate{GateAccept: GateAccept{Amount: "100", PayTo: "0x01"}, Paywall: &GatePaywall{Title: "Members only", Color: "#123456"}}
	if after := routesOf(t, styled); after[0] != before[0] {
		t.Errorf("the route after a reload that styled the paywall: %q, before %q", after[0], before[0])
	}
}

// Adding or removing an mcp gate leaves the routes of the other gates of its server: an mcp gate and a gate that
// sells paths are never configured alike, whatever their terms. The grants access wrote are keyed by the route,
// and a grant of access's paths by the route alone (scope "*"): a gate renumbered into the place another gate had
// honours that gate's grants, and forgets its own (review of s49: 0190009 made an mcp block a term, so a reload
// that removed an mcp gate before two access gates gave the second the first's route).
func TestAddingOrRemovingAnMCPGateLeavesTheRoutesOfTheOtherGatesOfItsServer(t *testing.T) {
	sells := func(amount, paths string) *Gate {
		return &Gate{GateAccept: GateAccept{Amount: amount, PayTo: "0x01"},
			Access: &GateAccess{For: caddy.Duration(time.Hour), Paths: []string{paths}}}
	}
	tools := &Gate{GateAccept: GateAccept{PayTo: "0x01"}, MCP: &GateMCP{Tools: map[string]string{"search": "$0.01"}}}
	with := routesOf(t, tools, sells("100", "/basic/*"), sells("10000", "/premium/*"))
	without := routesOf(t, sells("100", "/basic/*"), sells("10000", "/premium/*"))
	if without[0] != with[1] || without[1] != with[2] {
		t.Errorf("the routes of two access gates after a reload removed the mcp gate before them: %q, before %q", without, with[1:])
	}
	if without[1] == with[1] {
		t.Errorf("the /premium/* gate took the route %q the /basic/* gate had: it honours the grants bought there", with[1])
	}
}
