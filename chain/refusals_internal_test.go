package chain

import (
	"fmt"
	"strings"
	"testing"
	"time"
)

// TestRefusalsStayBoundedAndKeepTheLatest: a stream of refusals with ever new reasons keeps at most
// recentRefusals of them, newest first, and at most refusalKinds counts plus one "other" line, while the total
// counts every one.
func TestRefusalsStayBoundedAndKeepTheLatest(t *testing.T) {
	var r refusals
	at := time.Unix(1_700_000_000, 0)
	const n = 1000
	for i := range n {
		r.note(at.Add(time.Duration(i)*time.Second), "verify", "eip155:8453", fmt.Sprintf("reason_%d", i), "")
	}
	h := r.health()
	if h.Total != n {
		t.Errorf("total %d, want %d", h.Total, n)
	}
	if len(h.Counts) != refusalKinds+1 {
		t.Errorf("%d count lines, want %d and one %q", len(h.Counts), refusalKinds, otherReason)
	}
	sum := 0
	for _, c := range h.Counts {
		sum += c.Count
		if c.Reason == otherReason && c.Count != n-refusalKinds {
			t.Errorf("%q counts %d, want %d", otherReason, c.Count, n-refusalKinds)
		}
	}
	if sum != n {
		t.Errorf("the counts add up to %d, want %d", sum, n)
	}
	if len(h.Recent) != recentRefusals {
		t.Fatalf("%d recent refusals, want %d", len(h.Recent), recentRefusals)
	}
	for i, one := range h.Recent {
		if want := fmt.Sprintf("reason_%d", n-1-i); one.Reason != want {
			t.Errorf("recent #%d is %q, want %q (newest first)", i, one.Reason, want)
		}
	}
}

// TestARefusalKeepsOnlyAWellFormedPayerAddress: the claimed payer is the payer's own text, so a refusal keeps it
// only as an address (checksummed), never as whatever text came.
func TestARefusalKeepsOnlyAWellFormedPayerAddress(t *testing.T) {
	for _, c := range []struct{ payer, want string }{
		{"0x000000000000000000000000000000000000dead", "0x000000000000000000000000000000000000dEaD"},
		{"<script>alert(1)</script>", ""},
		{strings.Repeat("a", 10_000), ""},
		{"", ""},
	} {
		var r refusals
		r.note(time.Now(), "settle", "eip155:8453", "insufficient_funds", c.payer)
		if got := r.health().Recent[0].Payer; got != c.want {
			t.Errorf("payer %.40q kept as %q, want %q", c.payer, got, c.want)
		}
	}
}

// TestARefusalOnANetworkTheEngineDoesNotServeIsCountedAsOther: the network of a refused request is the payer's
// text too; only a network the engine settles on is named.
func TestARefusalOnANetworkTheEngineDoesNotServeIsCountedAsOther(t *testing.T) {
	f := &Facilitator{networks: map[string]*network{"eip155:8453": nil}}
	if got := f.refusalNetwork("eip155:8453"); got != "eip155:8453" {
		t.Errorf("a served network is counted as %q", got)
	}
	if got := f.refusalNetwork("eip155:1<b>"); got != otherNetwork {
		t.Errorf("an unserved network is counted as %q, want %q", got, otherNetwork)
	}
}
