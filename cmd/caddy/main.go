// Command caddy is Caddy with its standard modules plus the x402 payment modules.
package main

import (
	caddycmd "github.com/caddyserver/caddy/v2/cmd"

	_ "github.com/caddyserver/caddy/v2/modules/standard"
	_ "github.com/x402-gateway/caddy-x402/caddymodule"
)

func main() {
	caddycmd.Main()
}
