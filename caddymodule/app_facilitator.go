package caddymodule

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"sort"
	"strings"

	"github.com/caddyserver/caddy/v2"

	"github.com/x402-gateway/caddy-x402/chain"
	"github.com/x402-gateway/caddy-x402/facilitatorclient"
	"github.com/x402-gateway/caddy-x402/x402"
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

// facilitatorProblem says what went wrong with a facilitator call in words fit for any caller: the kind of
// failure and the HTTP status, never the facilitator's URL, the hosts behind it, or its own error text.
func facilitatorProblem(err error) string {
	var fe *x402.FacilitatorError
	if !errors.As(err, &fe) {
		return "an internal error"
	}
	var what string
	switch {
	case errors.Is(err, facilitatorclient.ErrNotSent):
		what = "no connection could be made"
	case errors.Is(err, context.DeadlineExceeded):
		what = "no answer came in time"
	case fe.Kind == x402.FailureBadAnswer && fe.Status >= 300 && fe.Status < 400:
		return fmt.Sprintf("the answer was a redirect (HTTP %d), which is not followed", fe.Status)
	case fe.Kind == x402.FailureBadAnswer:
		what = "the answer was not a facilitator response"
	case fe.Kind == x402.FailureRejected && fe.Status == 0:
		what = "no facilitator serves this kind of payment" // a failover set that asked no member
	case fe.Kind == x402.FailureRejected:
		what = "the request was refused"
	default:
		what = "no answer came"
	}
	if fe.Status != 0 {
		what += fmt.Sprintf(" (HTTP %d)", fe.Status)
	}
	return what
}
