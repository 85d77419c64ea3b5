package caddymodule

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"sync"

	"github.com/caddyserver/caddy/v2"
	"go.uber.org/zap"

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
	logger *zap.Logger
	served *statusServed
}

// statusServed is the x402 app the status was last asked of, and the server of its health.
type statusServed struct {
	mu     sync.Mutex
	app    *App
	server *facilitatorserver.Server // of app; its health cache lives as long as app runs
}

// CaddyModule returns the Caddy module information.
func (AdminStatus) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "admin.api.x402",
		New: func() caddy.Module { return new(AdminStatus) },
	}
}

// Provision looks nothing up: Caddy provisions the admin API before the config's apps, and an x402 app
// provisioned from here would report its configuration errors as this module's (and without Caddy's
// "provision x402:"). The app is found when asked for, in the config that runs then.
func (a *AdminStatus) Provision(ctx caddy.Context) error {
	a.logger, a.served = ctx.Logger(), new(statusServed)
	return nil
}

// statusServer is the server of the running config's x402 app, made again when a reload brought another app.
// Only a config that has started is asked (caddy.ActiveContext), whose apps are no longer being provisioned.
func (a *AdminStatus) statusServer() (*facilitatorserver.Server, error) {
	v, err := caddy.ActiveContext().AppIfConfigured("x402")
	if err != nil {
		return nil, err
	}
	app, ok := v.(*App)
	if !ok {
		return nil, fmt.Errorf("the x402 app is a %T", v)
	}
	st := a.served
	st.mu.Lock()
	defer st.mu.Unlock()
	if st.app != app {
		srv, err := facilitatorserver.New(appEngine{app}, facilitatorserver.Options{
			Await: app.awaitStart, Redact: app.rpcRedactor().Replace, Logger: a.logger,
		})
		if err != nil {
			return nil, fmt.Errorf("x402 status: %w", err)
		}
		st.app, st.server = app, srv
	}
	return st.server, nil
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
	srv, err := a.statusServer()
	if errors.Is(err, caddy.ErrNotConfigured) {
		return caddy.APIError{HTTPStatus: http.StatusNotFound, Err: errors.New("the running config has no x402 app: there is no x402 status to show")}
	}
	if err != nil {
		return caddy.APIError{HTTPStatus: http.StatusServiceUnavailable, Err: fmt.Errorf("the x402 app is not running: %w", err)}
	}
	srv.ServeHealth(w, r)
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
	// An engine waiting for its chain (App.startWithoutChain) is down, saying since when and why.
	if waiting, err := e.app.engineDown(); waiting {
		return e.app.downHealth(err.(*x402.FacilitatorError).Err.Error()), nil
	} else if err != nil {
		return x402.HealthResponse{}, err
	}
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
