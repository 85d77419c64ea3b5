package caddymodule_test

import (
	"encoding/json"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig"

	"github.com/x402-gateway/caddy-x402/caddymodule"
)

// adaptGate adapts a Caddyfile and returns the handlers of its first site's route, in order, as JSON objects.
func adaptGate(t *testing.T, caddyfile string) []map[string]any {
	t.Helper()
	raw, _, err := caddyconfig.GetAdapter("caddyfile").Adapt([]byte(caddyfile), map[string]any{"filename": "Caddyfile"})
	if err != nil {
		t.Fatalf("adapting: %v", err)
	}
	var cfg struct {
		Apps struct {
			HTTP struct {
				Servers map[string]struct {
					Routes []struct {
						Handle []map[string]any `json:"handle"`
					} `json:"routes"`
				} `json:"servers"`
			} `json:"http"`
		} `json:"apps"`
	}
	if err := json.Unmarshal(raw, &cfg); err != nil {
		t.Fatal(err)
	}
	var handlers []map[string]any
	for _, srv := range cfg.Apps.HTTP.Servers {
		for _, r := range srv.Routes {
			handlers = append(handlers, flattenHandlers(r.Handle)...)
		}
	}
	return handlers
}

// flattenHandlers lists handlers in the order a request meets them, looking into subroutes.
func flattenHandlers(list []map[string]any) []map[string]any {
	var out []map[string]any
	for _, h := range list {
		if h["handler"] != "subroute" {
			out = append(out, h)
			continue
		}
		routes, _ := h["routes"].([]any)
		for _, r := range routes {
			handle, _ := r.(map[string]any)["handle"].([]any)
			var inner []map[string]any
			for _, x := range handle {
				inner = append(inner, x.(map[string]any))
			}
			out = append(out, flattenHandlers(inner)...)
		}
	}
	return out
}

func TestTheX402DirectiveAdaptsEveryOptionToTheGateHandler(t *testing.T) {
	handlers := adaptGate(t, `:8080
x402 /paid/* $0.002 {
	pay_to 0x05e11e75e11e75e11e75e11e75e11e75e11e75e1
	network eip155:72344
	asset 0xFCc9EBb7682E831668990F8333F2Ea453bFDD563
	asset_transfer_method permit2
	token_name "Stable Coin"
	token_version 1
	max_timeout 90s
	facilitator https://facilitator.example.com
	facilitator_api_key {env.FACILITATOR_KEY}
	facilitator_timeout 30s
	payment_header X-Pay
	description "Premium article"
	mime_type text/html
	settle async 5000
	max_buffer 2MiB
	v1_body
	payment_identifier required
	gas_sponsoring erc20_approval
	accept {
		network eip155:723487
		amount 5000
		asset_transfer_method erc2612
	}
	accept {
		pay_to 0x000000000000000000000000000000000000bEEF
	}
	accept {
		asset 0x036CbD53842c5426634e7929541eC2318f3dCF7e
		asset_transfer_method eip3009
		token_name "USD Coin"
		token_version 2
		token_eip3009
	}
}
respond "paid"
`)
	if len(handlers) != 2 || handlers[0]["handler"] != "x402" || handlers[1]["handler"] != "static_response" {
		t.Fatalf("handlers = %v, want the gate, then respond", handlers)
	}
	got := handlers[0]
	delete(got, "handler")
	want := map[string]any{
		"price": "$0.002", "pay_to": "0x05e11e75e11e75e11e75e11e75e11e75e11e75e1", "network": "eip155:72344",
		"asset": "0xFCc9EBb7682E831668990F8333F2Ea453bFDD563", "asset_transfer_method": "permit2",
		"token_name": "Stable Coin", "token_version": "1", "max_timeout": float64(90 * time.Second),
		"facilitator_url": "https://facilitator.example.com", "facilitator_api_key": "{env.FACILITATOR_KEY}",
		"facilitator_timeout": float64(30 * time.Second), "payment_header": "X-Pay", "description": "Premium article", "mime_type": "text/html", "settle": "async",
		"async_backlog": float64(5000), "max_buffer": float64(2 << 20), "v1_body": true, "payment_identifier": "required",
		"gas_sponsoring": []any{"erc20ApprovalGasSponsoring"},
		"accepts": []any{
			map[string]any{"network": "eip155:723487", "amount": "5000", "asset_transfer_method": "erc2612"},
			map[string]any{"pay_to": "0x000000000000000000000000000000000000bEEF"},
			map[string]any{"asset": "0x036CbD53842c5426634e7929541eC2318f3dCF7e", "asset_transfer_method": "eip3009",
				"token_name": "USD Coin", "token_version": "2", "token_eip3009": true},
		},
	}
	if !reflect.DeepEqual(got, want) {
		gotJSON, _ := json.MarshalIndent(got, "", "  ")
		t.Fatalf("adapted gate =\n%s\nwant %v", gotJSON, want)
	}
}

func TestTheX402DirectivesAccessAdaptsToTheGatesAccess(t *testing.T) {
	for _, tc := range []struct {
		block string
		want  map[string]any
	}{
		{"access 1h", map[string]any{"for": float64(time.Hour)}},
		{"access 30m {\n\t\trequests 100\n\t\tpaths /paid/* /reports/q3\n\t}",
			map[string]any{"for": float64(30 * time.Minute), "requests": float64(100), "paths": []any{"/paid/*", "/reports/q3"}}},
		{"access 1h {\n\t\tgrant members\n\t}", map[string]any{"for": float64(time.Hour), "grant": "members"}},
	} {
		handlers := adaptGate(t, ":8080\nx402 /paid/* $0.002 {\n\tpay_to 0x05e11e75e11e75e11e75e11e75e11e75e11e75e1\n\t"+tc.block+"\n}\nrespond paid\n")
		if got := handlers[0]["access"]; !reflect.DeepEqual(got, tc.want) {
			t.Errorf("%q adapts to access %v, want %v", tc.block, got, tc.want)
		}
	}
}

func TestTheX402DirectiveRunsBeforeTheHandlersThatAnswerWithoutARouteBlock(t *testing.T) {
	for _, answerer := range []string{`respond "x"`, "file_server", "reverse_proxy 127.0.0.1:9", `encode gzip
	respond "x"`} {
		// The gate is written last; the directive order still puts it first.
		handlers := adaptGate(t, ":8080\n"+answerer+"\nx402 {\n\tpay_to 0x05e11e75e11e75e11e75e11e75e11e75e11e75e1\n\tprice $0.01\n}\n")
		if len(handlers) < 2 || handlers[0]["handler"] != "x402" {
			names := []any{}
			for _, h := range handlers {
				names = append(names, h["handler"])
			}
			t.Errorf("with %q the handlers run in the order %v, want x402 first", answerer, names)
		}
	}
}

func TestBadX402DirectivesAreRefusedNamingTheProblem(t *testing.T) {
	for _, tc := range []struct{ name, block, want string }{
		{"unknown option", "colour blue", "unrecognized x402 option 'colour'"},
		{"unknown settle mode", "settle later", "settle 'later'"},
		{"a backlog for a mode that has none", "settle after 100", "only async takes a backlog"},
		{"a backlog that is not a number", "settle async many", "only async takes a backlog"},
		{"settle with too many arguments", "settle async 1 2", "wrong argument count"},
		{"unknown transfer method", "asset_transfer_method upto", "asset_transfer_method 'upto': want permit2, eip3009 or erc2612"},
		{"token_eip3009 with an argument", "token_eip3009 yes", "token_eip3009 takes no argument"},
		{"price and amount", "price $0.01\n\tamount 10000", "either price or amount"},
		{"pay_to without an address", "pay_to", "pay_to needs exactly one argument"},
		{"bad duration", "max_timeout soon", "max_timeout"},
		{"unknown accept option", "accept {\n\t\tcolour blue\n\t}", "unrecognized accept option 'colour'"},
		{"accept with an argument", "accept now {\n\t}", "wrong argument count"},
		{"v1_body with an argument", "v1_body yes", "wrong argument count"},
		{"payment_identifier in another mode", "payment_identifier always", "payment_identifier 'always': want optional or required"},
		{"payment_identifier with two modes", "payment_identifier optional required", "wrong argument count"},
		{"gas_sponsoring of nothing", "gas_sponsoring", "gas_sponsoring takes the extensions to declare"},
		{"gas_sponsoring of an unknown extension", "gas_sponsoring permit2", "gas_sponsoring 'permit2': want eip2612, erc20_approval, or off"},
		{"gas_sponsoring naming one twice", "gas_sponsoring erc20_approval erc20_approval", "gas_sponsoring names 'erc20_approval' twice"},
		{"gas_sponsoring off with another", "gas_sponsoring off eip2612", "gas_sponsoring off declares none"},
		{"gas_sponsoring twice", "gas_sponsoring eip2612\n\tgas_sponsoring off", "gas_sponsoring is configured twice"},
		{"access without a duration", "access", "access needs a duration"},
		{"access that is no duration", "access soon", "access 'soon': want a positive duration"},
		{"access of no time", "access 0s", "access '0s'"},
		{"access with two durations", "access 1h 2h", "wrong argument count"},
		{"access requests that are no number", "access 1h {\n\t\trequests many\n\t}", "access requests 'many'"},
		{"access requests of none", "access 1h {\n\t\trequests 0\n\t}", "access requests '0'"},
		{"access paths of none", "access 1h {\n\t\tpaths\n\t}", "wrong argument count"},
		{"access path not from the root", "access 1h {\n\t\tpaths reports/*\n\t}", "must start with '/'"},
		{"access path with a star inside", "access 1h {\n\t\tpaths /a/*/b\n\t}", "only at its end"},
		{"access unknown option", "access 1h {\n\t\tcolour blue\n\t}", "unrecognized access option 'colour'"},
		{"access grant of a bad name", "access 1h {\n\t\tgrant gold/members\n\t}", `grant "gold/members" must be`},
		{"access grant of two names", "access 1h {\n\t\tgrant gold members\n\t}", "wrong argument count"},
		{"access with settle async", "settle async\n\taccess 1h", "settle async serves before settling"},
		{"max_buffer that is not a size", "max_buffer lots", "max_buffer 'lots'"},
		{"max_buffer of nothing", "max_buffer 0", "max_buffer '0'"},
		{"max_buffer without a size", "max_buffer", "wrong argument count"},
		{"facilitator without a value", "facilitator", "facilitator needs one argument"},
		{"facilitator_timeout that is no duration", "facilitator_timeout soon", "facilitator_timeout"},
		{"facilitator_timeout of zero", "facilitator_timeout 0s", "facilitator_timeout 0s is not a positive duration"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, _, err := caddyconfig.GetAdapter("caddyfile").Adapt([]byte(":8080\nx402 {\n\t"+tc.block+"\n}\nrespond ok\n"),
				map[string]any{"filename": "Caddyfile"})
			if err == nil || !strings.Contains(err.Error(), tc.want) || !strings.Contains(err.Error(), "Caddyfile:") {
				t.Fatalf("adapt error = %v, want one naming the line and containing %q", err, tc.want)
			}
		})
	}
}

func TestGateConfigurationsThatCannotWorkAreRefusedWhenLoaded(t *testing.T) {
	const payTo = "0x05e11e75e11e75e11e75e11e75e11e75e11e75e1"
	const asset = "0xFCc9EBb7682E831668990F8333F2Ea453bFDD563"
	for _, tc := range []struct{ name, block, want string }{
		{"no recipient", "price $0.01\n\tnetwork eip155:72344\n\tasset " + asset + "\n\tfacilitator http://127.0.0.1:9", "no recipient"},
		{"recipient not an address", "pay_to alice\n\tprice $0.01\n\tnetwork eip155:72344\n\tasset " + asset + "\n\tfacilitator http://127.0.0.1:9", `pay_to "alice" is not an address`},
		{"no price", "pay_to " + payTo + "\n\tnetwork eip155:72344\n\tasset " + asset + "\n\tfacilitator http://127.0.0.1:9", "no price"},
		{"zero price", "pay_to " + payTo + "\n\tprice $0\n\tnetwork eip155:72344\n\tasset " + asset + "\n\tfacilitator http://127.0.0.1:9", "price is zero"},
		{"price finer than the token", "pay_to " + payTo + "\n\tprice $0.0000001\n\tnetwork eip155:72344\n\tasset " + asset + "\n\tfacilitator http://127.0.0.1:9", "decimal places"},
		{"negative amount", "pay_to " + payTo + "\n\tamount -5\n\tnetwork eip155:72344\n\tasset " + asset + "\n\tfacilitator http://127.0.0.1:9", "amount"},
		{"no network and no app network", "pay_to " + payTo + "\n\tprice $0.01\n\tfacilitator http://127.0.0.1:9", "no network"},
		{"bad network", "pay_to " + payTo + "\n\tprice $0.01\n\tnetwork base\n\tasset " + asset + "\n\tfacilitator http://127.0.0.1:9", "network"},
		{"no asset for an unconfigured network", "pay_to " + payTo + "\n\tprice $0.01\n\tnetwork eip155:72344\n\tfacilitator http://127.0.0.1:9", "no asset for eip155:72344"},
		{"embedded without a network in the app", "pay_to " + payTo + "\n\tprice $0.01\n\tnetwork eip155:72344\n\tasset " + asset, "no facilitator"},
		{"facilitator URL with a query", "pay_to " + payTo + "\n\tprice $0.01\n\tnetwork eip155:72344\n\tasset " + asset + "\n\tfacilitator http://127.0.0.1:9/?key=1", "query"},
		{"timeout under a second", "pay_to " + payTo + "\n\tprice $0.01\n\tnetwork eip155:72344\n\tasset " + asset + "\n\tmax_timeout 10ms\n\tfacilitator http://127.0.0.1:9", "max_timeout"},
		{"payment_identifier in another mode", "pay_to " + payTo + "\n\tprice $0.01\n\tnetwork eip155:72344\n\tasset " + asset + "\n\tfacilitator http://127.0.0.1:9\n\tpayment_identifier always", "payment_identifier 'always'"},
		{"the version 1 header as payment_header", "pay_to " + payTo + "\n\tprice $0.01\n\tnetwork eip155:72344\n\tasset " + asset + "\n\tpayment_header X-Payment\n\tfacilitator http://127.0.0.1:9", "version 1 header"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := loadGateConfig(t, "{\n\tx402 {\n\t\tjournal {{DATA}}/j.db\n\t}\n}\nhttp://127.0.0.1:0 {\n\tx402 {\n\t"+tc.block+"\n\t}\n\trespond ok\n}\n")
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("load error = %v, want one containing %q", err, tc.want)
			}
		})
	}
}

// loadGateConfig loads a Caddyfile that is expected to be refused and returns why: as it is read (a value the
// Caddyfile checks, naming its line), or as it loads; a config that loads is stopped again.
func loadGateConfig(t *testing.T, caddyfile string) error {
	t.Helper()
	caddyMu.Lock()
	defer caddyMu.Unlock()
	dir := t.TempDir()
	caddyfile = strings.ReplaceAll(caddyfile, "{{DATA}}", dir)
	if _, _, err := caddyconfig.GetAdapter("caddyfile").Adapt([]byte(caddyfile), map[string]any{"filename": "Caddyfile"}); err != nil {
		if !strings.Contains(err.Error(), "Caddyfile:") {
			t.Errorf("the Caddyfile's error %q names no line", err)
		}
		return err
	}
	cfg := adaptCaddyfile(t, caddyfile, dir)
	err := caddy.Load(cfg, true)
	if err == nil {
		_ = caddy.Stop()
	}
	return err
}

// gas_sponsoring off adapts to an empty list (declare none), which JSON keeps apart from no list (declare all).
func TestGasSponsoringOffAdaptsToAnEmptyList(t *testing.T) {
	handlers := adaptGate(t, ":8080\nx402 {\n\tgas_sponsoring off\n}\nrespond ok\n")
	if got, ok := handlers[0]["gas_sponsoring"].([]any); !ok || len(got) != 0 {
		t.Fatalf("gas_sponsoring off adapted to %#v, want []", handlers[0]["gas_sponsoring"])
	}
}

func TestAGateInJSONNamingAnUnknownGasSponsoringExtensionIsRefused(t *testing.T) {
	names := []string{"eip2612"}
	g := &caddymodule.Gate{Settle: caddymodule.SettleAfter, GasSponsoring: &names}
	if err := g.Validate(); err == nil || !strings.Contains(err.Error(), `gas_sponsoring "eip2612" is not a gas-sponsoring extension`) {
		t.Fatalf("Validate() = %v, want it to name gas_sponsoring \"eip2612\"", err)
	}
}

func TestAGateInJSONWithAnUnknownPaymentIdentifierModeIsRefused(t *testing.T) {
	g := &caddymodule.Gate{Settle: caddymodule.SettleAfter, PaymentIdentifier: "always"}
	if err := g.Validate(); err == nil || !strings.Contains(err.Error(), `payment_identifier "always"`) {
		t.Fatalf("Validate() = %v, want it to name payment_identifier \"always\"", err)
	}
}

func TestAGateInJSONWithAccessItCannotGrantIsRefused(t *testing.T) {
	for _, tc := range []struct {
		name   string
		settle string
		access caddymodule.GateAccess
		want   string
	}{
		{"no time", caddymodule.SettleAfter, caddymodule.GateAccess{}, "positive time"},
		{"negative requests", caddymodule.SettleAfter, caddymodule.GateAccess{For: caddy.Duration(time.Hour), Requests: -1}, "requests"},
		{"settle async", caddymodule.SettleAsync, caddymodule.GateAccess{For: caddy.Duration(time.Hour)}, "settle async"},
		{"a relative path", caddymodule.SettleAfter, caddymodule.GateAccess{For: caddy.Duration(time.Hour), Paths: []string{"x"}}, "start with '/'"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			g := &caddymodule.Gate{Settle: tc.settle, Access: &tc.access}
			if err := g.Validate(); err == nil || !strings.Contains(err.Error(), tc.want) || !strings.Contains(err.Error(), "access") {
				t.Fatalf("Validate() = %v, want it to name access and %q", err, tc.want)
			}
		})
	}
}

func TestASignInOnlyX402DirectiveAdaptsAndIsRefusedWithoutAGrantOrAPayee(t *testing.T) {
	const payTo = "0x05e11e75e11e75e11e75e11e75e11e75e11e75e1"
	handlers := adaptGate(t, ":8080\nx402 /members/* {\n\tsign_in_only\n\tpay_to "+payTo+"\n\taccess 1h {\n\t\tgrant members\n\t}\n}\nrespond members\n")
	if handlers[0]["sign_in_only"] != true || handlers[0]["pay_to"] != payTo ||
		!reflect.DeepEqual(handlers[0]["access"], map[string]any{"for": float64(time.Hour), "grant": "members"}) {
		t.Errorf("the sign-in-only gate adapts to %v", handlers[0])
	}
	if _, ok := handlers[0]["price"]; ok {
		t.Errorf("the sign-in-only gate adapts with a price: %v", handlers[0])
	}
	for _, tc := range []struct{ name, block, want string }{
		{"no access", "sign_in_only\n\tpay_to " + payTo, "name the grant it honours"},
		{"access without a grant name", "sign_in_only\n\tpay_to " + payTo + "\n\taccess 1h", "name the grant it honours"},
		{"no pay_to", "sign_in_only\n\taccess 1h {\n\t\tgrant members\n\t}", "pay_to is required"},
		{"a price", "sign_in_only\n\tpay_to " + payTo + "\n\tprice $0.01\n\taccess 1h {\n\t\tgrant members\n\t}", "sells nothing"},
		{"a priced way to pay", "sign_in_only\n\tpay_to " + payTo + "\n\taccess 1h {\n\t\tgrant members\n\t}\n\taccept {\n\t\tamount 10\n\t}", "sells nothing"},
		{"an argument", "sign_in_only yes\n\tpay_to " + payTo + "\n\taccess 1h {\n\t\tgrant members\n\t}", "wrong argument count"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			// The gate's sign_in_only is on line 3 of the file.
			adaptError(t, ":8080\nx402 {\n\t"+tc.block+"\n}\nrespond ok\n", "Caddyfile:3", tc.want)
		})
	}
	// The price given as the directive's argument is refused too.
	adaptError(t, ":8080\nx402 $0.01 {\n\tsign_in_only\n\tpay_to "+payTo+"\n\taccess 1h {\n\t\tgrant members\n\t}\n}\nrespond ok\n", "Caddyfile:3", "sells nothing")
}
