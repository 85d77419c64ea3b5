package facilitatorserver

import (
	"bytes"
	"cmp"
	_ "embed"
	"encoding/json"
	"fmt"
	"html/template"
	"math/big"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/x402-gateway/caddy-x402/x402"
)

// healthPageHTML is the /health page a browser gets: the same document as the JSON, laid out for a person.
// Everything it needs is in it (no script, no font, no stylesheet from elsewhere).
//
//go:embed healthpage.html
var healthPageHTML string

var healthPage = template.Must(template.New("health").Parse(healthPageHTML))

// HealthDoc is a /health answer as a person's view reads it: the document, an error text when there is one,
// and per network the fields this version does not know, so that a newer facilitator's state still shows.
type HealthDoc struct {
	Status   string
	Error    string
	Networks []NetworkDoc
	Refusals *x402.RefusalsHealth
}

// NetworkDoc is one network of a HealthDoc.
type NetworkDoc struct {
	x402.NetworkHealth
	// Extra are the network's fields x402.NetworkHealth does not have, by name, each a string, a number or
	// its JSON.
	Extra []ExtraField
}

// ExtraField is a field of a network's health that this version does not lay out itself.
type ExtraField struct{ Name, Value string }

// knownNetworkFields are the fields of x402.NetworkHealth.
var knownNetworkFields = map[string]bool{"network": true, "status": true, "rpcReachable": true, "headBlock": true,
	"headAgeSeconds": true, "wallets": true, "journalBacklog": true, "error": true, "pendingSettlements": true,
	"oldestPendingSeconds": true}

// ReadHealth reads a /health answer (an x402.HealthResponse, or an error document with status and error).
func ReadHealth(doc []byte) (HealthDoc, error) {
	var raw struct {
		Status   string               `json:"status"`
		Error    string               `json:"error"`
		Networks []json.RawMessage    `json:"networks"`
		Refusals *x402.RefusalsHealth `json:"refusals"`
	}
	if err := json.Unmarshal(doc, &raw); err != nil {
		return HealthDoc{}, fmt.Errorf("reading the health document: %w", err)
	}
	h := HealthDoc{Status: raw.Status, Error: raw.Error, Refusals: raw.Refusals}
	for i, rn := range raw.Networks {
		var n NetworkDoc
		var all map[string]any
		if err := json.Unmarshal(rn, &n.NetworkHealth); err != nil {
			return HealthDoc{}, fmt.Errorf("reading network #%d of the health document: %w", i+1, err)
		}
		if err := json.Unmarshal(rn, &all); err != nil {
			return HealthDoc{}, fmt.Errorf("reading network #%d of the health document: %w", i+1, err)
		}
		for name, val := range all {
			if !knownNetworkFields[name] {
				n.Extra = append(n.Extra, ExtraField{Name: name, Value: extraValue(val)})
			}
		}
		slices.SortFunc(n.Extra, func(a, b ExtraField) int { return strings.Compare(a.Name, b.Name) })
		h.Networks = append(h.Networks, n)
	}
	return h, nil
}

// healthView is the health document as the page shows it.
type healthView struct {
	Status, Error, Now string
	Networks           []networkView
	Refusals           *refusalsView
}

type networkView struct {
	NetworkDoc
	HeadAge, OldestPending string
	Wallets                []walletView
}

type walletView struct {
	Address, Balance, Wei string
	Low                   bool
	InFlight              int
}

type refusalsView struct {
	Total  int
	Counts []x402.RefusalCount
	Recent []refusalView
}

type refusalView struct {
	x402.Refusal
	At string
}

// WriteHealthPage writes body, a /health answer (an x402.HealthResponse, or an error document), as the page for a
// person with the given status, and returns the number of body bytes written.
func WriteHealthPage(w http.ResponseWriter, status int, body any) int {
	page, err := renderHealthPage(body, time.Now())
	if err != nil {
		page = []byte("<!DOCTYPE html><title>x402 facilitator</title><p>The health page could not be made: " +
			template.HTMLEscapeString(err.Error()) + "</p>")
		status = http.StatusInternalServerError
	}
	h := w.Header()
	h.Set("Content-Type", "text/html; charset=utf-8")
	h.Set("Cache-Control", "no-store")
	h.Set("Content-Security-Policy", "default-src 'none'; style-src 'unsafe-inline'; frame-ancestors 'none'")
	h.Set("X-Content-Type-Options", "nosniff")
	w.WriteHeader(status)
	n, _ := w.Write(page)
	return n
}

// renderHealthPage lays body out as HTML. It reads body through its JSON, as any client would, so that fields it
// does not know are shown rather than lost.
func renderHealthPage(body any, now time.Time) ([]byte, error) {
	doc, err := json.Marshal(body)
	if err != nil {
		return nil, fmt.Errorf("encoding the health document: %w", err)
	}
	h, err := ReadHealth(doc)
	if err != nil {
		return nil, err
	}
	v := healthView{Status: cmp.Or(h.Status, "unknown"), Error: h.Error, Now: now.UTC().Format("2006-01-02 15:04:05 UTC")}
	for _, n := range h.Networks {
		nv := networkView{NetworkDoc: n, HeadAge: "unknown"}
		nv.Status = cmp.Or(n.Status, "unknown")
		if n.RPCReachable {
			nv.HeadAge = FormatHeadAge(n.HeadAgeSeconds)
		}
		if n.OldestPendingSeconds > 0 {
			nv.OldestPending = FormatAge(n.OldestPendingSeconds)
		}
		for _, w := range n.Wallets {
			nv.Wallets = append(nv.Wallets, walletView{Address: w.Address, Balance: FormatNative(w.Balance), Wei: w.Balance, Low: w.Low, InFlight: w.InFlight})
		}
		v.Networks = append(v.Networks, nv)
	}
	if r := h.Refusals; r != nil {
		rv := &refusalsView{Total: r.Total, Counts: r.Counts}
		for _, one := range r.Recent {
			rv.Recent = append(rv.Recent, refusalView{Refusal: one, At: one.At.UTC().Format("2006-01-02 15:04:05") + " (" + FormatAge(now.Sub(one.At).Seconds()) + " ago)"})
		}
		v.Refusals = rv
	}
	var out bytes.Buffer
	if err := healthPage.Execute(&out, v); err != nil {
		return nil, fmt.Errorf("laying out the health page: %w", err)
	}
	return out.Bytes(), nil
}

// extraValue shows a field the page does not know: a string or a number as it is, anything else as its JSON.
func extraValue(v any) string {
	switch v := v.(type) {
	case string:
		return v
	case nil:
		return "none"
	case float64:
		return strconv.FormatFloat(v, 'f', -1, 64)
	}
	b, err := json.Marshal(v)
	if err != nil {
		return fmt.Sprint(v)
	}
	return string(b)
}

// FormatAge says how long seconds is for a person: "4.2 s", "25 s", "2 min 5 s", "3 h 20 min", "2 d 4 h".
func FormatAge(seconds float64) string {
	if seconds < 0 {
		return "-" + FormatAge(-seconds)
	}
	s := int64(seconds)
	switch {
	case seconds < 10:
		return strconv.FormatFloat(seconds, 'f', 1, 64) + " s"
	case s < 60:
		return fmt.Sprintf("%d s", s)
	case s < 3600:
		return fmt.Sprintf("%d min %d s", s/60, s%60)
	case s < 86400:
		return fmt.Sprintf("%d h %d min", s/3600, s%3600/60)
	}
	return fmt.Sprintf("%d d %d h", s/86400, s%86400/3600)
}

// FormatHeadAge says how old a head block is: "4.2 s old", or, for a block stamped later than this clock (a
// dev chain sealing a block per transaction runs ahead under load), "stamped 3.0 s ahead of this clock".
func FormatHeadAge(seconds float64) string {
	if seconds < 0 {
		return "stamped " + FormatAge(-seconds) + " ahead of this clock"
	}
	return FormatAge(seconds) + " old"
}

// FormatNative shows a native balance given in wei (decimal) in whole coins, to 6 decimals: "1.250000". A value
// that is not a decimal integer is shown as it came.
func FormatNative(wei string) string {
	n, ok := new(big.Int).SetString(wei, 10)
	if !ok {
		return wei
	}
	r := new(big.Rat).SetFrac(n, new(big.Int).Exp(big.NewInt(10), big.NewInt(18), nil))
	return r.FloatString(6)
}
