// Package caddyx402 lets xcaddy build this module into Caddy: importing it registers the x402 modules.
package caddyx402

import (
	_ "github.com/x402-gateway/caddy-x402/caddymodule"
)
