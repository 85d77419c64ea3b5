package caddymodule

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/big"
	"net/http"
	"net/url"
	"strings"
	"time"

	"github.com/ethereum/go-ethereum/common"
	"github.com/ethereum/go-ethereum/crypto"
	"github.com/ethereum/go-ethereum/ethclient"

	"github.com/x402-gateway/caddy-x402/chain"
	"github.com/x402-gateway/caddy-x402/chain/contracts"
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

// paymentOffer is what a 402 answer offers, in version 2 form whatever version the server speaks.
type paymentOffer struct {
	version  int
	required x402.PaymentRequired
	// v1Networks are the networks of a version 1 offer as the server spelled them (names, not CAIP-2), for the
	// X-PAYMENT payload that must repeat them.
	v1Networks []string
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

	first, firstBody, err := fetch(ctx, client, target.String(), "", "")
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
	offer, err := readOffer(first, firstBody)
	if err != nil {
		return err
	}

	var rpc *payerChain
	if o.RPC != "" {
		if rpc, err = dialPayerChain(ctx, o.RPC); err != nil {
			return err
		}
		defer rpc.close()
	}
	i, err := chooseRequirement(offer, o.Method, rpc)
	if err != nil {
		return err
	}
	req := offer.required.Accepts[i]
	payload, note, err := signPayment(ctx, o, rpc, offer, req)
	if err != nil {
		return err
	}

	headerName, headerValue, err := encodePayment(offer, i, payload)
	if err != nil {
		return err
	}
	if o.SignOnly {
		_, err := fmt.Fprintln(stdout, headerValue)
		return err
	}
	fmt.Fprintf(stderr, "paying %s of %s to %s on %s by %s as %s%s\n",
		req.Amount, req.Asset, req.PayTo, req.Network, payMethod(req), crypto.PubkeyToAddress(o.Key.PublicKey).Hex(), note)

	// The 402 came from where the redirects ended: pay there, and follow no redirect with the payment
	// attached, which would hand a signed payment to another host.
	noRedirect := *client
	noRedirect.CheckRedirect = func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }
	resp, body, err := fetch(ctx, &noRedirect, first.Request.URL.String(), headerName, headerValue)
	if err != nil {
		return err
	}
	return printAnswer(stdout, stderr, resp, body)
}

// fetch GETs u, with the payment header when name is set, and reads the body.
func fetch(ctx context.Context, client *http.Client, u, name, value string) (*http.Response, []byte, error) {
	r, err := http.NewRequestWithContext(ctx, http.MethodGet, u, nil)
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

// readOffer reads the payment requirements of a 402 answer: the PAYMENT-REQUIRED header (version 2), else the
// JSON body (version 1).
func readOffer(resp *http.Response, body []byte) (paymentOffer, error) {
	if h := resp.Header.Get(x402.HeaderPaymentRequired); h != "" {
		p, err := x402.DecodePaymentRequired(h)
		if err != nil {
			return paymentOffer{}, fmt.Errorf("the 402 answer's %s header: %w", x402.HeaderPaymentRequired, err)
		}
		return paymentOffer{version: x402.Version2, required: p}, nil
	}
	v1, err := x402.DecodePaymentRequiredV1(body)
	if err != nil {
		return paymentOffer{}, fmt.Errorf("the 402 answer has no %s header (version 2) and its body is no version 1 offer: %w", x402.HeaderPaymentRequired, err)
	}
	offer := paymentOffer{version: x402.Version1, required: x402.PaymentRequired{X402Version: x402.Version1, Error: v1.Error}}
	reg := x402.NewRegistry()
	for i, a := range v1.Accepts {
		req, res, err := reg.RequirementsFromV1(a)
		if err != nil {
			// A name this registry does not know (or a CAIP-2 id some version 1 servers send): keep it as it
			// is, so that the choice can take a CAIP-2 id or say which network it cannot pay on.
			req = x402.PaymentRequirements{Scheme: a.Scheme, Network: a.Network, Amount: a.MaxAmountRequired, Asset: a.Asset,
				PayTo: a.PayTo, MaxTimeoutSeconds: a.MaxTimeoutSeconds}
			if a.Extra != nil {
				req.Extra = *a.Extra
			}
			res = x402.ResourceInfo{URL: a.Resource, Description: a.Description, MimeType: a.MimeType}
		}
		if i == 0 {
			offer.required.Resource = res
		}
		offer.required.Accepts = append(offer.required.Accepts, req)
		offer.v1Networks = append(offer.v1Networks, a.Network)
	}
	return offer, nil
}

// chooseRequirement picks the requirement to pay: of those this payer can pay (scheme exact on an EVM chain,
// the method asked for, the chain the RPC serves), the first permit2 one, else the first other one in the
// server's order. permit2 comes first because it needs no RPC and, with gas sponsoring, no approval by the
// payer. When none can be paid, the error says why for each.
func chooseRequirement(offer paymentOffer, method string, rpc *payerChain) (int, error) {
	var reasons []string
	best := -1
	for i, req := range offer.required.Accepts {
		why := cannotPay(offer.version, req, method, rpc)
		if why != "" {
			reasons = append(reasons, fmt.Sprintf("accepts[%d] (%s %s on %s): %s", i, req.Scheme, req.Extra.AssetTransferMethod, req.Network, why))
			continue
		}
		if best < 0 || (req.Extra.AssetTransferMethod == x402.TransferPermit2 && offer.required.Accepts[best].Extra.AssetTransferMethod != x402.TransferPermit2) {
			best = i
		}
	}
	if best >= 0 {
		return best, nil
	}
	if len(reasons) == 0 {
		return 0, errors.New("the 402 answer offers no way to pay (accepts is empty)")
	}
	return 0, fmt.Errorf("none of the %d ways to pay that the server offers can be paid by this command:\n  %s",
		len(reasons), strings.Join(reasons, "\n  "))
}

// cannotPay says why req cannot be paid, or "" when it can.
func cannotPay(version int, req x402.PaymentRequirements, method string, rpc *payerChain) string {
	m := payMethod(req)
	if req.Scheme != x402.SchemeExact {
		return fmt.Sprintf("scheme %q; this command pays %q only", req.Scheme, x402.SchemeExact)
	}
	id, err := x402.ChainID(req.Network)
	if err != nil {
		return fmt.Sprintf("network %q is not an EVM chain this command knows (eip155:<chain id>)", req.Network)
	}
	switch {
	case m != x402.TransferPermit2 && m != x402.TransferEIP3009 && m != x402.TransferERC2612:
		return fmt.Sprintf("asset transfer method %q; this command pays %s, %s or %s", m, x402.TransferPermit2, x402.TransferEIP3009, x402.TransferERC2612)
	case method != "" && m != method:
		return "not the --method " + method
	case m == x402.TransferPermit2 && version != x402.Version2:
		return fmt.Sprintf("permit2 needs x402 version 2 and the server speaks version %d", version)
	case m == x402.TransferERC2612 && rpc == nil:
		return "erc2612 signs the token's nonces(payer), which only the chain knows: give --rpc (or --dev)"
	case m == x402.TransferERC2612 && req.Extra.Spender == "":
		return "erc2612 needs the facilitator wallet that will spend the permit, and extra.spender names none"
	case rpc != nil && rpc.chainID.Cmp(new(big.Int).SetUint64(id)) != 0:
		return fmt.Sprintf("on chain %d but --rpc %s serves chain %s", id, rpc.name, rpc.chainID)
	}
	return ""
}

// payMethod is how a requirement is paid: the method it names, or, naming none, EIP-3009, as the public
// SDKs read the standard `exact` requirement.
func payMethod(req x402.PaymentRequirements) string {
	if m := req.Extra.AssetTransferMethod; m != "" {
		return m
	}
	return x402.TransferEIP3009
}

// signPayment signs the payment of req. With an RPC, it signs at chain time (which the facilitator judges
// deadlines by) and adds gas sponsoring to a permit2 payment whose payer has not approved Permit2 enough;
// without one, at the wall clock and without that check. note describes what was added, for the progress line.
func signPayment(ctx context.Context, o payOptions, rpc *payerChain, offer paymentOffer, req x402.PaymentRequirements) (x402.PaymentPayload, string, error) {
	id, err := x402.ChainID(req.Network)
	if err != nil {
		return x402.PaymentPayload{}, "", err
	}
	chainID := new(big.Int).SetUint64(id)
	now := time.Now()
	if o.Now != nil {
		now = o.Now()
	}
	if rpc != nil {
		if now, err = rpc.now(ctx); err != nil {
			return x402.PaymentPayload{}, "", err
		}
	}
	payer := crypto.PubkeyToAddress(o.Key.PublicKey)

	var (
		p    x402.PaymentPayload
		note string
	)
	switch payMethod(req) {
	case x402.TransferEIP3009:
		if p, err = chain.SignEIP3009Payment(o.Key, req, chainID, chain.EIP3009Options{Now: now}); err != nil {
			return p, "", fmt.Errorf("signing the eip3009 payment: %w", err)
		}
	case x402.TransferPermit2:
		if p, err = chain.SignPermit2Payment(o.Key, req, chainID, chain.Permit2Options{Now: now}); err != nil {
			return p, "", fmt.Errorf("signing the permit2 payment: %w", err)
		}
		if rpc == nil {
			note = " (no --rpc: Permit2 allowance not checked, no gas sponsoring)"
			break
		}
		if note, err = sponsorIfNeeded(ctx, &p, o.Key, rpc, offer, req, chainID); err != nil {
			return p, "", err
		}
	case x402.TransferERC2612:
		asset, err := chain.ParseAddress("requirements.asset", req.Asset)
		if err != nil {
			return p, "", err
		}
		nonce, err := rpc.callUint(ctx, asset, "nonces", payer)
		if err != nil {
			return p, "", err
		}
		if p, err = chain.SignERC2612Payment(o.Key, req, chainID, chain.ERC2612Options{Now: now, TokenNonce: nonce}); err != nil {
			return p, "", fmt.Errorf("signing the erc2612 payment: %w", err)
		}
	default:
		return p, "", fmt.Errorf("cannot sign asset transfer method %q", req.Extra.AssetTransferMethod)
	}
	if offer.version == x402.Version2 && offer.required.Resource.URL != "" {
		res := offer.required.Resource
		p.Resource = &res
	}
	return p, note, nil
}

// sponsorIfNeeded adds the eip2612GasSponsoring permit to a permit2 payment when the payer's Permit2
// allowance is below the amount, echoing the server's declaration of the extension (its schema) if it made one.
func sponsorIfNeeded(ctx context.Context, p *x402.PaymentPayload, key *ecdsa.PrivateKey, rpc *payerChain, offer paymentOffer, req x402.PaymentRequirements, chainID *big.Int) (string, error) {
	asset, err := chain.ParseAddress("requirements.asset", req.Asset)
	if err != nil {
		return "", err
	}
	amount, err := x402.ParseUint256(req.Amount)
	if err != nil {
		return "", fmt.Errorf("requirements.amount: %w", err)
	}
	permit2 := contracts.Permit2Address
	if req.Extra.Permit2Address != "" {
		if permit2, err = chain.ParseAddress("requirements.extra.permit2Address", req.Extra.Permit2Address); err != nil {
			return "", err
		}
	}
	payer := crypto.PubkeyToAddress(key.PublicKey)
	allowance, err := rpc.callUint(ctx, asset, "allowance", payer, permit2)
	if err != nil {
		return "", err
	}
	if allowance.Cmp(amount) >= 0 {
		return "", nil
	}
	nonce, err := rpc.callUint(ctx, asset, "nonces", payer)
	if err != nil {
		return "", err
	}
	note := " (gas sponsored: the payer has not approved Permit2)"
	if declared, ok := offer.required.Extensions[x402.ExtensionEIP2612GasSponsoring]; ok {
		p.Extensions = map[string]json.RawMessage{x402.ExtensionEIP2612GasSponsoring: declared}
	} else {
		note = " (gas sponsored: the payer has not approved Permit2, though the server does not declare " + x402.ExtensionEIP2612GasSponsoring + ")"
	}
	if err := chain.AddGasSponsoring(p, key, chainID, "", "", nonce); err != nil {
		return "", fmt.Errorf("adding gas sponsoring: %w", err)
	}
	return note, nil
}

// encodePayment gives the header that carries p to a server of the offer's version: PAYMENT-SIGNATURE, or
// X-PAYMENT with the network spelled as the version 1 server spelled it.
func encodePayment(offer paymentOffer, i int, p x402.PaymentPayload) (name, value string, err error) {
	if offer.version == x402.Version1 {
		v1 := x402.PaymentPayloadV1{X402Version: x402.Version1, Scheme: p.Accepted.Scheme, Network: offer.v1Networks[i], Payload: p.Payload}
		value, err = x402.EncodeHeader(v1)
		return x402.HeaderXPayment, value, err
	}
	value, err = x402.EncodeHeader(p)
	return x402.HeaderPaymentSignature, value, err
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

// payerChain reads what a payer needs from the chain: its time and the token's allowance and nonces.
type payerChain struct {
	client  *ethclient.Client
	raw     string // the URL as given, to scrub from errors
	name    string // the URL without credentials, path or query, for messages
	chainID *big.Int
}

// dialPayerChain connects to rawURL and reads the chain ID, so that an unreachable RPC fails before anything
// is signed.
func dialPayerChain(ctx context.Context, rawURL string) (*payerChain, error) {
	c := &payerChain{raw: rawURL, name: redactURL(rawURL)}
	client, err := ethclient.DialContext(ctx, rawURL)
	if err != nil {
		return nil, c.wrap("connecting to --rpc", err)
	}
	c.client = client
	if c.chainID, err = client.ChainID(ctx); err != nil {
		client.Close()
		return nil, c.wrap("reading the chain ID from --rpc", err)
	}
	return c, nil
}

func (c *payerChain) close() { c.client.Close() }

// now is the head block's time: the clock the facilitator judges deadlines by, which may run ahead of the
// wall clock.
func (c *payerChain) now(ctx context.Context) (time.Time, error) {
	head, err := c.client.HeaderByNumber(ctx, nil)
	if err != nil {
		return time.Time{}, c.wrap("reading the head block from --rpc", err)
	}
	return time.Unix(int64(head.Time), 0), nil
}

// callUint calls a uint256 view of the token (allowance, nonces).
func (c *payerChain) callUint(ctx context.Context, token common.Address, method string, args ...any) (*big.Int, error) {
	v, err := chain.CallTokenUint(ctx, c.client, token, method, args...)
	if err != nil {
		return nil, c.wrap(fmt.Sprintf("reading %s on token %s through --rpc", method, token.Hex()), err)
	}
	return v, nil
}

// wrap names the RPC by its redacted URL and scrubs the full one from err's text: providers put API keys in
// RPC URLs, and transport errors quote the URL.
func (c *payerChain) wrap(what string, err error) error {
	return &rpcError{msg: fmt.Sprintf("%s %s: %s", what, c.name, strings.ReplaceAll(err.Error(), c.raw, c.name)), err: err}
}

// rpcError is an RPC failure whose text names the endpoint without its secrets.
type rpcError struct {
	msg string
	err error
}

func (e *rpcError) Error() string { return e.msg }
func (e *rpcError) Unwrap() error { return e.err }
