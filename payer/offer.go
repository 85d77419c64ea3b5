package payer

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"

	"github.com/x402-gateway/caddy-x402/x402"
)

// Offer is what a 402 answer offers, in version 2 form whatever version the server speaks.
type Offer struct {
	// Version is the x402 version the server speaks, and the one the payment is sent in.
	Version int
	// Required is the offer; a version 1 offer's requirements are converted to version 2 form.
	Required x402.PaymentRequired

	// v1Networks are the networks of a version 1 offer as the server spelled them (names, not CAIP-2), for
	// the X-PAYMENT payload that must repeat them.
	v1Networks []string
	// accepts are a version 2 offer's requirements as the server wrote them, and batch, by the same index, those
	// of scheme batch-settlement decoded as such (their extra names a channel's terms); nil elsewhere.
	accepts []json.RawMessage
	batch   []*x402.BatchRequirements
}

// Batch returns requirement i as a batch-settlement requirement, when it is one.
func (o Offer) Batch(i int) (x402.BatchRequirements, bool) {
	if br := o.batchAt(i); br != nil {
		return *br, true
	}
	return x402.BatchRequirements{}, false
}

// batchAt is requirement i as a batch-settlement requirement, or nil when it is not one.
func (o Offer) batchAt(i int) *x402.BatchRequirements {
	if i < 0 || i >= len(o.batch) {
		return nil
	}
	return o.batch[i]
}

// rawAccepted is requirement i as the server wrote it.
func (o Offer) rawAccepted(i int) (json.RawMessage, error) {
	if i < 0 || i >= len(o.accepts) {
		return nil, fmt.Errorf("payer: the offer has no requirement %d as the server wrote it", i)
	}
	return o.accepts[i], nil
}

// readBatch keeps a version 2 offer's requirements as written, and decodes those of scheme batch-settlement.
// A batch-settlement requirement that does not decode is left out of batch, and so cannot be paid; the
// chooser says why.
func (o *Offer) readBatch(header string) {
	doc, err := x402.HeaderJSON(header)
	if err != nil {
		return
	}
	var raw struct {
		Accepts []json.RawMessage `json:"accepts"`
	}
	if json.Unmarshal(doc, &raw) != nil || len(raw.Accepts) != len(o.Required.Accepts) {
		return
	}
	o.accepts = raw.Accepts
	o.batch = make([]*x402.BatchRequirements, len(raw.Accepts))
	for i, a := range o.Required.Accepts {
		if a.Scheme != x402.SchemeBatchSettlement {
			continue
		}
		if br, err := x402.UnmarshalBatchRequirements(raw.Accepts[i]); err == nil {
			o.batch[i] = &br
		}
	}
}

// ReadOffer reads the payment requirements of a 402 answer from its header and body: the PAYMENT-REQUIRED
// header (version 2), else the JSON body (version 1).
func ReadOffer(header http.Header, body []byte) (Offer, error) {
	if h := header.Get(x402.HeaderPaymentRequired); h != "" {
		p, err := x402.DecodePaymentRequired(h)
		if err != nil {
			return Offer{}, fmt.Errorf("the 402 answer's %s header: %w", x402.HeaderPaymentRequired, err)
		}
		offer := Offer{Version: x402.Version2, Required: p}
		offer.readBatch(h)
		return offer, nil
	}
	v1, err := x402.DecodePaymentRequiredV1(body)
	if err != nil {
		return Offer{}, fmt.Errorf("the 402 answer has no %s header (version 2) and its body is no version 1 offer: %w", x402.HeaderPaymentRequired, err)
	}
	offer := Offer{Version: x402.Version1, Required: x402.PaymentRequired{X402Version: x402.Version1, Error: v1.Error}}
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
			offer.Required.Resource = res
		}
		offer.Required.Accepts = append(offer.Required.Accepts, req)
		offer.v1Networks = append(offer.v1Networks, a.Network)
	}
	return offer, nil
}

// encodePayment gives the header that carries p to a server of the offer's version: PAYMENT-SIGNATURE, or
// X-PAYMENT with the network spelled as the version 1 server spelled it.
func encodePayment(offer Offer, i int, p x402.PaymentPayload) (name, value string, err error) {
	if offer.Version == x402.Version1 {
		network := p.Accepted.Network
		if i < len(offer.v1Networks) {
			network = offer.v1Networks[i]
		}
		v1 := x402.PaymentPayloadV1{X402Version: x402.Version1, Scheme: p.Accepted.Scheme, Network: network, Payload: p.Payload}
		value, err = x402.EncodeHeader(v1)
		return x402.HeaderXPayment, value, err
	}
	value, err = x402.EncodeHeader(p)
	return x402.HeaderPaymentSignature, value, err
}

// Settlement decodes the settlement response a paid request was answered with: the PAYMENT-RESPONSE header
// (version 2), else X-PAYMENT-RESPONSE (version 1). It returns nil and no error when the response carries
// neither, as the answer to a request that needed no payment does. A response with Success false names why
// in ErrorReason; one that is Pending may still settle, and must not be paid again.
func Settlement(resp *http.Response) (*x402.SettleResponse, error) {
	if resp == nil {
		return nil, nil
	}
	for _, name := range []string{x402.HeaderPaymentResponse, x402.HeaderXPaymentResponse} {
		h := resp.Header.Get(name)
		if h == "" {
			continue
		}
		s, err := x402.DecodeSettleResponse(h)
		if err != nil {
			return nil, fmt.Errorf("the %s header: %w", name, err)
		}
		return &s, nil
	}
	return nil, nil
}

// Fetch sends one request with no body, with header name set to value when name is given (a payment), and reads
// at most limit bytes of its answer's body: the probe that finds a URL's offer, and its paid retry. The answer's
// body is closed; what it returns is what was read.
func Fetch(ctx context.Context, client *http.Client, method, u, name, value string, limit int64) (*http.Response, []byte, error) {
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
	body, err := io.ReadAll(io.LimitReader(resp.Body, limit))
	if err != nil {
		return nil, nil, fmt.Errorf("reading the answer of %s: %w", r.URL.Redacted(), err)
	}
	return resp, body, nil
}
