package caddymodule

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"errors"
	"fmt"
	"io"
	"math/big"
	"net/http"
	"net/url"
	"time"

	"github.com/ethereum/go-ethereum/common"

	"github.com/x402-gateway/caddy-x402/chain"
	"github.com/x402-gateway/caddy-x402/payer"
	"github.com/x402-gateway/caddy-x402/x402"
)

// maxPrintedBody caps how much of a response body `caddy x402 pay` reads and prints.
const maxPrintedBody = 32 << 20

// defaultPayMax is the most `caddy x402 pay` signs without --max: ten times the example site's price, so that
// trying out a gateway never needs the flag, while a hostile or mistyped 402 (a price of $100 for $0.01, the
// payer's whole balance as an upto maximum) costs at most a dime. A dollar amount is read in the token's
// decimals, from the chain: without an RPC, --max must be given in raw units.
const defaultPayMax = "$0.10"

// payOptions is what `caddy x402 pay` was asked to do.
type payOptions struct {
	// URL is the resource to pay for.
	URL string
	// Key is the payer's private key.
	Key *ecdsa.PrivateKey
	// RPC is a JSON-RPC URL of the chain the payment settles on; "" when none was given.
	RPC string
	// Method is the asset transfer method to pay by (permit2, eip3009, erc2612); "" picks one.
	Method string
	// SignOnly prints the payment header value instead of sending it.
	SignOnly bool
	// Timeout bounds the whole run, settlement included; 0 means no bound beyond the context's.
	Timeout time.Duration
	// Client makes the HTTP requests; nil uses a default client.
	Client *http.Client
	// Now is the signing clock when no RPC gives chain time; nil is the wall clock.
	Now func() time.Time
	// Max is the most the payment may authorize: raw units ("10000"), or a dollar amount ("$0.01") read in the
	// token's decimals; "" is defaultPayMax.
	Max string
	// MaxValidity caps how long the payment stays valid; 0 is payer.DefaultMaxValidity.
	MaxValidity time.Duration
	// Scheme restricts the payment to one scheme (exact, upto, batch-settlement); "" picks one.
	Scheme string
	// Refund asks the URL's server for what is left in the payer's batch-settlement channel, and pays nothing.
	Refund bool
	// PaymentID names the payment in the payment-identifier extension of a server that declares it; "" names
	// it with a fresh id there.
	PaymentID string
	// SignIn answers the 402's sign-in-with-x challenge with the payer's wallet first, and pays only where the
	// server refuses it.
	SignIn bool
}

// runPay requests o.URL, pays if it answers 402 and prints the outcome; see the `pay` command's help.
// The error is non-nil when the final answer is not 2xx, after that answer has been printed.
func runPay(ctx context.Context, o payOptions, stdout, stderr io.Writer) error {
	if o.Key == nil {
		return fmt.Errorf("no payer key: give --key, --key-file, --dev or the environment variable %s", envPayerKey)
	}
	switch o.Method {
	case "", x402.TransferPermit2, x402.TransferEIP3009, x402.TransferERC2612:
	default:
		return fmt.Errorf("--method: expected %s, %s or %s, got %q", x402.TransferPermit2, x402.TransferEIP3009, x402.TransferERC2612, o.Method)
	}
	if o.Method == x402.TransferERC2612 && o.RPC == "" {
		return errors.New("--method erc2612 needs --rpc (or --dev): an EIP-2612 permit signs the token's nonces(payer), which only the chain knows")
	}
	if o.Max != "" && !isRawAmount(o.Max) {
		// The form is checked now; the amount in raw units needs the token's decimals, read once the 402 names it.
		if _, err := x402.ParsePrice(o.Max, 77); err != nil {
			return fmt.Errorf("--max: expected raw token units (such as 10000) or a dollar amount (such as $0.01): %w", err)
		}
	}
	if o.MaxValidity < 0 || (o.MaxValidity > 0 && o.MaxValidity < time.Second) {
		return fmt.Errorf("--max-validity: expected a duration of a second or more, got %s", o.MaxValidity)
	}
	switch o.Scheme {
	case "", x402.SchemeExact, x402.SchemeUpto, x402.SchemeBatchSettlement:
	default:
		return fmt.Errorf("--scheme: expected %s, %s or %s, got %q", x402.SchemeExact, x402.SchemeUpto, x402.SchemeBatchSettlement, o.Scheme)
	}
	target, err := url.Parse(o.URL)
	if err != nil || (target.Scheme != "http" && target.Scheme != "https") || target.Host == "" {
		return fmt.Errorf("expected an http:// or https:// URL to pay for, got %q", o.URL)
	}
	if o.Timeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, o.Timeout)
		defer cancel()
	}
	client := o.Client
	if client == nil {
		client = &http.Client{}
	}
	if o.Refund {
		return runRefund(ctx, o, target, client, stderr)
	}

	first, firstBody, err := payer.Fetch(ctx, client, http.MethodGet, target.String(), "", "", maxPrintedBody)
	if err != nil {
		return err
	}
	if first.StatusCode != http.StatusPaymentRequired {
		if o.SignOnly {
			return fmt.Errorf("%s answered %s, not 402 Payment Required: there is nothing to sign", target.Redacted(), first.Status)
		}
		fmt.Fprintf(stderr, "%s asked for no payment\n", target.Redacted())
		return printAnswer(stdout, stderr, first, firstBody)
	}
	offer, err := payer.ReadOffer(first.Header, firstBody)
	if err != nil {
		return err
	}
	p, err := payer.New(o.Key, payer.Options{RPC: o.RPC, Method: o.Method, Scheme: o.Scheme, Now: o.Now, MaxValidity: o.MaxValidity})
	if err != nil {
		return err
	}
	defer p.Close()
	if o.SignIn && !o.SignOnly {
		if signedIn, err := signInFirst(ctx, p, offer, first.Request.URL.String(), client, stdout, stderr); signedIn || err != nil {
			return err
		}
	}
	i, err := p.Choose(ctx, offer)
	if err != nil {
		return err
	}
	if err := checkPayMax(ctx, p, o, offer.Required.Accepts[i]); err != nil {
		return err
	}
	if br, ok := offer.Batch(i); ok {
		return runPayBatch(ctx, p, o, br, first.Request.URL.String(), client, stdout, stderr)
	}
	pay, err := p.Sign(payer.WithPaymentIdentifier(ctx, o.PaymentID), offer, i)
	if err != nil {
		return err
	}
	if v, err := p.Validity(pay.Requirements); err == nil && int64(v/time.Second) < pay.Requirements.MaxTimeoutSeconds {
		fmt.Fprintf(stderr, "the server asks for a payment valid %d s; signed valid for %s (--max-validity)\n", pay.Requirements.MaxTimeoutSeconds, v)
	}
	if o.SignOnly {
		_, err := fmt.Fprintln(stdout, pay.Value)
		return err
	}
	req := pay.Requirements
	upTo := ""
	if req.Scheme == x402.SchemeUpto {
		upTo = "up to " // the server charges what the request used, at most this
	}
	fmt.Fprintf(stderr, "paying %s%s of %s to %s on %s by %s as %s%s\n",
		upTo, req.Amount, req.Asset, req.PayTo, req.Network, pay.Method, p.Address().Hex(), payNote(pay))
	if pay.Identifier != "" {
		fmt.Fprintf(stderr, "the payment is named %s (payment-identifier): the server answers another payment of this id 409\n", pay.Identifier)
	}

	// The 402 came from where the redirects ended: pay there, and follow no redirect with the payment
	// attached, which would hand a signed payment to another host.
	noRedirect := *client
	noRedirect.CheckRedirect = func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }
	resp, body, err := payer.Fetch(ctx, &noRedirect, http.MethodGet, first.Request.URL.String(), pay.Header, pay.Value, maxPrintedBody)
	if err != nil {
		return err
	}
	return printAnswer(stdout, stderr, resp, body)
}

// runPayBatch pays a batch-settlement requirement through a payer.Transport, which opens the payer's channel
// with a deposit (or, with an RPC, finds it in the escrow) and pays by the next voucher; --max bounds the
// deposit as it bounds any payment. It prints the answer, then the channel, its cumulative amount and what is
// left in it.
func runPayBatch(ctx context.Context, p *payer.Payer, o payOptions, br x402.BatchRequirements, target string, client *http.Client, stdout, stderr io.Writer) error {
	if o.SignOnly {
		return errors.New("--sign-only: a batch-settlement payment is the next voucher of a channel, which only the server's answer moves on: it is paid, not printed")
	}
	limit, _, err := payMax(ctx, p, o, br.Generic())
	if err != nil {
		return err
	}
	id, err := p.ChannelID(br)
	if err != nil {
		return err
	}
	tr := &payer.Transport{Payer: p, Base: client.Transport,
		Limits: []payer.Limit{{Network: br.Network, Asset: br.Asset, PerRequest: limit, Total: limit}}}
	paying := *client
	paying.Transport = tr
	paying.CheckRedirect = func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }
	fmt.Fprintf(stderr, "paying %s of %s to %s on %s from batch-settlement channel %s as %s (a deposit of at most %s when it needs one)\n",
		br.Amount, br.Asset, br.PayTo, br.Network, id.Hex(), p.Address().Hex(), limit)
	resp, body, err := payer.Fetch(ctx, &paying, http.MethodGet, target, "", "", maxPrintedBody)
	if err != nil {
		return err
	}
	answerErr := printAnswer(stdout, stderr, resp, body)
	if st, ok := p.Channel(id); ok {
		fmt.Fprintf(stderr, "channel %s: cumulative %s charged, balance %s, left %s\n", st.ID.Hex(), st.Charged, st.Balance, st.Left())
	} else {
		fmt.Fprintf(stderr, "channel %s: the answer did not confirm the payment; its state is read again next time (with --rpc)\n", id.Hex())
	}
	return answerErr
}

// runRefund asks target's server for what is left in the payer's batch-settlement channel.
func runRefund(ctx context.Context, o payOptions, target *url.URL, client *http.Client, stderr io.Writer) error {
	if o.SignOnly {
		return errors.New("--sign-only and --refund: a refund is asked for, not printed")
	}
	p, err := payer.New(o.Key, payer.Options{RPC: o.RPC, Method: o.Method, Now: o.Now, MaxValidity: o.MaxValidity})
	if err != nil {
		return err
	}
	defer p.Close()
	st, answer, err := p.Refund(ctx, client, target.String(), nil)
	if err != nil {
		return err
	}
	fmt.Fprintf(stderr, "refunded channel %s (transaction %s): cumulative %s charged, balance %s, left %s\n",
		st.ID.Hex(), answer.Transaction, st.Charged, st.Balance, st.Left())
	return nil
}

// checkPayMax refuses to sign req when it authorizes more than o.Max (or defaultPayMax): an upto requirement
// at its maximum, which the server may charge in full.
func checkPayMax(ctx context.Context, p *payer.Payer, o payOptions, req x402.PaymentRequirements) error {
	amount, err := x402.ParseUint256(req.Amount)
	if err != nil {
		return fmt.Errorf("the 402 asks the amount %q: %w", req.Amount, err)
	}
	limit, decimals, err := payMax(ctx, p, o, req)
	if err != nil {
		return err
	}
	if amount.Cmp(limit) <= 0 {
		return nil
	}
	flag, given := o.Max, o.Max != ""
	if !given {
		flag = defaultPayMax
	}
	raw := isRawAmount(flag)
	asked, most := amount.String(), limit.String()
	switch {
	case decimals >= 0 && raw:
		asked = fmt.Sprintf("%s (%s tokens)", amount, x402.FormatTokenAmount(amount.String(), uint8(decimals)))
		most = fmt.Sprintf("%s (%s tokens)", limit, x402.FormatTokenAmount(limit.String(), uint8(decimals)))
	case decimals >= 0:
		asked = fmt.Sprintf("%s (%s tokens)", amount, x402.FormatTokenAmount(amount.String(), uint8(decimals)))
		most = fmt.Sprintf("%s (%s raw units)", flag, limit)
	}
	upTo, source := "", "--max"
	if req.Scheme == x402.SchemeUpto {
		upTo = "up to "
	}
	if !given {
		source = "the default --max"
	}
	return fmt.Errorf("the 402 asks %s%s of %s on %s, over %s of %s: not signed; give a --max of at least that to pay it", upTo, asked, req.Asset, req.Network, source, most)
}

// payMax is --max (or defaultPayMax) in raw units of req's asset, and the token's decimals when they were read
// (-1 otherwise).
func payMax(ctx context.Context, p *payer.Payer, o payOptions, req x402.PaymentRequirements) (*big.Int, int, error) {
	amount, err := x402.ParseUint256(req.Amount)
	if err != nil {
		return nil, -1, fmt.Errorf("the 402 asks the amount %q: %w", req.Amount, err)
	}
	flag, given := o.Max, o.Max != ""
	if !given {
		flag = defaultPayMax
	}
	var (
		limit    *big.Int
		decimals = -1
		raw      = isRawAmount(flag)
	)
	if raw {
		if limit, err = x402.ParseUint256(flag); err != nil {
			return nil, -1, fmt.Errorf("--max %s: expected raw token units (such as 10000) or a dollar amount (such as $0.01): %w", flag, err)
		}
		if o.RPC != "" {
			if d, err := p.TokenDecimals(ctx, common.HexToAddress(req.Asset)); err == nil {
				decimals = int(d) // only to say what the amounts are in tokens
			}
		}
	} else {
		if o.RPC == "" {
			if !given {
				return nil, -1, fmt.Errorf("without --max, pay signs at most %s, read in the token's decimals from the chain; with no --rpc they are unknown: give --max in raw units (the 402 asks %s of %s) or --rpc", defaultPayMax, amount, req.Asset)
			}
			return nil, -1, fmt.Errorf("--max %s is a dollar amount, read in the token's decimals from the chain; with no --rpc they are unknown: give --max in raw units (the 402 asks %s of %s) or --rpc", flag, amount, req.Asset)
		}
		asset, err := chain.ParseAddress("requirements.asset", req.Asset)
		if err != nil {
			return nil, -1, err
		}
		d, err := p.TokenDecimals(ctx, asset)
		if err != nil {
			return nil, -1, fmt.Errorf("reading the decimals of the token %s for --max %s: %w", req.Asset, flag, err)
		}
		decimals = int(d)
		if limit, err = x402.ParsePrice(flag, d); err != nil {
			return nil, -1, fmt.Errorf("--max: %w", err)
		}
	}
	return limit, decimals, nil
}

// isRawAmount says whether a --max is raw token units: digits only.
func isRawAmount(s string) bool {
	if s == "" {
		return false
	}
	for i := 0; i < len(s); i++ {
		if s[i] < '0' || s[i] > '9' {
			return false
		}
	}
	return true
}

// payNote says, for the progress line, what the payment checked and added beyond the signature.
func payNote(pay payer.Payment) string {
	switch {
	case pay.GasSponsored && pay.SponsoringDeclared:
		return " (gas sponsored: the payer has not approved Permit2)"
	case pay.GasSponsored:
		return " (gas sponsored: the payer has not approved Permit2, though the server does not declare " + x402.ExtensionEIP2612GasSponsoring + ")"
	case pay.Method == x402.TransferPermit2 && !pay.AllowanceChecked:
		return " (no --rpc: Permit2 allowance not checked, no gas sponsoring)"
	}
	return ""
}

// printAnswer prints the status line, the body and the decoded settlement response of resp, and returns an
// error when the status is not 2xx, with the server's reason when it gave one.
func printAnswer(stdout, stderr io.Writer, resp *http.Response, body []byte) error {
	var out bytes.Buffer
	fmt.Fprintf(&out, "%s %s\n", resp.Proto, resp.Status)
	out.Write(body)
	if len(body) > 0 && body[len(body)-1] != '\n' {
		out.WriteByte('\n')
	}
	var settled *x402.SettleResponse
	for _, name := range []string{x402.HeaderPaymentResponse, x402.HeaderXPaymentResponse} {
		h := resp.Header.Get(name)
		if h == "" {
			continue
		}
		d, err := decodeHeaderValue(name + ": " + h)
		if err != nil {
			fmt.Fprintf(&out, "\n%s: %s\n", name, h)
			fmt.Fprintf(stderr, "the %s header does not decode: %v\n", name, err)
			continue
		}
		fmt.Fprintf(&out, "\n%s:\n%s\n", name, d.JSON)
		if s, err := x402.DecodeSettleResponse(h); err == nil {
			settled = &s
		}
	}
	if _, err := stdout.Write(out.Bytes()); err != nil {
		return err
	}
	if settled != nil && settled.Pending() {
		fmt.Fprintf(stderr, "settlement is pending (transaction %s): the payment may still complete; do not pay again\n", settled.Transaction)
	}
	if resp.StatusCode >= 200 && resp.StatusCode < 300 {
		return nil
	}
	reason := ""
	switch {
	case settled != nil && settled.ErrorReason != "":
		reason = ": " + settled.ErrorReason
		if settled.ErrorMessage != "" {
			reason += ": " + settled.ErrorMessage
		}
	case resp.StatusCode == http.StatusPaymentRequired:
		if p, err := x402.DecodePaymentRequired(resp.Header.Get(x402.HeaderPaymentRequired)); err == nil && p.Error != "" {
			reason = ": " + p.Error
		} else if v1, err := x402.DecodePaymentRequiredV1(body); err == nil && v1.Error != "" {
			reason = ": " + v1.Error
		}
	}
	return fmt.Errorf("the server answered %s%s", resp.Status, reason)
}

// signInFirst answers the 402's sign-in-with-x challenge and prints the answer unless the server refuses the
// sign-in (402), which it says on stderr before the caller pays; signedIn is false where the 402 declares no
// challenge the payer signs.
func signInFirst(ctx context.Context, p *payer.Payer, offer payer.Offer, target string, client *http.Client, stdout, stderr io.Writer) (signedIn bool, err error) {
	header, ok, err := p.SignIn(offer, target)
	if err != nil {
		fmt.Fprintf(stderr, "not signing in: %v\n", err)
		return false, nil
	}
	if !ok {
		return false, nil
	}
	noRedirect := *client
	noRedirect.CheckRedirect = func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }
	resp, body, err := payer.Fetch(ctx, &noRedirect, http.MethodGet, target, x402.HeaderSignInWithX, header, maxPrintedBody)
	if err != nil {
		return false, err
	}
	if resp.StatusCode == http.StatusPaymentRequired {
		why := "no reason given"
		if pr, err := x402.DecodePaymentRequired(resp.Header.Get(x402.HeaderPaymentRequired)); err == nil && pr.Error != "" {
			why = pr.Error
		}
		fmt.Fprintf(stderr, "signing in as %s was refused (%s): paying\n", p.Address().Hex(), why)
		return false, nil
	}
	fmt.Fprintf(stderr, "signed in as %s (sign-in-with-x): served without paying\n", p.Address().Hex())
	return true, printAnswer(stdout, stderr, resp, body)
}
