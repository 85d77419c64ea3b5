package caddymodule

import (
	"context"
	"errors"
	"fmt"
	"net/http"

	"github.com/caddyserver/caddy/v2"

	"github.com/x402-gateway/caddy-x402/facilitatorserver"
	"github.com/x402-gateway/caddy-x402/x402"
)

func init() {
	caddy.RegisterModule(AdminStatus{})
}

// adminStatusPath is where Caddy's admin API serves the x402 status, which `caddy x402 status` reads.
const adminStatusPath = "/x402/status"

// AdminStatus serves, on Caddy's admin API, GET /x402/status: what an x402_facilitator's /health says of the
// running config's embedded facilitator (networks' head age, wallets' balances and settlements in flight, the
// journal's backlog, the refusals), as JSON, or as a page when a browser asks. It says it through the same
// facilitatorserver as /health does, so RPC URLs are redacted the same way; nothing in it is a secret. It
// needs no handler in any route: the admin API, local to the machine by default, is where it lives.
type AdminStatus struct {
	server *facilitatorserver.Server // nil: the running config has no x402 app
}

// CaddyModule returns the Caddy module information.
func (AdminStatus) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "admin.api.x402",
		New: func() caddy.Module { return new(AdminStatus) },
	}
}

// Provision finds the config's x402 app, if it has one. The app's own errors are not this module's to report:
// Caddy reports them as it loads the app itself (Caddy's pki admin module does the same).
func (a *AdminStatus) Provision(ctx caddy.Context) error {
	v, err := ctx.AppIfConfigured("x402")
	if err != nil {
		return nil
	}
	app := v.(*App)
	srv, err := facilitatorserver.New(appEngine{app}, facilitatorserver.Options{
		Await: app.awaitStart, Redact: app.rpcRedactor().Replace, Logger: ctx.Logger(),
	})
	if err != nil {
		return fmt.Errorf("x402 status: %w", err)
	}
	a.server = srv
	return nil
}

// Routes returns the admin API's x402 routes.
func (a *AdminStatus) Routes() []caddy.AdminRoute {
	return []caddy.AdminRoute{{Pattern: adminStatusPath, Handler: caddy.AdminHandlerFunc(a.serveStatus)}}
}

func (a *AdminStatus) serveStatus(w http.ResponseWriter, r *http.Request) error {
	if r.URL.Path != adminStatusPath {
		return caddy.APIError{HTTPStatus: http.StatusNotFound, Err: fmt.Errorf("no x402 admin endpoint at %s; GET %s is the status", r.URL.Path, adminStatusPath)}
	}
	if r.Method != http.MethodGet && r.Method != http.MethodHead {
		w.Header().Set("Allow", "GET, HEAD")
		return caddy.APIError{HTTPStatus: http.StatusMethodNotAllowed, Err: fmt.Errorf("%s %s is not served; use GET", r.Method, adminStatusPath)}
	}
	if a.server == nil {
		return caddy.APIError{HTTPStatus: http.StatusNotFound, Err: errors.New("the running config has no x402 app: there is no x402 status to show")}
	}
	a.server.ServeHealth(w, r)
	return nil
}

// errNoEngine is the status of an x402 app that settles on no network itself: its gates' facilitators are
// remote, and each has its own /health.
var errNoEngine = errors.New("this x402 app has no embedded facilitator (it configures no network): its gates use remote facilitators, whose own /health shows their state")

// errStatusOnly answers a payment call, which the status never makes.
var errStatusOnly = errors.New("the x402 status serves health only")

// appEngine is the x402 app's embedded facilitator as the status sees it: its health, read when asked (the app
// has started by then: the server awaits it), or errNoEngine.
type appEngine struct{ app *App }

func (e appEngine) Health(ctx context.Context) (x402.HealthResponse, error) {
	f := e.app.Facilitator()
	if f == nil {
		return x402.HealthResponse{}, errNoEngine
	}
	return f.Health(ctx)
}

func (appEngine) Supported(context.Context) (x402.SupportedResponse, error) {
	return x402.SupportedResponse{}, errStatusOnly
}

func (appEngine) Verify(context.Context, x402.VerifyRequest) (x402.VerifyResponse, error) {
	return x402.VerifyResponse{}, errStatusOnly
}

func (appEngine) Settle(context.Context, x402.SettleRequest) (x402.SettleResponse, error) {
	return x402.SettleResponse{}, errStatusOnly
}

// Interface guards
var (
	_ caddy.AdminRouter = (*AdminStatus)(nil)
	_ caddy.Provisioner = (*AdminStatus)(nil)
	_ x402.Facilitator  = appEngine{}
)
