package x402

import (
	"encoding/json"
	"fmt"
	"net/url"
	"strconv"
	"strings"
	"time"
	"unicode"
	"unicode/utf8"

	jsonv2 "github.com/go-json-experiment/json"
)

// ExtensionSignInWithX is the extension under which a 402 carries a CAIP-122 challenge (sign-in-with-x): a
// wallet that paid for the resource before answers it with a signed message in the HeaderSignInWithX header
// and is served without paying again.
const ExtensionSignInWithX = "sign-in-with-x"

// HeaderSignInWithX carries a client's answer to the challenge: Base64 of the JSON SignInWithX.
const HeaderSignInWithX = "SIGN-IN-WITH-X"

// SignInWithXMaxAge is how long after its issuedAt a signed message is taken, as the public SDK's servers take
// it: the nonce it carries is remembered as used for that long (and a little more), no longer.
const SignInWithXMaxAge = 5 * time.Minute

// SignInWithXClockSkew is how far ahead of the clock a sign-in's issuedAt may be: the gateway that issued the
// challenge and the one that takes its answer read two clocks. The nonce is remembered past issuedAt for
// SignInWithXMaxAge and a minute more, which covers it.
const SignInWithXClockSkew = 30 * time.Second

// docSignInWithX names the header in decode errors.
const docSignInWithX = "SIGN-IN-WITH-X header"

// SignatureTypeEIP191 is the signature type of an EVM chain's message (personal_sign), the only type a gate on
// EVM chains asks for.
const SignatureTypeEIP191 = "eip191"

// SignInWithXInfo is the challenge a 402 carries in extensions["sign-in-with-x"].info: the CAIP-122 fields the
// client signs, save its address and chain, which it picks from the declaration's supportedChains.
type SignInWithXInfo struct {
	Domain         string   `json:"domain"`
	URI            string   `json:"uri"`
	Statement      string   `json:"statement,omitempty"`
	Version        string   `json:"version"`
	Nonce          string   `json:"nonce"`
	IssuedAt       string   `json:"issuedAt"`
	ExpirationTime string   `json:"expirationTime,omitempty"`
	NotBefore      string   `json:"notBefore,omitempty"`
	RequestID      *string  `json:"requestId,omitempty"`
	Resources      []string `json:"resources,omitempty"`
}

// SignInWithXChain is a chain a 402 takes a sign-in on: its CAIP-2 id and the type of signature asked for.
type SignInWithXChain struct {
	ChainID string `json:"chainId"`
	Type    string `json:"type"`
}

// SignInWithXDeclaration is the extension as a 402 declares it.
type SignInWithXDeclaration struct {
	Info            SignInWithXInfo    `json:"info"`
	SupportedChains []SignInWithXChain `json:"supportedChains"`
	Schema          json.RawMessage    `json:"schema"`
}

// signInWithXSchema is the JSON schema of the payload the public SDKs declare beside the challenge.
var signInWithXSchema = func() json.RawMessage {
	str := map[string]string{"type": "string"}
	dateTime := map[string]string{"type": "string", "format": "date-time"}
	b, err := json.Marshal(map[string]any{
		"$schema": "https://json-schema.org/draft/2020-12/schema",
		"type":    "object",
		"properties": map[string]any{
			"domain": str, "address": str, "statement": str, "uri": map[string]string{"type": "string", "format": "uri"},
			"version": str, "chainId": str, "type": str, "nonce": str, "issuedAt": dateTime,
			"expirationTime": dateTime, "notBefore": dateTime, "requestId": str,
			"resources": map[string]any{"type": "array", "items": map[string]string{"type": "string", "format": "uri"}},
			"signature": str,
		},
		"required": []string{"domain", "address", "uri", "version", "chainId", "type", "nonce", "issuedAt", "signature"},
	})
	if err != nil {
		panic(err) // a constant document
	}
	return b
}()

// NewSignInWithXDeclaration is the declaration of a challenge, with the schema the public SDKs declare.
func NewSignInWithXDeclaration(info SignInWithXInfo, chains []SignInWithXChain) SignInWithXDeclaration {
	return SignInWithXDeclaration{Info: info, SupportedChains: chains, Schema: signInWithXSchema}
}

// SignInWithX is a client's answer to the challenge, as the SIGN-IN-WITH-X header carries it: the challenge's
// fields echoed, the address and chain it signs with, and its signature of the message those fields make
// (SignInWithX.Message).
type SignInWithX struct {
	Domain          string   `json:"domain"`
	Address         string   `json:"address"`
	Statement       *string  `json:"statement,omitempty"`
	URI             string   `json:"uri"`
	Version         string   `json:"version"`
	ChainID         string   `json:"chainId"`
	Type            string   `json:"type"`
	Nonce           string   `json:"nonce"`
	IssuedAt        string   `json:"issuedAt"`
	ExpirationTime  string   `json:"expirationTime,omitempty"`
	NotBefore       string   `json:"notBefore,omitempty"`
	RequestID       *string  `json:"requestId,omitempty"`
	Resources       []string `json:"resources,omitempty"`
	SignatureScheme string   `json:"signatureScheme,omitempty"`
	Signature       string   `json:"signature"`
}

// DecodeSignInWithX reads a SIGN-IN-WITH-X header: Base64 (either alphabet) of a JSON document of at most
// MaxHeaderBytes with the fields the public SDK requires, read with exact names and duplicates refused. It checks
// the form only; Check and the signature say whether it signs this request in.
func DecodeSignInWithX(header string) (SignInWithX, error) {
	doc, err := decodeHeader(docSignInWithX, header)
	if err != nil {
		return SignInWithX{}, err
	}
	var s SignInWithX
	if err := jsonv2.Unmarshal(doc, &s, jsonv2.RejectUnknownMembers(false)); err != nil {
		return SignInWithX{}, &DecodeError{Doc: docSignInWithX, Kind: DecodeNotJSON, Detail: err.Error()}
	}
	for _, f := range []struct{ name, v string }{{"domain", s.Domain}, {"address", s.Address}, {"uri", s.URI},
		{"version", s.Version}, {"chainId", s.ChainID}, {"type", s.Type}, {"nonce", s.Nonce}, {"issuedAt", s.IssuedAt},
		{"signature", s.Signature}} {
		if f.v == "" {
			return SignInWithX{}, &DecodeError{Doc: docSignInWithX, Kind: DecodeMissingField, Field: f.name,
				Detail: fmt.Sprintf("%s is required and must be a non-empty string", f.name)}
		}
	}
	if field, ok := s.plainText(); !ok {
		// A NUL, line break or other control character, or text that is not UTF-8: no SIWE message holds one (a
		// line break would let one field pass for another in the message signed), and no journal key may.
		return SignInWithX{}, &DecodeError{Doc: docSignInWithX, Kind: DecodeInvalidValue, Field: field,
			Detail: field + " holds a control character or text that is not UTF-8"}
	}
	switch s.Type {
	case SignatureTypeEIP191, "ed25519":
	default:
		return SignInWithX{}, &DecodeError{Doc: docSignInWithX, Kind: DecodeInvalidValue, Field: "type",
			Detail: fmt.Sprintf("type %q is none of eip191, ed25519", s.Type)}
	}
	return s, nil
}

// plainText reports whether every field of s is UTF-8 text without control characters, else names the first
// that is not.
func (s SignInWithX) plainText() (field string, ok bool) {
	fields := []struct{ name, v string }{{"domain", s.Domain}, {"address", s.Address}, {"uri", s.URI},
		{"version", s.Version}, {"chainId", s.ChainID}, {"type", s.Type}, {"nonce", s.Nonce}, {"issuedAt", s.IssuedAt},
		{"expirationTime", s.ExpirationTime}, {"notBefore", s.NotBefore}, {"signatureScheme", s.SignatureScheme},
		{"signature", s.Signature}}
	if s.Statement != nil {
		fields = append(fields, struct{ name, v string }{"statement", *s.Statement})
	}
	if s.RequestID != nil {
		fields = append(fields, struct{ name, v string }{"requestId", *s.RequestID})
	}
	for _, r := range s.Resources {
		fields = append(fields, struct{ name, v string }{"resources", r})
	}
	for _, f := range fields {
		if !utf8.ValidString(f.v) || strings.ContainsFunc(f.v, unicode.IsControl) {
			return f.name, false
		}
	}
	return "", true
}

// EncodeSignInWithX is the SIGN-IN-WITH-X header of s: Base64 of its JSON, as the public SDK's clients send it.
func EncodeSignInWithX(s SignInWithX) (string, error) {
	return EncodeHeader(s)
}

// Reasons a sign-in is refused, in the public SDK's words where it has them.
const (
	SignInWithXDomainMismatch  = "invalid_siwx_domain_mismatch"
	SignInWithXURIMismatch     = "invalid_siwx_uri_mismatch"
	SignInWithXChainMismatch   = "invalid_siwx_chain_id"
	SignInWithXIssuedAt        = "invalid_siwx_issued_at"
	SignInWithXTooOld          = "invalid_siwx_issued_at_too_old"
	SignInWithXInFuture        = "invalid_siwx_issued_at_in_future"
	SignInWithXExpirationTime  = "invalid_siwx_expiration_time"
	SignInWithXExpired         = "invalid_siwx_expired"
	SignInWithXNotBefore       = "invalid_siwx_not_before"
	SignInWithXNotYetValid     = "invalid_siwx_not_yet_valid"
	SignInWithXNonce           = "invalid_siwx_nonce"
	SignInWithXSignature       = "invalid_siwx_signature"
	SignInWithXMalformed       = "invalid_siwx_malformed_signature"
	SignInWithXUnsupported     = "invalid_siwx_unsupported_chain"
	SignInWithXVersion         = "invalid_siwx_version"
	SignInWithXNoGrant         = "invalid_siwx_not_paid"
	SignInWithXGrantExpired    = "invalid_siwx_access_expired"
	SignInWithXGrantUsedUp     = "invalid_siwx_access_used_up"
	SignInWithXPathNotGranted  = "invalid_siwx_path_not_granted"
	SignInWithXHeaderMalformed = "invalid_siwx_header"
)

// SignInWithXRefusal says why a sign-in does not sign a request in.
type SignInWithXRefusal struct {
	Reason  string // one of the SignInWithX* reasons
	Message string // what was expected and what came
}

func (r *SignInWithXRefusal) Error() string { return r.Message }

func refuseSignIn(reason, format string, args ...any) *SignInWithXRefusal {
	return &SignInWithXRefusal{Reason: reason, Message: fmt.Sprintf(format, args...)}
}

// SignInWithXExpect is what a sign-in must say to sign a request in: the request's host and origin, the URI of
// the resource (the challenge's uri), the chains the challenge offered, and the time.
type SignInWithXExpect struct {
	Host     string   // the request's host, with its port where it names one: the challenge's domain
	Origin   string   // scheme://host of the request
	URI      string   // the resource's URL, as the challenge names it; "" takes any URI of Origin
	ChainIDs []string // CAIP-2 ids the challenge offered
	Now      time.Time
}

// Check says why s does not sign a request in as expect describes (nil when it does, save its signature and
// nonce, which the caller checks): the domain is the request's host, the URI the resource's at the request's
// origin, the chain one the challenge offered, issuedAt at most SignInWithXMaxAge old and not ahead of now (by more
// than SignInWithXClockSkew), and
// now between notBefore and expirationTime where they are given, as the public SDK's servers check them.
func (s SignInWithX) Check(expect SignInWithXExpect) *SignInWithXRefusal {
	if s.Domain != expect.Host {
		return refuseSignIn(SignInWithXDomainMismatch, "the sign-in is for domain %q; this request's is %q", trunc(s.Domain), expect.Host)
	}
	u, err := url.Parse(s.URI)
	if err != nil || u.Scheme == "" || u.Host == "" {
		return refuseSignIn(SignInWithXURIMismatch, "the sign-in's uri %q is not a URL", trunc(s.URI))
	}
	if origin := u.Scheme + "://" + u.Host; origin != expect.Origin {
		return refuseSignIn(SignInWithXURIMismatch, "the sign-in's uri is of origin %q; this request's is %q", trunc(origin), expect.Origin)
	}
	if expect.URI != "" && s.URI != expect.URI {
		return refuseSignIn(SignInWithXURIMismatch, "the sign-in is for uri %q; this request is for %q", trunc(s.URI), trunc(expect.URI))
	}
	if s.Version != "1" {
		return refuseSignIn(SignInWithXVersion, "the sign-in's version is %q; want \"1\"", trunc(s.Version))
	}
	if !containsString(expect.ChainIDs, s.ChainID) {
		return refuseSignIn(SignInWithXChainMismatch, "the sign-in is for chain %q; this resource takes %s", trunc(s.ChainID), strings.Join(expect.ChainIDs, ", "))
	}
	if _, err := s.NumericChainID(); err != nil {
		return refuseSignIn(SignInWithXUnsupported, "%v", err)
	}
	if s.Type != SignatureTypeEIP191 {
		return refuseSignIn(SignInWithXUnsupported, "the sign-in's signature type is %q; an EVM chain's is %q", s.Type, SignatureTypeEIP191)
	}
	issued, err := time.Parse(time.RFC3339Nano, s.IssuedAt)
	if err != nil {
		return refuseSignIn(SignInWithXIssuedAt, "issuedAt %q is no RFC 3339 time", trunc(s.IssuedAt))
	}
	switch age := expect.Now.Sub(issued); {
	case age > SignInWithXMaxAge:
		return refuseSignIn(SignInWithXTooOld, "the sign-in was issued %s ago; one is taken for %s", age.Round(time.Second), SignInWithXMaxAge)
	case age < -SignInWithXClockSkew:
		return refuseSignIn(SignInWithXInFuture, "the sign-in's issuedAt is %s ahead of the gate's clock", (-age).Round(time.Millisecond))
	}
	if s.ExpirationTime != "" {
		exp, err := time.Parse(time.RFC3339Nano, s.ExpirationTime)
		if err != nil {
			return refuseSignIn(SignInWithXExpirationTime, "expirationTime %q is no RFC 3339 time", trunc(s.ExpirationTime))
		}
		if exp.Before(expect.Now) {
			return refuseSignIn(SignInWithXExpired, "the sign-in expired at %s", exp.UTC().Format(time.RFC3339))
		}
	}
	if s.NotBefore != "" {
		nb, err := time.Parse(time.RFC3339Nano, s.NotBefore)
		if err != nil {
			return refuseSignIn(SignInWithXNotBefore, "notBefore %q is no RFC 3339 time", trunc(s.NotBefore))
		}
		if expect.Now.Before(nb) {
			return refuseSignIn(SignInWithXNotYetValid, "the sign-in is not valid before %s", nb.UTC().Format(time.RFC3339))
		}
	}
	return nil
}

// IssuedAtTime is the sign-in's issuedAt, the zero time when it does not read.
func (s SignInWithX) IssuedAtTime() time.Time {
	t, _ := time.Parse(time.RFC3339Nano, s.IssuedAt)
	return t
}

// NumericChainID is the EIP-155 chain id of an eip155:<n> chainId.
func (s SignInWithX) NumericChainID() (uint64, error) {
	ref, ok := strings.CutPrefix(s.ChainID, "eip155:")
	if !ok {
		return 0, fmt.Errorf("the sign-in's chain %q is no EVM chain (eip155:<id>)", trunc(s.ChainID))
	}
	n, err := strconv.ParseUint(ref, 10, 64)
	if err != nil || strconv.FormatUint(n, 10) != ref {
		return 0, fmt.Errorf("the sign-in's chain %q is no EVM chain (eip155:<id>)", trunc(s.ChainID))
	}
	return n, nil
}

// Message is the EIP-4361 (Sign-In with Ethereum) message the sign-in's signature signs, byte for byte as the
// public SDK's clients write it; address is the signer's address in its EIP-55 form.
func (s SignInWithX) Message(address string) (string, error) {
	chainID, err := s.NumericChainID()
	if err != nil {
		return "", err
	}
	var b strings.Builder
	b.WriteString(s.Domain + " wants you to sign in with your Ethereum account:\n" + address + "\n\n")
	if s.Statement != nil {
		b.WriteString(*s.Statement + "\n")
	}
	b.WriteString("\nURI: " + s.URI + "\nVersion: " + s.Version + "\nChain ID: " + strconv.FormatUint(chainID, 10) +
		"\nNonce: " + s.Nonce + "\nIssued At: " + s.IssuedAt)
	if s.ExpirationTime != "" {
		b.WriteString("\nExpiration Time: " + s.ExpirationTime)
	}
	if s.NotBefore != "" {
		b.WriteString("\nNot Before: " + s.NotBefore)
	}
	if s.RequestID != nil {
		b.WriteString("\nRequest ID: " + *s.RequestID)
	}
	if s.Resources != nil {
		b.WriteString("\nResources:")
		for _, r := range s.Resources {
			b.WriteString("\n- " + r)
		}
	}
	return b.String(), nil
}

// trunc bounds what a refusal repeats of a client's text.
func trunc(s string) string {
	if len(s) <= 128 {
		return s
	}
	return s[:128] + "..."
}

func containsString(list []string, s string) bool {
	for _, v := range list {
		if v == s {
			return true
		}
	}
	return false
}
