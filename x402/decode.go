package x402

import (
	"encoding/json"
	"fmt"
)

// This file holds one reader method per wire type. Each reads its object, records wrong types and duplicate
// keys as it goes, tolerates unknown keys (peers add fields), and checks its required fields once the object
// is complete. Required strings must be non-empty unless noted.

// first marks bit as seen, or records a duplicate key and returns false so the caller skips the value.
func (r *jsonReader) first(seen *uint32, bit uint32, at *fieldPath) bool {
	if *seen&bit != 0 {
		r.duplicate(at)
		return false
	}
	*seen |= bit
	return true
}

// require records a missing required field: absent (seen false) or present but empty or null.
func (r *jsonReader) require(at *fieldPath, name string, seen, empty bool) {
	if seen && !empty {
		return
	}
	f := at.key(name)
	if !seen {
		r.fail(DecodeMissingField, f.String(), "is missing")
	} else {
		r.fail(DecodeMissingField, f.String(), "is empty or null, expected a value")
	}
}

// paymentWire is a payment of either version as read, before the version decides which fields must be there.
type paymentWire struct {
	present     bool // the payment object was there (not absent or null)
	version     int64
	hasVersion  bool
	resource    *ResourceInfo
	accepted    PaymentRequirements
	hasAccepted bool
	scheme      string // version 1
	network     string // version 1
	seen        uint32
	payload     ExactEVMPayload
	hasPayload  bool
	extensions  map[string]json.RawMessage
}

const (
	pwVersion uint32 = 1 << iota
	pwResource
	pwAccepted
	pwScheme
	pwNetwork
	pwPayload
	pwExtensions
)

func (r *jsonReader) payment(at *fieldPath, w *paymentWire) (bool, error) {
	var err error
	w.present, err = r.object(at, func(key string) error {
		f := at.key(key)
		var err error
		switch key {
		case "x402Version":
			if r.first(&w.seen, pwVersion, &f) {
				w.version, w.hasVersion, err = r.integer(&f)
				return err
			}
		case "resource":
			if r.first(&w.seen, pwResource, &f) {
				res := new(ResourceInfo)
				var ok bool
				if ok, err = r.resource(&f, res, false); ok {
					w.resource = res
				}
				return err
			}
		case "accepted":
			if r.first(&w.seen, pwAccepted, &f) {
				w.hasAccepted, err = r.requirements(&f, &w.accepted)
				return err
			}
		case "scheme":
			if r.first(&w.seen, pwScheme, &f) {
				w.scheme, _, err = r.str(&f)
				return err
			}
		case "network":
			if r.first(&w.seen, pwNetwork, &f) {
				w.network, _, err = r.str(&f)
				return err
			}
		case "payload":
			if r.first(&w.seen, pwPayload, &f) {
				w.hasPayload, err = r.exactPayload(&f, &w.payload)
				return err
			}
		case "extensions":
			if r.first(&w.seen, pwExtensions, &f) {
				w.extensions, err = r.extensions(&f)
				return err
			}
		}
		return r.skipValue()
	})
	return w.present, err
}

// checkPayment checks the fields the payment's version requires (once the version is known to be 1 or 2).
func (r *jsonReader) checkPayment(at *fieldPath, w *paymentWire) {
	if w.version == Version1 {
		r.require(at, "scheme", w.seen&pwScheme != 0, w.scheme == "")
		r.require(at, "network", w.seen&pwNetwork != 0, w.network == "")
	} else {
		r.require(at, "accepted", w.seen&pwAccepted != 0, !w.hasAccepted)
	}
	r.require(at, "payload", w.seen&pwPayload != 0, !w.hasPayload)
}

// versionSet is a set of protocol versions, one bit per version.
type versionSet uint8

const (
	onlyV1 versionSet = 1 << Version1
	onlyV2 versionSet = 1 << Version2
	v1OrV2            = onlyV1 | onlyV2
)

func (s versionSet) has(v int64) bool { return v >= 0 && v < 8 && s&(1<<v) != 0 }

func (s versionSet) String() string {
	switch s {
	case onlyV1:
		return "version 1"
	case onlyV2:
		return "version 2"
	default:
		return "version 1 or 2"
	}
}

// checkVersion records an absent or unsupported x402Version and reports whether the version is one of want.
// An unsupported version is reported before any other error: the other problems are likely just the other
// version's shape.
func (r *jsonReader) checkVersion(at *fieldPath, version int64, present bool, doc string, want versionSet) bool {
	f := at.key("x402Version")
	if r.err != nil && (r.err.Field == f.String() || r.err.Field == at.String()) {
		return false // a wrong type or a duplicate of the version or its object already says what is wrong
	}
	if !present {
		r.err = &DecodeError{Kind: DecodeMissingField, Field: f.String(), Detail: "is missing; expected " + want.String()}
		return false
	}
	if want.has(version) {
		return true
	}
	detail := fmt.Sprintf("is %d; %s must be %s", version, doc, want)
	if version == Version1 && want == onlyV2 && at == nil && doc == docPaymentVersioned {
		detail += " (a version 1 payment goes in the X-PAYMENT header, or re-sign it as version 2)"
	}
	r.err = &DecodeError{Kind: DecodeUnsupportedVersion, Field: f.String(), Detail: detail}
	return false
}

const (
	rqScheme uint32 = 1 << iota
	rqNetwork
	rqAmount
	rqAsset
	rqPayTo
	rqTimeout
	rqExtra
)

// requirements reads a version 2 PaymentRequirements (spec 2.6: every field required).
func (r *jsonReader) requirements(at *fieldPath, req *PaymentRequirements) (bool, error) {
	var seen uint32
	var hasTimeout, hasExtra bool
	present, err := r.object(at, func(key string) error {
		f := at.key(key)
		var err error
		switch key {
		case "scheme":
			if r.first(&seen, rqScheme, &f) {
				req.Scheme, _, err = r.str(&f)
				return err
			}
		case "network":
			if r.first(&seen, rqNetwork, &f) {
				req.Network, _, err = r.str(&f)
				return err
			}
		case "amount":
			if r.first(&seen, rqAmount, &f) {
				req.Amount, _, err = r.str(&f)
				return err
			}
		case "asset":
			if r.first(&seen, rqAsset, &f) {
				req.Asset, _, err = r.str(&f)
				return err
			}
		case "payTo":
			if r.first(&seen, rqPayTo, &f) {
				req.PayTo, _, err = r.str(&f)
				return err
			}
		case "maxTimeoutSeconds":
			if r.first(&seen, rqTimeout, &f) {
				req.MaxTimeoutSeconds, hasTimeout, err = r.integer(&f)
				return err
			}
		case "extra":
			if r.first(&seen, rqExtra, &f) {
				hasExtra, err = r.extra(&f, &req.Extra)
				return err
			}
		}
		return r.skipValue()
	})
	if err != nil || !present {
		return present, err
	}
	r.require(at, "scheme", seen&rqScheme != 0, req.Scheme == "")
	r.require(at, "network", seen&rqNetwork != 0, req.Network == "")
	r.require(at, "amount", seen&rqAmount != 0, req.Amount == "")
	r.require(at, "asset", seen&rqAsset != 0, req.Asset == "")
	r.require(at, "payTo", seen&rqPayTo != 0, req.PayTo == "")
	r.require(at, "maxTimeoutSeconds", seen&rqTimeout != 0, !hasTimeout)
	r.require(at, "extra", seen&rqExtra != 0, !hasExtra)
	r.checkTimeout(at, hasTimeout, req.MaxTimeoutSeconds)
	return true, nil
}

// nullElement records an array element that is null where the array holds objects: an absent object member may
// be null, but an element must be there.
func (r *jsonReader) nullElement(at *fieldPath, want string) {
	r.fail(DecodeWrongType, at.String(), "got null, expected "+want)
}

// checkTimeout refuses a timeout that is not a positive number of seconds.
func (r *jsonReader) checkTimeout(at *fieldPath, present bool, seconds int64) {
	if present && seconds <= 0 {
		f := at.key("maxTimeoutSeconds")
		r.fail(DecodeInvalidValue, f.String(), fmt.Sprintf("is %d, expected a positive number of seconds", seconds))
	}
}

const (
	rv1Scheme uint32 = 1 << iota
	rv1Network
	rv1Amount
	rv1Resource
	rv1Description
	rv1MimeType
	rv1OutputSchema
	rv1PayTo
	rv1Timeout
	rv1Asset
	rv1Extra
)

// requirementsV1 reads a version 1 PaymentRequirements. Description and mimeType may be empty or absent, as
// many version 1 servers leave them out; outputSchema and extra are optional.
func (r *jsonReader) requirementsV1(at *fieldPath, req *PaymentRequirementsV1) (bool, error) {
	var seen uint32
	var hasTimeout bool
	present, err := r.object(at, func(key string) error {
		f := at.key(key)
		var err error
		switch key {
		case "scheme":
			if r.first(&seen, rv1Scheme, &f) {
				req.Scheme, _, err = r.str(&f)
				return err
			}
		case "network":
			if r.first(&seen, rv1Network, &f) {
				req.Network, _, err = r.str(&f)
				return err
			}
		case "maxAmountRequired":
			if r.first(&seen, rv1Amount, &f) {
				req.MaxAmountRequired, _, err = r.str(&f)
				return err
			}
		case "resource":
			if r.first(&seen, rv1Resource, &f) {
				req.Resource, _, err = r.str(&f)
				return err
			}
		case "description":
			if r.first(&seen, rv1Description, &f) {
				req.Description, _, err = r.str(&f)
				return err
			}
		case "mimeType":
			if r.first(&seen, rv1MimeType, &f) {
				req.MimeType, _, err = r.str(&f)
				return err
			}
		case "outputSchema":
			if r.first(&seen, rv1OutputSchema, &f) {
				var raw string
				if raw, err = r.raw(); err == nil && raw != "null" {
					req.OutputSchema = json.RawMessage(raw)
				}
				return err
			}
		case "payTo":
			if r.first(&seen, rv1PayTo, &f) {
				req.PayTo, _, err = r.str(&f)
				return err
			}
		case "maxTimeoutSeconds":
			if r.first(&seen, rv1Timeout, &f) {
				req.MaxTimeoutSeconds, hasTimeout, err = r.integer(&f)
				return err
			}
		case "asset":
			if r.first(&seen, rv1Asset, &f) {
				req.Asset, _, err = r.str(&f)
				return err
			}
		case "extra":
			if r.first(&seen, rv1Extra, &f) {
				extra := new(Extra)
				var ok bool
				if ok, err = r.extra(&f, extra); ok {
					req.Extra = extra
				}
				return err
			}
		}
		return r.skipValue()
	})
	if err != nil || !present {
		return present, err
	}
	r.require(at, "scheme", seen&rv1Scheme != 0, req.Scheme == "")
	r.require(at, "network", seen&rv1Network != 0, req.Network == "")
	r.require(at, "maxAmountRequired", seen&rv1Amount != 0, req.MaxAmountRequired == "")
	r.require(at, "resource", seen&rv1Resource != 0, req.Resource == "")
	r.require(at, "payTo", seen&rv1PayTo != 0, req.PayTo == "")
	r.require(at, "maxTimeoutSeconds", seen&rv1Timeout != 0, !hasTimeout)
	r.require(at, "asset", seen&rv1Asset != 0, req.Asset == "")
	r.checkTimeout(at, hasTimeout, req.MaxTimeoutSeconds)
	return true, nil
}

const (
	exMethod uint32 = 1 << iota
	exName
	exVersion
	exSpender
	exPermit2
	exProxy
)

// extra reads the scheme metadata; all of its fields are optional and unknown ones are dropped.
func (r *jsonReader) extra(at *fieldPath, e *Extra) (bool, error) {
	var seen uint32
	return r.object(at, func(key string) error {
		f := at.key(key)
		var dst *string
		switch key {
		case "assetTransferMethod":
			if r.first(&seen, exMethod, &f) {
				dst = &e.AssetTransferMethod
			}
		case "name":
			if r.first(&seen, exName, &f) {
				dst = &e.Name
			}
		case "version":
			if r.first(&seen, exVersion, &f) {
				dst = &e.Version
			}
		case "spender":
			if r.first(&seen, exSpender, &f) {
				dst = &e.Spender
			}
		case "permit2Address":
			if r.first(&seen, exPermit2, &f) {
				dst = &e.Permit2Address
			}
		case "x402Permit2ProxyAddress":
			if r.first(&seen, exProxy, &f) {
				dst = &e.X402Permit2ProxyAddress
			}
		}
		if dst == nil {
			return r.skipValue()
		}
		var err error
		*dst, _, err = r.str(&f)
		return err
	})
}

const (
	riURL uint32 = 1 << iota
	riDescription
	riMimeType
)

// resource reads a ResourceInfo; the url is required only where the spec requires it (PaymentRequired).
func (r *jsonReader) resource(at *fieldPath, res *ResourceInfo, needURL bool) (bool, error) {
	var seen uint32
	present, err := r.object(at, func(key string) error {
		f := at.key(key)
		var dst *string
		switch key {
		case "url":
			if r.first(&seen, riURL, &f) {
				dst = &res.URL
			}
		case "description":
			if r.first(&seen, riDescription, &f) {
				dst = &res.Description
			}
		case "mimeType":
			if r.first(&seen, riMimeType, &f) {
				dst = &res.MimeType
			}
		}
		if dst == nil {
			return r.skipValue()
		}
		var err error
		*dst, _, err = r.str(&f)
		return err
	})
	if err == nil && present && needURL {
		r.require(at, "url", seen&riURL != 0, res.URL == "")
	}
	return present, err
}

const (
	epSignature uint32 = 1 << iota
	epAuthorization
	epPermit2
)

// exactPayload reads the signed part of an exact EVM payment: a signature and exactly one authorization.
func (r *jsonReader) exactPayload(at *fieldPath, p *ExactEVMPayload) (bool, error) {
	var seen uint32
	present, err := r.object(at, func(key string) error {
		f := at.key(key)
		var err error
		switch key {
		case "signature":
			if r.first(&seen, epSignature, &f) {
				p.Signature, _, err = r.str(&f)
				return err
			}
		case "authorization":
			if r.first(&seen, epAuthorization, &f) {
				a := new(EIP2612Authorization)
				var ok bool
				if ok, err = r.authorization(&f, a); ok {
					p.Authorization = a
				}
				return err
			}
		case "permit2Authorization":
			if r.first(&seen, epPermit2, &f) {
				a := new(Permit2Authorization)
				var ok bool
				if ok, err = r.permit2Authorization(&f, a); ok {
					p.Permit2Authorization = a
				}
				return err
			}
		}
		return r.skipValue()
	})
	if err != nil || !present {
		return present, err
	}
	r.require(at, "signature", seen&epSignature != 0, p.Signature == "")
	switch {
	case p.Authorization == nil && p.Permit2Authorization == nil:
		f := at.key("authorization")
		r.fail(DecodeMissingField, f.String(),
			"is missing: expected exactly one of authorization (erc2612) or permit2Authorization (permit2)")
	case p.Authorization != nil && p.Permit2Authorization != nil:
		r.fail(DecodeInvalidValue, at.String(),
			"has both authorization and permit2Authorization, expected exactly one")
	}
	return true, nil
}

const (
	auFrom uint32 = 1 << iota
	auTo
	auValue
	auValidAfter
	auValidBefore
	auNonce
)

// authorization reads an EIP-2612 authorization; all six fields are required strings.
func (r *jsonReader) authorization(at *fieldPath, a *EIP2612Authorization) (bool, error) {
	var seen uint32
	present, err := r.object(at, func(key string) error {
		f := at.key(key)
		var dst *string
		switch key {
		case "from":
			if r.first(&seen, auFrom, &f) {
				dst = &a.From
			}
		case "to":
			if r.first(&seen, auTo, &f) {
				dst = &a.To
			}
		case "value":
			if r.first(&seen, auValue, &f) {
				dst = &a.Value
			}
		case "validAfter":
			if r.first(&seen, auValidAfter, &f) {
				dst = &a.ValidAfter
			}
		case "validBefore":
			if r.first(&seen, auValidBefore, &f) {
				dst = &a.ValidBefore
			}
		case "nonce":
			if r.first(&seen, auNonce, &f) {
				dst = &a.Nonce
			}
		}
		if dst == nil {
			return r.skipValue()
		}
		var err error
		*dst, _, err = r.str(&f)
		return err
	})
	if err != nil || !present {
		return present, err
	}
	r.require(at, "from", seen&auFrom != 0, a.From == "")
	r.require(at, "to", seen&auTo != 0, a.To == "")
	r.require(at, "value", seen&auValue != 0, a.Value == "")
	r.require(at, "validAfter", seen&auValidAfter != 0, a.ValidAfter == "")
	r.require(at, "validBefore", seen&auValidBefore != 0, a.ValidBefore == "")
	r.require(at, "nonce", seen&auNonce != 0, a.Nonce == "")
	return true, nil
}

const (
	p2From uint32 = 1 << iota
	p2Permitted
	p2Spender
	p2Nonce
	p2Deadline
	p2Witness
	p2Token
	p2Amount
	p2To
	p2ValidAfter
)

// permit2Authorization reads a Permit2 authorization with its permitted and witness objects; every field is
// a required string.
func (r *jsonReader) permit2Authorization(at *fieldPath, a *Permit2Authorization) (bool, error) {
	var seen uint32
	var hasPermitted, hasWitness bool
	present, err := r.object(at, func(key string) error {
		f := at.key(key)
		var dst *string
		var err error
		switch key {
		case "from":
			if r.first(&seen, p2From, &f) {
				dst = &a.From
			}
		case "spender":
			if r.first(&seen, p2Spender, &f) {
				dst = &a.Spender
			}
		case "nonce":
			if r.first(&seen, p2Nonce, &f) {
				dst = &a.Nonce
			}
		case "deadline":
			if r.first(&seen, p2Deadline, &f) {
				dst = &a.Deadline
			}
		case "permitted":
			if r.first(&seen, p2Permitted, &f) {
				hasPermitted, err = r.stringPair(&f, &seen, "token", p2Token, &a.Permitted.Token, "amount", p2Amount, &a.Permitted.Amount)
				return err
			}
		case "witness":
			if r.first(&seen, p2Witness, &f) {
				hasWitness, err = r.stringPair(&f, &seen, "to", p2To, &a.Witness.To, "validAfter", p2ValidAfter, &a.Witness.ValidAfter)
				return err
			}
		}
		if dst == nil {
			return r.skipValue()
		}
		*dst, _, err = r.str(&f)
		return err
	})
	if err != nil || !present {
		return present, err
	}
	r.require(at, "from", seen&p2From != 0, a.From == "")
	r.require(at, "permitted", seen&p2Permitted != 0, !hasPermitted)
	if hasPermitted {
		f := at.key("permitted")
		r.require(&f, "token", seen&p2Token != 0, a.Permitted.Token == "")
		r.require(&f, "amount", seen&p2Amount != 0, a.Permitted.Amount == "")
	}
	r.require(at, "spender", seen&p2Spender != 0, a.Spender == "")
	r.require(at, "nonce", seen&p2Nonce != 0, a.Nonce == "")
	r.require(at, "deadline", seen&p2Deadline != 0, a.Deadline == "")
	r.require(at, "witness", seen&p2Witness != 0, !hasWitness)
	if hasWitness {
		f := at.key("witness")
		r.require(&f, "to", seen&p2To != 0, a.Witness.To == "")
		r.require(&f, "validAfter", seen&p2ValidAfter != 0, a.Witness.ValidAfter == "")
	}
	return true, nil
}

// stringPair reads an object of two string members (TokenPermissions, Permit2Witness), marking their bits in seen.
func (r *jsonReader) stringPair(at *fieldPath, seen *uint32, k1 string, b1 uint32, v1 *string, k2 string, b2 uint32, v2 *string) (bool, error) {
	return r.object(at, func(key string) error {
		f := at.key(key)
		var dst *string
		switch key {
		case k1:
			if r.first(seen, b1, &f) {
				dst = v1
			}
		case k2:
			if r.first(seen, b2, &f) {
				dst = v2
			}
		}
		if dst == nil {
			return r.skipValue()
		}
		var err error
		*dst, _, err = r.str(&f)
		return err
	})
}

// extensions reads an extensions object, keeping each value as compact raw JSON. An empty object reads as nil,
// so that decoding what was encoded (where an empty map is omitted) gives the same value.
func (r *jsonReader) extensions(at *fieldPath) (map[string]json.RawMessage, error) {
	var m map[string]json.RawMessage
	_, err := r.object(at, func(key string) error {
		raw, err := r.raw()
		if err != nil {
			return err
		}
		if _, dup := m[key]; dup {
			f := at.key(key)
			r.duplicate(&f)
			return nil
		}
		if m == nil {
			m = make(map[string]json.RawMessage, 2)
		}
		m[key] = json.RawMessage(raw)
		return nil
	})
	return m, err
}

const (
	vqVersion uint32 = 1 << iota
	vqPayload
	vqRequirements
)

// verifyRequest reads the body of /verify and /settle.
func (r *jsonReader) verifyRequest(req *VerifyRequest, w *paymentWire) (version int64, hasVersion bool, err error) {
	var seen uint32
	var hasPayload, hasRequirements bool
	_, err = r.object(nil, func(key string) error {
		f := (*fieldPath)(nil).key(key)
		var err error
		switch key {
		case "x402Version":
			if r.first(&seen, vqVersion, &f) {
				version, hasVersion, err = r.integer(&f)
				return err
			}
		case "paymentPayload":
			if r.first(&seen, vqPayload, &f) {
				hasPayload, err = r.payment(&f, w)
				return err
			}
		case "paymentRequirements":
			if r.first(&seen, vqRequirements, &f) {
				hasRequirements, err = r.requirements(&f, &req.PaymentRequirements)
				return err
			}
		}
		return r.skipValue()
	})
	if err != nil {
		return version, hasVersion, err
	}
	if !hasPayload {
		r.require(nil, "paymentPayload", seen&vqPayload != 0, true)
	}
	if !hasRequirements {
		r.require(nil, "paymentRequirements", seen&vqRequirements != 0, true)
	}
	return version, hasVersion, nil
}

const (
	prVersion uint32 = 1 << iota
	prError
	prResource
	prAccepts
	prExtensions
)

// paymentRequired reads a version 2 PaymentRequired (spec 2.6).
func (r *jsonReader) paymentRequired(p *PaymentRequired) (version int64, hasVersion bool, err error) {
	var seen uint32
	var hasResource, hasAccepts bool
	_, err = r.object(nil, func(key string) error {
		f := (*fieldPath)(nil).key(key)
		var err error
		switch key {
		case "x402Version":
			if r.first(&seen, prVersion, &f) {
				version, hasVersion, err = r.integer(&f)
				return err
			}
		case "error":
			if r.first(&seen, prError, &f) {
				p.Error, _, err = r.str(&f)
				return err
			}
		case "resource":
			if r.first(&seen, prResource, &f) {
				hasResource, err = r.resource(&f, &p.Resource, true)
				return err
			}
		case "accepts":
			if r.first(&seen, prAccepts, &f) {
				p.Accepts = []PaymentRequirements{}
				hasAccepts, err = r.array(&f, func(i int) error {
					e := f.elem(i)
					p.Accepts = append(p.Accepts, PaymentRequirements{})
					present, err := r.requirements(&e, &p.Accepts[i])
					if err == nil && !present {
						r.nullElement(&e, "a requirement object")
					}
					return err
				})
				return err
			}
		case "extensions":
			if r.first(&seen, prExtensions, &f) {
				p.Extensions, err = r.extensions(&f)
				return err
			}
		}
		return r.skipValue()
	})
	if err != nil {
		return version, hasVersion, err
	}
	r.require(nil, "resource", seen&prResource != 0, !hasResource)
	r.require(nil, "accepts", seen&prAccepts != 0, !hasAccepts)
	if !hasAccepts {
		p.Accepts = nil
	}
	return version, hasVersion, nil
}

// paymentRequiredV1 reads the JSON body of a version 1 402 answer.
func (r *jsonReader) paymentRequiredV1(p *PaymentRequiredV1) (version int64, hasVersion bool, err error) {
	var seen uint32
	var hasAccepts bool
	_, err = r.object(nil, func(key string) error {
		f := (*fieldPath)(nil).key(key)
		var err error
		switch key {
		case "x402Version":
			if r.first(&seen, prVersion, &f) {
				version, hasVersion, err = r.integer(&f)
				return err
			}
		case "error":
			if r.first(&seen, prError, &f) {
				p.Error, _, err = r.str(&f)
				return err
			}
		case "accepts":
			if r.first(&seen, prAccepts, &f) {
				p.Accepts = []PaymentRequirementsV1{}
				hasAccepts, err = r.array(&f, func(i int) error {
					e := f.elem(i)
					p.Accepts = append(p.Accepts, PaymentRequirementsV1{})
					present, err := r.requirementsV1(&e, &p.Accepts[i])
					if err == nil && !present {
						r.nullElement(&e, "a requirement object")
					}
					return err
				})
				return err
			}
		}
		return r.skipValue()
	})
	if err != nil {
		return version, hasVersion, err
	}
	r.require(nil, "accepts", seen&prAccepts != 0, !hasAccepts)
	if !hasAccepts {
		p.Accepts = nil
	}
	return version, hasVersion, nil
}

const (
	rsSuccess uint32 = 1 << iota
	rsTransaction
	rsNetwork
	rsPayer
	rsAmount
	rsReason
	rsMessage
	rsExtensions
)

// settleResponse reads a SettleResponse. Only success is required: a peer's answer with success and a reason is
// an answer, and the facts sheet's "transaction and network always present" is ours to keep, not to demand.
func (r *jsonReader) settleResponse(s *SettleResponse) error {
	var seen uint32
	var hasSuccess bool
	_, err := r.object(nil, func(key string) error {
		f := (*fieldPath)(nil).key(key)
		var dst *string
		var err error
		switch key {
		case "success":
			if r.first(&seen, rsSuccess, &f) {
				s.Success, hasSuccess, err = r.boolean(&f)
				return err
			}
		case "transaction":
			if r.first(&seen, rsTransaction, &f) {
				dst = &s.Transaction
			}
		case "network":
			if r.first(&seen, rsNetwork, &f) {
				dst = &s.Network
			}
		case "payer":
			if r.first(&seen, rsPayer, &f) {
				dst = &s.Payer
			}
		case "amount":
			if r.first(&seen, rsAmount, &f) {
				dst = &s.Amount
			}
		case "errorReason":
			if r.first(&seen, rsReason, &f) {
				dst = &s.ErrorReason
			}
		case "errorMessage":
			if r.first(&seen, rsMessage, &f) {
				dst = &s.ErrorMessage
			}
		case "extensions":
			if r.first(&seen, rsExtensions, &f) {
				s.Extensions, err = r.extensions(&f)
				return err
			}
		}
		if dst == nil {
			return r.skipValue()
		}
		*dst, _, err = r.str(&f)
		return err
	})
	if err != nil {
		return err
	}
	r.require(nil, "success", seen&rsSuccess != 0, !hasSuccess)
	return nil
}

const (
	vrValid uint32 = 1 << iota
	vrPayer
	vrReason
	vrMessage
	vrExtensions
)

// verifyResponse reads a VerifyResponse; only isValid is required.
func (r *jsonReader) verifyResponse(v *VerifyResponse) error {
	var seen uint32
	var hasValid bool
	_, err := r.object(nil, func(key string) error {
		f := (*fieldPath)(nil).key(key)
		var dst *string
		var err error
		switch key {
		case "isValid":
			if r.first(&seen, vrValid, &f) {
				v.IsValid, hasValid, err = r.boolean(&f)
				return err
			}
		case "payer":
			if r.first(&seen, vrPayer, &f) {
				dst = &v.Payer
			}
		case "invalidReason":
			if r.first(&seen, vrReason, &f) {
				dst = &v.InvalidReason
			}
		case "invalidMessage":
			if r.first(&seen, vrMessage, &f) {
				dst = &v.InvalidMessage
			}
		case "extensions":
			if r.first(&seen, vrExtensions, &f) {
				v.Extensions, err = r.extensions(&f)
				return err
			}
		}
		if dst == nil {
			return r.skipValue()
		}
		*dst, _, err = r.str(&f)
		return err
	})
	if err != nil {
		return err
	}
	r.require(nil, "isValid", seen&vrValid != 0, !hasValid)
	return nil
}
