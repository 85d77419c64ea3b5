package caddymodule

import (
	"github.com/caddyserver/caddy/v2"
)

func init() {
	caddy.RegisterModule(App{})
}

// App is the `x402` Caddy app: the long-lived state that every x402 handler of a config shares.
type App struct{}

// CaddyModule returns the Caddy module information.
func (App) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "x402",
		New: func() caddy.Module { return new(App) },
	}
}

// Start starts the app.
func (*App) Start() error { return nil }

// Stop stops the app.
func (*App) Stop() error { return nil }

// Interface guards
var _ caddy.App = (*App)(nil)
