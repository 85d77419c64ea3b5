package caddymodule

import (
	"net/url"
	"sort"
	"strings"

	"github.com/caddyserver/caddy/v2"

	"github.com/x402-gateway/caddy-x402/chain"
)

// rpcRedactor returns a replacer that turns the app's RPC URLs into scheme://host wherever they appear in a
// text, as configured or as Go's HTTP client prints them in a transport error ("Post \"https://…\": EOF").
// Node providers put API keys in the path or query of the URL, and engine errors reach HTTP answers and logs.
func (a *App) rpcRedactor() *strings.Replacer {
	repl := caddy.NewReplacer()
	type pair struct{ long, short string }
	var pairs []pair
	for _, n := range a.Networks {
		for _, raw := range n.RPC {
			u := repl.ReplaceAll(raw, "")
			short := chain.RedactRPCURL(u)
			forms := []string{u}
			if p, err := url.Parse(u); err == nil {
				forms = append(forms, p.String(), p.Redacted())
			}
			for _, f := range forms {
				if f != "" && f != short {
					pairs = append(pairs, pair{f, short})
				}
			}
		}
	}
	// The replacer tries its pairs in order: a URL that extends another must be tried first.
	sort.SliceStable(pairs, func(i, j int) bool { return len(pairs[i].long) > len(pairs[j].long) })
	args := make([]string, 0, 2*len(pairs))
	for _, p := range pairs {
		args = append(args, p.long, p.short)
	}
	return strings.NewReplacer(args...)
}
