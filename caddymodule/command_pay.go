package caddymodule

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"time"

	"github.com/x402-gateway/caddy-x402/payer"
	"github.com/x402-gateway/caddy-x402/x402"
)

// maxPrintedBody caps how much of a response body `caddy x402 pay` reads and prints.
const maxPrintedBody = 32 << 20

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

	first, firstBody, err := fetch(ctx, client, http.MethodGet, target.String(), "", "")
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
	p, err := payer.New(o.Key, payer.Options{RPC: o.RPC, Method: o.Method, Now: o.Now})
	if err != nil {
		return err
	}
	defer p.Close()
	pay, err := p.Pay(ctx, offer)
	if err != nil {
		return err
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

	// The 402 came from where the redirects ended: pay there, and follow no redirect with the payment
	// attached, which would hand a signed payment to another host.
	noRedirect := *client
	noRedirect.CheckRedirect = func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }
	resp, body, err := fetch(ctx, &noRedirect, http.MethodGet, first.Request.URL.String(), pay.Header, pay.Value)
	if err != nil {
		return err
	}
	return printAnswer(stdout, stderr, resp, body)
}

// fetch sends method to u, with the payment header when name is set, and reads the body (as much of it as is printed).
func fetch(ctx context.Context, client *http.Client, method, u, name, value string) (*http.Response, []byte, error) {
	r, err := http.NewRequestWithContext(ctx, method, u, nil)
	if err != nil {
		return nil, nil, fmt.Errorf("building the request: %w", err)
	}
	if name != "" {
		r.Header.Set(name, value)
	}
	resp, err := client.Do(r)
	if err != nil {
		return nil, nil, fmt.Errorf("requesting %s: %w", r.URL.Redacted(), err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, maxPrintedBody))
	if err != nil {
		return nil, nil, fmt.Errorf("reading the answer of %s: %w", r.URL.Redacted(), err)
	}
	return resp, body, nil
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
