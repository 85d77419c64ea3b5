package gate

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"path"
	"slices"
	"strings"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/ethereum/go-ethereum/accounts"
	"github.com/ethereum/go-ethereum/common"
	"github.com/ethereum/go-ethereum/common/hexutil"
	"github.com/ethereum/go-ethereum/crypto"
	"go.uber.org/zap"

	"github.com/x402-gateway/caddy-x402/chain/journal"
	"github.com/x402-gateway/caddy-x402/x402"
)

// Access is what a payment buys of its route beyond its own response (sign-in-with-x): the 402 carries a
// CAIP-122 challenge, and a payer whose payment was served answers it with a SIGN-IN-WITH-X header signed by its
// wallet and is served without paying, within the grant. A grant is written once the payment's response is
// served, its settlement known good: never for a payment refused or not settled.
type Access struct {
	// For is how long a grant lasts from the payment's response. Required.
	For time.Duration
	// Requests bounds how many requests a grant signs in; 0: as many as come within For.
	Requests int64
	// Paths are the request paths a grant covers ("/reports/*" covers what starts with "/reports/", anything
	// else one path); empty: the path the payment was made for, as the public SDK's servers grant (with Grant:
	// every path of the route).
	Paths []string
	// Grant, when set, names the grant a payment here buys and a sign-in here spends, shared by every route of
	// any gate that names it: access sold on one route is honoured on the others. Every route naming a grant
	// sells it at its own price, so a grant opens only routes the operator named it on. Empty: the grant is this
	// route's alone.
	Grant string
}

// maxGrantName bounds a grant's name.
const maxGrantName = 64

// CheckAccess says what is wrong with an Access for a gate of settlement mode settle (nil: nothing).
func CheckAccess(a *Access, settle string) error {
	switch {
	case a == nil:
		return nil
	case a.For <= 0:
		return fmt.Errorf("access: a grant must last a positive time, got %s", a.For)
	case a.Requests < 0:
		return fmt.Errorf("access: requests must be 0 (any number) or more, got %d", a.Requests)
	case settle == SettleAsync:
		// An async payment is served before it settles: a grant written then could outlive a settlement refused
		// for good, access bought by nothing.
		return errors.New("access: a grant is bought by a settled payment; settle async serves before settling (use settle after or before)")
	}
	if len(a.Grant) > maxGrantName || strings.ContainsFunc(a.Grant, func(r rune) bool {
		return !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '-' || r == '_' || r == '.')
	}) {
		return fmt.Errorf("access: grant %q must be 1 to %d letters, digits, '-', '_' or '.'", a.Grant, maxGrantName)
	}
	for _, p := range a.Paths {
		if !strings.HasPrefix(p, "/") {
			return fmt.Errorf("access: path %q must start with '/'", p)
		}
		if i := strings.IndexByte(p, '*'); i >= 0 && i != len(p)-1 {
			return fmt.Errorf("access: path %q may hold '*' only at its end", p)
		}
	}
	return nil
}

// covers reports whether the grant covers a request of path p. p is judged as Caddy's matchers and file server
// read it, cleaned ("/reports/../admin" is "/admin"), and one still naming an escaped dot segment or separator
// ("%2e%2e", "%2f") is covered by no pattern: the server behind may read it as a step up.
func (a *Access) covers(p string) bool {
	if lower := strings.ToLower(p); strings.Contains(lower, "%2e") || strings.Contains(lower, "%2f") || strings.Contains(lower, "%5c") || strings.Contains(p, "\\") {
		return false
	}
	if cleaned := path.Clean(p); cleaned != p && !(strings.HasSuffix(p, "/") && cleaned+"/" == p) {
		p = cleaned
	}
	for _, pattern := range a.Paths {
		if prefix, ok := strings.CutSuffix(pattern, "*"); ok {
			if strings.HasPrefix(p, prefix) {
				return true
			}
		} else if p == pattern {
			return true
		}
	}
	return false
}

// MessageSignatureChecker is a facilitator that can tell whether a contract wallet (ERC-1271, or ERC-6492 not yet
// deployed) signed a digest: the gate asks it of a sign-in whose signature recovers to no EOA of the address.
type MessageSignatureChecker interface {
	// CheckMessageSignature reports whether signer's wallet on network accepts sig as its signature of digest; the
	// error is for a chain that could not be asked.
	CheckMessageSignature(ctx context.Context, network string, signer common.Address, digest [32]byte, sig []byte) (bool, error)
}

// requestPath is the path of the request the client sent, before any rewrite.
func (x *exchange) requestPath() string {
	u, err := url.ParseRequestURI(x.g.cfg.OriginalURI(x.r))
	if err != nil {
		return x.r.URL.Path
	}
	return u.Path
}

// accessKey is where the journal keeps what a payer bought of this route: the route (or the named grant), the
// path where the grant is per path, and the payer, a line each (PostgreSQL's text holds no NUL; a request path
// holds no raw newline). A named grant is never per path: it spans routes of other paths. It is kept per payee
// too (the recipients of the route's offers): the sites of one journal (of one Caddy, or a cluster's) may name
// their grants alike, and one tenant's grant must not open another's routes.
func (x *exchange) accessKey(payer string) string {
	if g := x.g.cfg.Access.Grant; g != "" {
		payees := make([]string, 0, len(x.g.cfg.Offers))
		for _, o := range x.g.cfg.Offers {
			payees = append(payees, strings.ToLower(o.PayTo))
		}
		slices.Sort(payees)
		return "grant:" + g + "@" + strings.Join(slices.Compact(payees), ",") + "\n*\n" + strings.ToLower(payer)
	}
	scope := "*"
	if len(x.g.cfg.Access.Paths) == 0 {
		scope = boundedKey(x.requestPath())
		if !utf8.ValidString(scope) || strings.ContainsFunc(scope, unicode.IsControl) {
			// A path of escaped bytes that are not text ("%ff", "%00"): a key PostgreSQL's text holds all the same.
			sum := sha256.Sum256([]byte(scope))
			scope = "sha256:" + hex.EncodeToString(sum[:])
		}
	}
	return x.g.cfg.Route + "\n" + scope + "\n" + strings.ToLower(payer)
}

// grantAccess records what a settled payment bought beyond its response, as the response is delivered: before it
// is written out, so that a payer signing in as soon as it has the response finds the grant at every gateway. A
// payment whose response is then cut short paid for the grant on chain all the same, and gets its response by
// presenting the payment again. Nothing is granted for a payment not settled (async: refused by checkAccess). A
// failure is logged: the payment bought its response, and the payer pays again for the next.
func (x *exchange) grantAccess(settled *x402.SettleResponse) {
	a := x.g.cfg.Access
	if a == nil || settled == nil || !settled.Success || x.payer == "" {
		return
	}
	if amount, err := x402.ParseAmount(settled.Amount); settled.Amount != "" && (err != nil || amount.Sign() == 0) {
		// An upto payment the upstream charged nothing for moved nothing on chain: it bought its response, not a
		// grant of more.
		return
	}
	until := x.g.now().Add(a.For)
	if err := x.g.access.GrantAccess(x.journalCtx(), x.accessKey(x.payer), x.id, until, a.Requests); err != nil {
		x.g.logger.Error("recording the access a served payment bought", zap.String("payment", x.id.String()), zap.Error(err))
	}
}

// declareSignIn adds the sign-in challenge to a 402's extensions: the request's host and resource, the chains of
// its offers, a fresh nonce, and the time it is issued.
func (x *exchange) declareSignIn(ext map[string]json.RawMessage) {
	var chains []x402.SignInWithXChain
	seen := map[string]bool{}
	for _, o := range x.offers.offers {
		if n := o.req.Network; strings.HasPrefix(n, "eip155:") && !seen[n] {
			seen[n] = true
			chains = append(chains, x402.SignInWithXChain{ChainID: n, Type: x402.SignatureTypeEIP191})
		}
	}
	var nonce [16]byte
	rand.Read(nonce[:])
	now, uri := x.g.now().UTC(), x.resourceURL()
	info := x402.SignInWithXInfo{Domain: x.r.Host, URI: uri, Version: "1", Nonce: hex.EncodeToString(nonce[:]),
		IssuedAt: now.Format(signInTime), ExpirationTime: now.Add(x402.SignInWithXMaxAge).Format(signInTime),
		Resources: []string{uri}}
	b, err := json.Marshal(x402.NewSignInWithXDeclaration(info, chains))
	if err != nil {
		x.g.logger.Error("encoding the sign-in-with-x challenge", zap.Error(err))
		return
	}
	ext[x402.ExtensionSignInWithX] = b
}

// signInTime is the form of the challenge's times, as JavaScript's toISOString writes them.
const signInTime = "2006-01-02T15:04:05.000Z"

// signIn serves a request without a payment (unpaid) that answers the route's sign-in challenge (answered true),
// or answers 402 naming why it does not sign in, with a fresh challenge and what to pay; false when the gate
// grants no access, the request carries no SIGN-IN-WITH-X header, or it carries a payment, which is judged as a
// payment. Nothing changes for a refused sign-in: its nonce and the grant are spent in one write, and only once
// everything else is good. The header is taken off the request either way: a sign-in not spent is good for
// minutes, and an upstream, or its logs, must not be handed one to replay.
func (x *exchange) signIn(unpaid bool) (answered bool, err error) {
	if x.g.cfg.Access == nil {
		return false, nil
	}
	header := x.r.Header.Get(x402.HeaderSignInWithX)
	x.r.Header.Del(x402.HeaderSignInWithX)
	if header == "" || !unpaid {
		return false, nil
	}
	s, err := x402.DecodeSignInWithX(header)
	if err != nil {
		return true, x.signInRefused(&x402.SignInWithXRefusal{Reason: x402.SignInWithXHeaderMalformed, Message: err.Error()}, "")
	}
	scheme := "http"
	if x.r.TLS != nil {
		scheme = "https"
	}
	var chains []string
	for _, o := range x.offers.offers {
		chains = append(chains, o.req.Network)
	}
	now := x.g.now()
	if r := s.Check(x402.SignInWithXExpect{Host: x.r.Host, Origin: scheme + "://" + x.r.Host, URI: x.resourceURL(),
		ChainIDs: chains, Now: now}); r != nil {
		return true, x.signInRefused(r, "")
	}
	a := x.g.cfg.Access
	if len(a.Paths) > 0 && !a.covers(x.requestPath()) {
		return true, x.signInRefused(&x402.SignInWithXRefusal{Reason: x402.SignInWithXPathNotGranted,
			Message: fmt.Sprintf("a payment here grants access to %s, not to this path", strings.Join(a.Paths, ", "))}, "")
	}
	signer, r, err := x.signInSigner(s)
	switch {
	case err != nil:
		return true, x.verifyUnreachable("the sign-in's contract wallet could not be asked whether it signed; nothing was charged, try again", err)
	case r != nil:
		return true, x.signInRefused(r, "")
	}
	payer := signer.Hex()
	nonceUntil := s.IssuedAtTime().Add(x402.SignInWithXMaxAge + time.Minute)
	g, err := x.g.access.SignIn(context.WithoutCancel(x.r.Context()), x.accessKey(payer),
		strings.ToLower(payer)+"\n"+s.Nonce, nonceUntil, now)
	switch {
	case errors.Is(err, journal.ErrNonceUsed):
		return true, x.signInRefused(&x402.SignInWithXRefusal{Reason: x402.SignInWithXNonce,
			Message: "the sign-in's nonce signed a request in before: answer a fresh challenge"}, payer)
	case errors.Is(err, journal.ErrNoGrant):
		return true, x.signInRefused(&x402.SignInWithXRefusal{Reason: x402.SignInWithXNoGrant,
			Message: "no payment of " + payer + " bought access here: pay once, then sign in"}, payer)
	case errors.Is(err, journal.ErrGrantEnded):
		return true, x.signInRefused(&x402.SignInWithXRefusal{Reason: x402.SignInWithXGrantExpired,
			Message: "the access " + payer + "'s payment bought has ended: pay again"}, payer)
	case errors.Is(err, journal.ErrGrantUsedUp):
		return true, x.signInRefused(&x402.SignInWithXRefusal{Reason: x402.SignInWithXGrantUsedUp,
			Message: fmt.Sprintf("the %d requests %s's payment bought are used: pay again", a.Requests, payer)}, payer)
	case err != nil:
		return true, x.verifyUnreachable("the gate's settlement journal could not be reached; nothing was charged, try again", err)
	}
	x.setVar(VarStatus, "signed-in")
	x.setVar(VarPayer, payer)
	x.g.logger.Info("sign-in", zap.String("payer", payer), zap.Time("until", g.Until), zap.Int64("uses_left", g.Uses),
		zap.Float64("total_ms", x.totalMs()))
	x.w.Header().Set("Cache-Control", "no-store") // served to this payer alone
	return true, x.next.ServeHTTP(x.w, x.r)
}

// signInSigner is the wallet that signed the sign-in's message: the address it names, when the signature recovers
// to it (an EOA) or its contract wallet accepts it (ERC-1271, ERC-6492) where the facilitator can ask the chain.
func (x *exchange) signInSigner(s x402.SignInWithX) (common.Address, *x402.SignInWithXRefusal, error) {
	if !common.IsHexAddress(s.Address) {
		return common.Address{}, &x402.SignInWithXRefusal{Reason: x402.SignInWithXMalformed, Message: "the sign-in's address is no EVM address"}, nil
	}
	addr := common.HexToAddress(s.Address)
	if hasUpper, hasLower := strings.ContainsAny(s.Address[2:], "ABCDEF"), strings.ContainsAny(s.Address[2:], "abcdef"); hasUpper && hasLower && s.Address != addr.Hex() {
		return common.Address{}, &x402.SignInWithXRefusal{Reason: x402.SignInWithXMalformed, Message: "the sign-in's address has a wrong EIP-55 checksum"}, nil
	}
	msg, err := s.Message(addr.Hex())
	if err != nil {
		return common.Address{}, &x402.SignInWithXRefusal{Reason: x402.SignInWithXUnsupported, Message: err.Error()}, nil
	}
	sig, err := hexutil.Decode(s.Signature)
	if err != nil || len(sig) < 64 || len(sig) > maxSignInSignature {
		return common.Address{}, &x402.SignInWithXRefusal{Reason: x402.SignInWithXMalformed,
			Message: fmt.Sprintf("the sign-in's signature must be 0x-prefixed hex of 64 to %d bytes", maxSignInSignature)}, nil
	}
	digest := accounts.TextHash([]byte(msg))
	if len(sig) == 65 {
		eoa := append([]byte(nil), sig...)
		if eoa[64] >= 27 {
			eoa[64] -= 27
		}
		if pub, err := crypto.SigToPub(digest, eoa); err == nil && crypto.PubkeyToAddress(*pub) == addr {
			return addr, nil, nil
		}
	}
	if checker, ok := x.g.fac.(MessageSignatureChecker); ok {
		good, err := checker.CheckMessageSignature(x.r.Context(), s.ChainID, addr, [32]byte(digest), sig)
		switch {
		case err != nil:
			return common.Address{}, nil, err
		case good:
			return addr, nil, nil
		}
	}
	return common.Address{}, &x402.SignInWithXRefusal{Reason: x402.SignInWithXSignature,
		Message: "the sign-in's signature is not " + addr.Hex() + "'s"}, nil
}

// maxSignInSignature bounds a sign-in's signature: an ERC-6492 one carries its wallet's deployment, a few hundred
// bytes in practice.
const maxSignInSignature = 8 << 10

// signInRefused answers a sign-in that does not sign the request in: 402 with a fresh challenge and what to pay,
// naming the reason, as a request without payment is answered. Nothing was charged or spent.
func (x *exchange) signInRefused(r *x402.SignInWithXRefusal, payer string) error {
	pr := x.paymentRequired("sign-in-with-x refused: " + r.Reason + ": " + r.Message)
	x.end(x402.PaymentOutcome{Status: x402.OutcomeNoPayment, Requirements: &pr, Payer: payer, TotalMs: x.totalMs()},
		zap.String("sign_in_refused", r.Reason))
	x.setRequiredHeader(pr)
	x.v1 = false
	return x.writeRequired(http.StatusPaymentRequired, pr)
}

// CheckSignInOnly says what is wrong with a sign-in-only gate's configuration (nil: nothing, or not one).
func CheckSignInOnly(cfg Config) error {
	if !cfg.SignInOnly {
		return nil
	}
	if cfg.Access == nil || cfg.Access.Grant == "" {
		return errors.New("sign_in_only: name the grant it honours (access <duration> { grant <name> }), bought on another route")
	}
	if cfg.OffersFor != nil {
		return errors.New("sign_in_only: pay_to must be fixed, not filled by the request: it names whose grant the route honours")
	}
	for _, o := range cfg.Offers {
		if o.PayTo == "" {
			return errors.New("sign_in_only: pay_to is required: a grant is kept per payee, and pay_to names whose grant the route honours")
		}
	}
	return nil
}

// signInOnlyRefusesPayment answers a payment presented to a route that sells nothing: 402 with the challenge and
// no way to pay, as a request without payment. Nothing is verified, settled or sent upstream.
func (x *exchange) signInOnlyRefusesPayment() error {
	pr := x.paymentRequired("this route sells nothing: sign in with a wallet holding its grant, bought on another route")
	x.end(x402.PaymentOutcome{Status: x402.OutcomeNoPayment, Requirements: &pr, TotalMs: x.totalMs()},
		zap.String("sign_in_only", "payment refused"))
	x.setRequiredHeader(pr)
	x.v1 = false
	return x.writeRequired(http.StatusPaymentRequired, pr)
}
