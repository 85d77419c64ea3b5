package e2e

import (
	"context"
	"crypto/sha256"
	"fmt"
	"io"
	"net/http"
	"slices"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/ethereum/go-ethereum/common"
	"github.com/ethereum/go-ethereum/crypto"

	"github.com/x402-gateway/caddy-x402/payer"
	"github.com/x402-gateway/caddy-x402/x402"
)

// The sign-in-with-x lane of the money-invariant run: the routes with `access` (invRoutes) sell a grant with
// each settled payment, and a payer that paid answers later 402s with a SIGN-IN-WITH-X header instead of paying.
// The action "sign in with x" pays there and signs in, at the gateway it paid or another, across the run's kills
// and reloads, sometimes more often than the grant allows, a header sent twice; a wallet that never paid signs in
// too, and sign-ins signed for another resource, route or gateway are sent. The checks judge what was served
// against what was bought on chain.

// invAccess is a route's access directive.
type invAccess struct {
	For      time.Duration
	Requests int64 // 0: any number
}

// What a sign-in was: the signer's own for the resource it is sent to, or one that must never be served.
const (
	siwxOwn      = "own"                       // a payer's own, for the resource it is sent to
	siwxReplay   = "sent again"                // a header of its own sent before (its nonce spent, if it was served)
	siwxStranger = "a wallet that never paid"  // a wallet that paid nothing anywhere
	siwxOtherRes = "signed for another path"   // the challenge of another path of the route
	siwxOtherRte = "signed for another route"  // the challenge of the other access route
	siwxOtherGw  = "signed at another gateway" // the challenge of another gateway (host)
)

// invSignIn is one sign-in sent and its answer.
type invSignIn struct {
	action      int
	gate        int // where it was sent
	from        int // the gateway whose challenge it answers
	kind        string
	wallet      common.Address
	route       *routeKind
	path        string
	header      [32]byte // the SIGN-IN-WITH-X value's hash
	headerValue string
	sent, got   time.Time
	status      int
	note        string
	servedRight bool // a 2xx carrying the resource asked for
	fromPage    bool // signed from the challenge a paywall page embeds, as the page's script signs in
}

func (s *invSignIn) served() bool { return s.status >= 200 && s.status < 300 }

func (s *invSignIn) String() string {
	st := "no answer"
	if s.status != 0 {
		st = fmt.Sprint(s.status)
	}
	return fmt.Sprintf("#%d gw%d (challenge of gw%d) %s GET %s by %s (%s): %s %s", s.action, s.gate, s.from, s.sent.Format("15:04:05.000"), s.path,
		s.wallet.Hex()[:10], s.kind, st, s.note)
}

// invSiwx is the lane's state in a run.
type invSiwx struct {
	once      sync.Once
	strangers []*payer.Payer // wallets that never pay

	mu      sync.Mutex
	signIns []*invSignIn
}

// strangerWallets are three wallets of fresh keys, which never pay anything.
func (r *invRun) strangerWallets() []*payer.Payer {
	r.siwx.once.Do(func() {
		for range 3 {
			key, err := crypto.GenerateKey()
			if err != nil {
				r.t.Fatal(err)
			}
			p, err := payer.New(key, payer.Options{})
			if err != nil {
				r.t.Fatal(err)
			}
			r.siwx.strangers = append(r.siwx.strangers, p)
		}
	})
	return r.siwx.strangers
}

// siwxKey is what the upstream counts the sign-ins it served of wallet on route under (invPaymentHeader).
func siwxKey(rk *routeKind, wallet common.Address) string {
	return "siwx " + rk.prefix + " " + strings.ToLower(wallet.Hex())
}

// signInWithX is the lane's action: mostly a payer signs in on an access route (after paying there, when it has
// no delivered payment there yet, half the time), one to five times in a row (more than a grant of 3 allows,
// sometimes), at the gateway drawn or another, one in six a header sent before; else a wallet that never paid
// signs in, or a sign-in signed for another path, route or gateway is sent.
func (w *invWorker) signInWithX(a *invAction) {
	r := w.r
	rk := w.pickRoute(func(rk *routeKind) bool { return rk.access != nil })
	path := rk.paths[w.rng.IntN(len(rk.paths))]
	gate := w.pickGate()
	switch n := w.rng.IntN(10); {
	case n == 0:
		strangers := r.strangerWallets()
		r.signInOnce(a, strangers[w.rng.IntN(len(strangers))], siwxStranger, gate, path, gate, path, "")
		return
	case n == 1:
		kind, toGate, toPath := siwxOtherRes, gate, path
		switch m := w.rng.IntN(3); {
		case m == 0 && len(r.w.gateways) > 1:
			kind, toGate = siwxOtherGw, (gate+1+w.rng.IntN(len(r.w.gateways)-1))%len(r.w.gateways)
		case m == 1:
			other := w.pickRoute(func(o *routeKind) bool { return o.access != nil && o != rk })
			kind, toPath = siwxOtherRte, other.paths[w.rng.IntN(len(other.paths))]
		default:
			for toPath == path {
				toPath = rk.paths[w.rng.IntN(len(rk.paths))]
			}
		}
		// From a wallet that holds a grant where it is sent (its payment on that route delivered), paying there
		// first when none does: refused, it is refused for what it was signed for, not for want of a grant.
		to := r.w.route(toPath)
		var holders []*invPayer
		for _, p := range r.snapshot() {
			if p.route == to && p.delivered() > 0 && p.transport < 0 {
				holders = append(holders, p.payer)
			}
		}
		var pp *invPayer
		if len(holders) > 0 {
			pp = holders[w.rng.IntN(len(holders))]
		} else {
			pp = w.pickPayer(to)
			if !w.payFirst(a, pp, to, toPath, toGate) {
				return
			}
		}
		r.signInOnce(a, pp.p, kind, gate, path, toGate, toPath, "")
		return
	}
	// A payer that paid here, three times in four when there is one.
	var paid []*invPayer
	for _, p := range r.snapshot() {
		if p.route == rk && p.delivered() > 0 && p.transport < 0 {
			paid = append(paid, p.payer)
		}
	}
	var pp *invPayer
	if len(paid) > 0 && w.rng.IntN(4) > 0 {
		pp = paid[w.rng.IntN(len(paid))]
	} else {
		pp = w.pickPayer(rk)
		if w.rng.IntN(2) == 0 && !w.payFirst(a, pp, rk, path, gate) {
			return
		}
	}
	// Each sign-in answers the challenge of a gateway drawn, and is sent there, or one time in three to another
	// gateway under the first one's host, as a load balancer in front of a cluster sends it: the grant and the
	// spent nonces are the cluster's. One in six sends the last header again, to its path, at a gateway drawn.
	// A sign-in refused as used up or ended has the payer pay again, half the time, once an action: a payment
	// while a grant stands extends it (the later end, the requests of both).
	last, lastFrom, lastPath, paidAgain := "", 0, "", false
	for range 1 + w.rng.IntN(5) {
		from, to := w.pickGate(), rk.paths[w.rng.IntN(len(rk.paths))]
		at := from
		if w.rng.IntN(3) == 0 {
			at = w.pickGate()
		}
		if last != "" && w.rng.IntN(6) == 0 {
			r.signInOnce(a, pp.p, siwxReplay, lastFrom, lastPath, at, lastPath, last)
			continue
		}
		s := r.signInOnce(a, pp.p, siwxOwn, from, to, at, to, "")
		if s == nil {
			continue
		}
		last, lastFrom, lastPath = s.headerValue, from, to
		if ended := strings.Contains(s.note, x402.SignInWithXGrantUsedUp) || strings.Contains(s.note, x402.SignInWithXGrantExpired); ended && !paidAgain && w.rng.IntN(2) == 0 {
			paidAgain = true
			res := invResource{http.MethodGet, to}
			p, err := w.signAs(pp, rk, res, at)
			if err != nil {
				a.say("gw%d %s: %v", at, res, shorten(err.Error()))
				continue
			}
			r.present(a, p, at, res, shapeGET, 0)
		}
	}
}

// signAs signs a payment of pp for res of rk at gateway gate and registers it.
// payFirst has pp pay for path of rk at gateway gate (a GET), before it signs in there; false when no payment could
// be signed, which the action says.
func (w *invWorker) payFirst(a *invAction, pp *invPayer, rk *routeKind, path string, gate int) bool {
	res := invResource{http.MethodGet, path}
	p, err := w.signAs(pp, rk, res, gate)
	if err != nil {
		a.say("gw%d %s: %v", gate, res, shorten(err.Error()))
		return false
	}
	w.r.present(a, p, gate, res, shapeGET, 0)
	return true
}

func (w *invWorker) signAs(pp *invPayer, rk *routeKind, res invResource, gate int) (*invPayment, error) {
	r := w.r
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	asked := time.Now()
	offer, err := r.readOffer(ctx, r.w.gateways[gate].url, res.path)
	if err != nil {
		return nil, err
	}
	i, err := offerIndex(offer, rk)
	if err != nil {
		return nil, err
	}
	pay, err := pp.p.Sign(ctx, offer, i)
	if err != nil {
		return nil, fmt.Errorf("signing: %w", err)
	}
	return r.newPayment(pp, rk, pay.Header, pay.Value, pay.Requirements, pay.Payload, "", -1, res, shapeGET, gate, asked)
}

// signInOnce answers the challenge of fromPath at gateway from as p (or sends header again, when not ""), sends
// it with a GET of toPath at gateway to, and records what came of it; it returns the sign-in, nil when none was
// sent. A sign-in of
// its own (or sent again) goes under gateway from's host wherever it is sent, as a load balancer sends it; one
// signed at another gateway goes under the host of the gateway it is sent to.
func (r *invRun) signInOnce(a *invAction, p *payer.Payer, kind string, from int, fromPath string, to int, toPath, header string) *invSignIn {
	ctx, cancel := context.WithTimeout(context.Background(), invRequestTimeout)
	defer cancel()
	rk := r.w.route(toPath)
	s := &invSignIn{action: a.n, gate: to, from: from, kind: kind, wallet: p.Address(), route: rk, path: toPath}
	if header == "" {
		base := r.w.gateways[from].url
		read := r.readOffer
		if a.n%2 == 0 {
			// Half the time from the paywall page, as its script signs in (invariants_browser_test.go).
			read, s.fromPage = r.readPageOffer, true
		}
		offer, err := read(ctx, base, fromPath)
		if err != nil {
			a.say("sign-in by %s (%s): gw%d %s: %s", p.Address().Hex()[:10], kind, from, fromPath, shorten(err.Error()))
			return nil
		}
		h, ok, err := p.SignIn(offer, base+fromPath)
		if err != nil || !ok {
			a.say("sign-in by %s (%s): gw%d %s offers no challenge to sign (%v)", p.Address().Hex()[:10], kind, from, fromPath, err)
			r.t.Errorf("the 402 of %s at gateway %d declares no sign-in-with-x challenge the payer signs: %v", fromPath, from, err)
			return nil
		}
		header = h
	}
	s.header, s.headerValue = sha256.Sum256([]byte(header)), header
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, r.w.gateways[to].url+toPath, nil)
	if err != nil {
		r.t.Fatal(err)
	}
	if kind == siwxOwn || kind == siwxReplay {
		req.Host = strings.TrimPrefix(r.w.gateways[from].url, "http://")
	}
	req.Header.Set(x402.HeaderSignInWithX, header)
	req.Header.Set(invPaymentHeader, siwxKey(rk, p.Address()))
	s.sent = time.Now()
	resp, err := r.client.h1.Do(req)
	s.got = time.Now()
	switch {
	case err != nil:
		s.note = "no answer: " + shorten(err.Error())
	default:
		body, rerr := io.ReadAll(resp.Body)
		resp.Body.Close()
		s.status = resp.StatusCode
		switch {
		case resp.StatusCode == http.StatusPaymentRequired:
			s.note = refusalReason(resp, body)
		case s.served() && rerr == nil && string(body) == upstreamBody(http.MethodGet, toPath, 0):
			s.servedRight, s.note = true, "served"
		case s.served():
			s.note = fmt.Sprintf("a %d that is not the response of GET %s: %q (%v)", resp.StatusCode, toPath, shorten(string(body)), rerr)
		default:
			s.note = shorten(string(body))
		}
	}
	r.siwx.mu.Lock()
	r.siwx.signIns = append(r.siwx.signIns, s)
	r.siwx.mu.Unlock()
	a.say("sign-in → %s", s)
	return s
}

// siwxSnapshot is the sign-ins so far.
func (r *invRun) siwxSnapshot() []*invSignIn {
	r.siwx.mu.Lock()
	defer r.siwx.mu.Unlock()
	return append([]*invSignIn(nil), r.siwx.signIns...)
}

// invSettleTimeout bounds how long after its client stopped waiting a gate may still settle a payment, and so
// grant what it bought: its settlement timeout (2 minutes), and some.
const invSettleTimeout = 150 * time.Second

// checkGrantBounded judges access-grant-bounded: on each access route, what the upstream served to each wallet by
// sign-in is at most the requests its payments charged on chain bought, and no sign-in was served after the last
// grant it could hold had ended.
func (r *invRun) checkGrantBounded(end *invEnd) ([]invViolation, string) {
	var out []invViolation
	type key struct {
		rk     *routeKind
		wallet common.Address
	}
	bought := map[key][]*invPayment{}
	// lastGrant is the latest a grant of the wallet's payments may have been written: before the answer of a
	// presentation that got one; for one that got none, while the gate may still have been settling it.
	lastGrant := map[key]time.Time{}
	for _, p := range r.snapshot() {
		if p.route.access == nil || orZero(end.charged[p]).Sign() == 0 {
			continue
		}
		k := key{p.route, p.payer.addr}
		bought[k] = append(bought[k], p)
		p.mu.Lock()
		for _, a := range p.answers {
			at := a.got
			if a.status == 0 {
				at = at.Add(invSettleTimeout)
			}
			if at.After(lastGrant[k]) {
				lastGrant[k] = at
			}
		}
		p.mu.Unlock()
	}
	signIns := r.siwxSnapshot()
	byKey := map[key][]*invSignIn{}
	for _, s := range signIns {
		k := key{s.route, s.wallet}
		byKey[k] = append(byKey[k], s)
	}
	served, wallets := 0, 0
	for k, ss := range byKey {
		runs := r.w.upstream.runsOfKey(siwxKey(k.rk, k.wallet))
		served += runs
		if runs > 0 {
			wallets++
		}
		paid := bought[k]
		if runs > 0 && len(paid) == 0 {
			// Whatever the grant allows (a count, or any number for a while), none stands without a payment charged.
			out = append(out, invViolation{what: fmt.Sprintf("%s was served %d sign-in request(s) on %q (the upstream counted them), and no payment of it there was charged on chain: %s",
				k.wallet.Hex(), runs, k.rk.name, describeSignIns(ss))})
		} else if n := k.rk.access.Requests; n > 0 && int64(runs) > n*int64(len(paid)) {
			out = append(out, invViolation{what: fmt.Sprintf("%s was served %d sign-in request(s) on %q (the upstream counted them), and bought %d with %d payment(s) charged on chain: %s",
				k.wallet.Hex(), runs, k.rk.name, n*int64(len(paid)), len(paid), describeSignIns(ss)), payments: paid})
		}
		for _, s := range ss {
			if !s.served() {
				continue
			}
			if !s.servedRight {
				out = append(out, invViolation{what: "a sign-in was answered with what is not the resource asked: " + s.String()})
			}
			if ended := lastGrant[k].Add(k.rk.access.For); len(paid) > 0 && s.sent.After(ended) {
				out = append(out, invViolation{what: fmt.Sprintf("a sign-in sent %v after the last grant %s's payments on %q could hold ended was served: %s",
					s.sent.Sub(ended).Round(time.Millisecond), k.wallet.Hex(), k.rk.name, s), payments: paid})
			}
		}
	}
	kinds := map[string]int{}
	for _, s := range signIns {
		what := "refused " + strings.SplitN(strings.TrimPrefix(s.note, "sign-in-with-x refused: "), ":", 2)[0]
		switch {
		case s.status == 0:
			what = "no answer"
		case s.served():
			what = "served"
		case s.status != http.StatusPaymentRequired:
			what = fmt.Sprint(s.status)
		}
		kinds[s.kind+" → "+what]++
	}
	var parts []string
	for k, n := range kinds {
		parts = append(parts, fmt.Sprintf("%d× %s", n, k))
	}
	sort.Strings(parts)
	return out, fmt.Sprintf("%d sign-ins sent (%s); the upstream served %d to %d wallet(s), within what their payments bought and while their grants stood",
		len(signIns), strings.Join(parts, ", "), served, wallets)
}

// checkUnpaidNeverServed judges unpaid-never-signed-in: a wallet that never paid, a sign-in signed for another
// path, route or gateway, and a sign-in header sent again after it was served are never served.
func (r *invRun) checkUnpaidNeverServed(end *invEnd) ([]invViolation, string) {
	var out []invViolation
	servedHeaders := map[[32]byte][]*invSignIn{}
	refused := 0
	for _, s := range r.siwxSnapshot() {
		if s.served() {
			servedHeaders[s.header] = append(servedHeaders[s.header], s)
		}
		switch s.kind {
		case siwxOwn, siwxReplay:
			continue
		}
		if s.served() {
			out = append(out, invViolation{what: "a sign-in that must be refused was served: " + s.String()})
		} else if s.status == http.StatusPaymentRequired {
			refused++
		}
	}
	for _, s := range r.strangerWallets() {
		for _, rk := range r.w.routes {
			if rk.access == nil {
				continue
			}
			if runs := r.w.upstream.runsOfKey(siwxKey(rk, s.Address())); runs > 0 {
				out = append(out, invViolation{what: fmt.Sprintf("the upstream served %d sign-in request(s) of %s, which never paid, on %q", runs, s.Address().Hex(), rk.name)})
			}
		}
	}
	for _, ss := range servedHeaders {
		if len(ss) > 1 {
			out = append(out, invViolation{what: fmt.Sprintf("one sign-in header (one nonce) was served %d times: %s", len(ss), describeSignIns(ss))})
		}
	}
	return out, fmt.Sprintf("%d sign-ins of wallets that never paid, or signed for another path, route or gateway, refused 402; no header served twice", refused)
}

func describeSignIns(ss []*invSignIn) string {
	var parts []string
	for i, s := range ss {
		if i == 12 {
			parts = append(parts, fmt.Sprintf("... %d more", len(ss)-i))
			break
		}
		parts = append(parts, s.String())
	}
	return strings.Join(parts, "; ")
}

// runsOfKey is how many requests the upstream answered under key (invPaymentHeader).
func (u *invUpstream) runsOfKey(key string) int {
	u.mu.Lock()
	defer u.mu.Unlock()
	return u.runs[key]
}

// checkPaidSignedIn judges paid-wallet-signed-in: a sign-in of a wallet whose payment on the route delivered its
// response before the sign-in was sent, sent while the grant that payment bought surely stood (from the start of
// the payment's first presentation that may have written it), is served at any gateway: the grant is written before
// the paid response goes out, once a payment, and is the cluster's. Refused for any reason,
// or answered with anything but the resource, it is a violation, except: refused as used up once the upstream
// served the wallet there as many sign-ins as the payments that stood bought (those left unanswered counted, as
// they may have used one); a SIGKILL of the gateway it was sent to, or the database down or its way hung, while
// it was answered; or every delivery that stood with its gateway SIGKILLed, or the database out, as it delivered (a
// grant whose write failed is logged, and the payment bought its response only).
func (r *invRun) checkPaidSignedIn(end *invEnd) ([]invViolation, string) {
	var out []invViolation
	type key struct {
		rk     *routeKind
		wallet common.Address
	}
	deliveries := map[key][]*invAnswer{}
	payments := map[*invAnswer]*invPayment{}
	// grantFrom is, for each payment, the start of its earliest presentation that may have written its grant: the
	// gate writes it once, just before the paid response goes out, and the same payment served again on a later
	// presentation (its first response cut short, its gateway killed as it wrote it) grants nothing more
	// (journal.Access.GrantAccess). A presentation answered with a refusal wrote none.
	grantFrom := map[*invPayment]time.Time{}
	for _, p := range r.snapshot() {
		if p.route.access == nil {
			continue
		}
		p.mu.Lock()
		for _, d := range p.deliveries {
			deliveries[key{p.route, p.payer.addr}] = append(deliveries[key{p.route, p.payer.addr}], d)
			payments[d] = p
		}
		for _, a := range p.answers {
			if mayHaveGranted := a.status == 0 || a.status < 400 || a.status >= 500; mayHaveGranted {
				if from, ok := grantFrom[p]; !ok || a.sent.Before(from) {
					grantFrom[p] = a.sent
				}
			}
		}
		p.mu.Unlock()
	}
	signIns := r.siwxSnapshot()
	// used is what the grants of a wallet on a route may have served: the upstream's count, and the sign-ins
	// that got no answer or an error (a grant may have counted them without the upstream's answer reaching it).
	used := map[key]int{}
	for _, s := range signIns {
		if k := (key{s.route, s.wallet}); s.kind == siwxOwn || s.kind == siwxReplay {
			if _, ok := used[k]; !ok {
				used[k] = r.w.upstream.runsOfKey(siwxKey(s.route, s.wallet))
			}
			if !s.served() && s.status != http.StatusPaymentRequired {
				used[k]++
			}
		}
	}
	usedUp := 0
	judged, served, excused := 0, 0, 0
	for _, s := range signIns {
		if s.kind != siwxOwn || s.status == 0 {
			continue
		}
		var stood []*invAnswer // the deliveries whose grant surely stood
		bought := map[*invPayment]bool{}
		for _, d := range deliveries[key{s.route, s.wallet}] {
			if d.got.Before(s.sent) && s.got.Before(grantFrom[payments[d]].Add(s.route.access.For)) {
				stood = append(stood, d)
				bought[payments[d]] = true
			}
		}
		if len(stood) == 0 {
			continue
		}
		judged++
		reason := strings.TrimPrefix(s.note, "sign-in-with-x refused: ")
		switch n := s.route.access.Requests; {
		case s.servedRight:
			served++
			continue
		case s.status == http.StatusPaymentRequired && strings.HasPrefix(reason, x402.SignInWithXGrantUsedUp) && n > 0 && int64(used[key{s.route, s.wallet}]) >= n*int64(len(bought)):
			usedUp++
			continue
		case r.crashBetween(s.gate, s.sent, s.got):
			excused++ // the gateway it was sent to killed, or the database out, as it was answered
			continue
		case !slices.ContainsFunc(stood, func(d *invAnswer) bool { return !r.crashBetween(d.gate, d.sent, d.got) }):
			excused++ // each grant's write may have failed
			continue
		}
		d := stood[len(stood)-1]
		out = append(out, invViolation{what: fmt.Sprintf("a sign-in was not served (%s) after payment #%d of its wallet on %q delivered its response (%s), while the grant it bought stood (%d payment(s) standing, the upstream served %d sign-in(s) of it there)%s",
			s, payments[d].n, s.route.name, d, len(bought), used[key{s.route, s.wallet}], r.stopsBetween(-1, d.sent, s.got)), payments: []*invPayment{payments[d]}})
	}
	return out, fmt.Sprintf("%d answered sign-ins of wallets whose payment had delivered, while its grant stood: %d served, %d refused as used up once the upstream served what was bought, none refused otherwise (%d excused by a SIGKILL or database outage as it was answered or as its grant was written)", judged, served, usedUp, excused)
}
