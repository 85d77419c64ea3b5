package x402

import (
	"encoding/json"
	"fmt"
)

// PaymentRequirementsV1 is one way to pay in version 1: the amount is maxAmountRequired, the network a name,
// and the resource is described per requirement rather than once per answer.
type PaymentRequirementsV1 struct {
	Scheme            string          `json:"scheme"`
	Network           string          `json:"network"`
	MaxAmountRequired string          `json:"maxAmountRequired"`
	Resource          string          `json:"resource"`
	Description       string          `json:"description"`
	MimeType          string          `json:"mimeType"`
	OutputSchema      json.RawMessage `json:"outputSchema,omitempty"`
	PayTo             string          `json:"payTo"`
	MaxTimeoutSeconds int64           `json:"maxTimeoutSeconds"`
	Asset             string          `json:"asset"`
	Extra             *Extra          `json:"extra,omitempty"`
}

// PaymentRequiredV1 is the JSON body of a version 1 402 answer.
type PaymentRequiredV1 struct {
	X402Version int                     `json:"x402Version"`
	Error       string                  `json:"error,omitempty"`
	Accepts     []PaymentRequirementsV1 `json:"accepts"`
}

// PaymentPayloadV1 is the client's payment in version 1, Base64-encoded in the X-PAYMENT header. It names scheme
// and network itself instead of echoing the chosen requirement.
type PaymentPayloadV1 struct {
	X402Version int             `json:"x402Version"`
	Scheme      string          `json:"scheme"`
	Network     string          `json:"network"`
	Payload     ExactEVMPayload `json:"payload"`
}

// RequirementsFromV1 converts a version 1 requirement to version 2: the network name becomes its CAIP-2
// identifier, and the per-requirement resource fields come back as the ResourceInfo of the answer.
func (r *Registry) RequirementsFromV1(v1 PaymentRequirementsV1) (PaymentRequirements, ResourceInfo, error) {
	network, err := r.CAIP2(v1.Network)
	if err != nil {
		return PaymentRequirements{}, ResourceInfo{}, fmt.Errorf("convert requirements to version 2: %w", err)
	}
	req := PaymentRequirements{
		Scheme:            v1.Scheme,
		Network:           network,
		Amount:            v1.MaxAmountRequired,
		Asset:             v1.Asset,
		PayTo:             v1.PayTo,
		MaxTimeoutSeconds: v1.MaxTimeoutSeconds,
	}
	if v1.Extra != nil {
		req.Extra = *v1.Extra
	}
	return req, ResourceInfo{URL: v1.Resource, Description: v1.Description, MimeType: v1.MimeType}, nil
}

// RequirementsToV1 converts a version 2 requirement and the resource it pays for to version 1.
func (r *Registry) RequirementsToV1(req PaymentRequirements, res ResourceInfo) (PaymentRequirementsV1, error) {
	name, err := r.V1Name(req.Network)
	if err != nil {
		return PaymentRequirementsV1{}, fmt.Errorf("convert requirements to version 1: %w", err)
	}
	v1 := PaymentRequirementsV1{
		Scheme:            req.Scheme,
		Network:           name,
		MaxAmountRequired: req.Amount,
		Resource:          res.URL,
		Description:       res.Description,
		MimeType:          res.MimeType,
		PayTo:             req.PayTo,
		MaxTimeoutSeconds: req.MaxTimeoutSeconds,
		Asset:             req.Asset,
	}
	if req.Extra != (Extra{}) {
		extra := req.Extra
		v1.Extra = &extra
	}
	return v1, nil
}

// PaymentRequiredToV1 converts a version 2 402 answer to the version 1 body. Extensions have no version 1 form
// and are dropped.
func (r *Registry) PaymentRequiredToV1(p PaymentRequired) (PaymentRequiredV1, error) {
	out := PaymentRequiredV1{X402Version: Version1, Error: p.Error, Accepts: make([]PaymentRequirementsV1, 0, len(p.Accepts))}
	for i, req := range p.Accepts {
		v1, err := r.RequirementsToV1(req, p.Resource)
		if err != nil {
			return PaymentRequiredV1{}, fmt.Errorf("accepts[%d]: %w", i, err)
		}
		out.Accepts = append(out.Accepts, v1)
	}
	return out, nil
}

// PaymentRequiredFromV1 converts a version 1 402 body to version 2. Version 2 describes one resource per answer,
// so every requirement must name the same resource URL; the description and MIME type of the first are kept.
func (r *Registry) PaymentRequiredFromV1(p PaymentRequiredV1) (PaymentRequired, error) {
	out := PaymentRequired{X402Version: Version2, Error: p.Error, Accepts: make([]PaymentRequirements, 0, len(p.Accepts))}
	for i, v1 := range p.Accepts {
		req, res, err := r.RequirementsFromV1(v1)
		if err != nil {
			return PaymentRequired{}, fmt.Errorf("accepts[%d]: %w", i, err)
		}
		if i == 0 {
			out.Resource = res
		} else if res.URL != out.Resource.URL {
			return PaymentRequired{}, fmt.Errorf("accepts[%d]: resource %q differs from accepts[0]'s %q; version 2 has one resource per answer",
				i, res.URL, out.Resource.URL)
		}
		out.Accepts = append(out.Accepts, req)
	}
	return out, nil
}

// PaymentPayloadToV1 converts a version 2 payment to version 1: scheme and network are taken from the accepted
// requirement. Resource and extensions have no version 1 form and are dropped.
func (r *Registry) PaymentPayloadToV1(p PaymentPayload) (PaymentPayloadV1, error) {
	name, err := r.V1Name(p.Accepted.Network)
	if err != nil {
		return PaymentPayloadV1{}, fmt.Errorf("convert payment to version 1: %w", err)
	}
	return PaymentPayloadV1{X402Version: Version1, Scheme: p.Accepted.Scheme, Network: name, Payload: p.Payload}, nil
}

// PaymentPayloadFromV1 converts a version 1 payment to version 2. Version 1 does not echo the requirement it pays,
// so the caller passes the one it offered (version 2 form); its scheme and network must match the payment's.
func (r *Registry) PaymentPayloadFromV1(p PaymentPayloadV1, accepted PaymentRequirements) (PaymentPayload, error) {
	network, err := r.CAIP2(p.Network)
	if err != nil {
		return PaymentPayload{}, fmt.Errorf("convert payment to version 2: %w", err)
	}
	if p.Scheme != accepted.Scheme || network != accepted.Network {
		return PaymentPayload{}, fmt.Errorf("convert payment to version 2: payment is for %q on %s but the requirement is %q on %s",
			p.Scheme, network, accepted.Scheme, accepted.Network)
	}
	return PaymentPayload{X402Version: Version2, Accepted: accepted, Payload: p.Payload}, nil
}
