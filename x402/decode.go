package x402

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"reflect"
	"strconv"
	"strings"
	"unicode/utf8"

	jsonv2 "github.com/go-json-experiment/json"
	"github.com/go-json-experiment/json/jsontext"
)

// Documents are read into the wire types by json/v2 (github.com/go-json-experiment/json) with its default
// semantics: member names match exactly (not case-insensitively as encoding/json does), a duplicate name anywhere
// in the document is refused (peers could disagree on which one counts), unknown members are ignored (peers add
// fields), and anything after the document is refused. What the types cannot say (which fields are required, the
// version, exactly one authorization) is checked afterwards by a small check per type. Only when a check fails
// does it read the document again, to tell an absent member from a null or empty one and to name the field.

// maxJSONDepth bounds the nesting of objects and arrays; protocol documents nest a few levels, so deeper input
// is an attack or a mistake.
const maxJSONDepth = 64

// checker reads one document and records the first problem found in it.
type checker struct {
	doc []byte
	err *DecodeError
	// decoded is false when json/v2 refused the document for a type or a duplicate name (err says which): the
	// version is still checked, as it explains the rest, but the contents are not complete.
	decoded bool
}

// unmarshal reads c.doc into v. A syntax error anywhere in the document wins over a type error or a duplicate
// name before it, as a broken document is best reported as broken.
func (c *checker) unmarshal(v any) {
	if off, deep := tooDeep(c.doc); deep {
		c.err = &DecodeError{Kind: DecodeNotJSON, Offset: off, Detail: fmt.Sprintf("nested deeper than %d levels", maxJSONDepth)}
		return
	}
	if i := invalidUTF8(c.doc); i >= 0 {
		c.err = &DecodeError{Kind: DecodeNotJSON, Offset: i, Detail: "invalid UTF-8; a JSON document is UTF-8 text"}
		return
	}
	err := jsonv2.Unmarshal(c.doc, v, allowLoneSurrogates)
	if err == nil {
		c.decoded = true
		return
	}
	var syn *jsontext.SyntacticError
	if !errors.As(err, &syn) || errors.Is(err, jsontext.ErrDuplicateName) {
		// json/v2 stops at the first problem; look for a syntax error further on.
		if serr := jsonv2.Unmarshal(c.doc, new(jsontext.Value), allowLoneSurrogates, jsontext.AllowDuplicateNames(true)); serr != nil {
			err = serr
		}
	}
	var sem *jsonv2.SemanticError
	switch {
	case errors.Is(err, jsontext.ErrDuplicateName) && errors.As(err, &syn):
		_, field := locate(c.doc, syn.JSONPointer)
		c.err = &DecodeError{Kind: DecodeInvalidValue, Field: field, Detail: "appears more than once in its object"}
	case errors.As(err, &syn):
		c.err = &DecodeError{Kind: DecodeNotJSON, Offset: int(syn.ByteOffset), Detail: syntaxDetail(c.doc, syn)}
	case errors.As(err, &sem):
		_, field := locate(c.doc, sem.JSONPointer)
		c.err = &DecodeError{Kind: DecodeWrongType, Field: field, Detail: typeDetail(sem)}
	default:
		c.err = &DecodeError{Kind: DecodeNotJSON, Detail: err.Error()}
	}
}

// allowLoneSurrogates reads an escaped UTF-16 surrogate that is not half of a pair (\ud800) as U+FFFD, as
// encoding/json does and JavaScript's JSON.stringify writes them, rather than refusing the document. The option
// also lets invalid UTF-8 bytes through, which invalidUTF8 refuses before.
var allowLoneSurrogates = jsontext.AllowInvalidUTF8(true)

// invalidUTF8 returns the offset of the first byte of doc that is not UTF-8, or -1.
func invalidUTF8(doc []byte) int {
	if utf8.Valid(doc) {
		return -1
	}
	for i := 0; i < len(doc); {
		r, n := utf8.DecodeRune(doc[i:])
		if r == utf8.RuneError && n == 1 {
			return i
		}
		i += n
	}
	return -1
}

// tooDeep reports whether doc nests objects and arrays deeper than maxJSONDepth, and where. Counting the
// brackets first spares the byte-by-byte scan to every document that has few of them.
func tooDeep(doc []byte) (offset int, deep bool) {
	if bytes.Count(doc, []byte{'{'})+bytes.Count(doc, []byte{'['}) <= maxJSONDepth {
		return 0, false
	}
	depth, inString := 0, false
	for i := 0; i < len(doc); i++ {
		switch c := doc[i]; {
		case inString && c == '\\':
			i++
		case inString:
			inString = c != '"'
		case c == '"':
			inString = true
		case c == '{' || c == '[':
			if depth++; depth > maxJSONDepth {
				return i, true
			}
		case c == '}' || c == ']':
			depth--
		}
	}
	return 0, false
}

// syntaxDetail says what is wrong with a document that is not JSON, in json/v2's words where they are plain.
func syntaxDetail(doc []byte, syn *jsontext.SyntacticError) string {
	msg := syn.Err.Error()
	off := int(syn.ByteOffset)
	switch {
	case errors.Is(syn.Err, io.ErrUnexpectedEOF):
		return "the document ends before it is complete"
	case strings.Contains(msg, "after top-level value") && off < len(doc):
		return fmt.Sprintf("unexpected %s after the end of the JSON document", describeByte(doc[off]))
	case strings.Contains(msg, "at start of value") && off < len(doc):
		return fmt.Sprintf("expected a JSON value, found %s", describeByte(doc[off]))
	}
	return msg
}

// typeDetail says which JSON type came and which was expected.
func typeDetail(sem *jsonv2.SemanticError) string {
	got := describeKind(sem.JSONKind)
	switch {
	case sem.JSONKind == '0' && errors.Is(sem.Err, strconv.ErrRange):
		return fmt.Sprintf("got %s, expected an integer that fits 64 bits", quoteInput(string(sem.JSONValue)))
	case sem.JSONKind == '0' && errors.Is(sem.Err, strconv.ErrSyntax):
		return fmt.Sprintf("got %s, expected an integer", quoteInput(string(sem.JSONValue)))
	}
	want := "a value of another type"
	if t := sem.GoType; t != nil {
		if t.Kind() == reflect.Pointer {
			t = t.Elem()
		}
		switch t.Kind() {
		case reflect.String:
			want = "a string"
		case reflect.Bool:
			want = "a boolean"
		case reflect.Int, reflect.Int64:
			want = "a number"
		case reflect.Slice:
			want = "an array"
		case reflect.Struct, reflect.Map:
			want = "an object"
		}
	}
	detail := "got " + got + ", expected " + want
	if want == "a string" && got == "a number" {
		detail += ": amounts, nonces and timestamps are decimal strings, such as \"10000\""
	}
	return detail
}

// describeKind names a JSON kind as an error message says it.
func describeKind(k jsontext.Kind) string {
	switch k {
	case '{':
		return "an object"
	case '[':
		return "an array"
	case '"':
		return "a string"
	case 't', 'f':
		return "a boolean"
	case 'n':
		return "null"
	case '0':
		return "a number"
	}
	return "something that is not JSON"
}

func describeByte(c byte) string {
	if c >= 0x20 && c < 0x7f {
		return fmt.Sprintf("%q", c)
	}
	return fmt.Sprintf("byte %#02x", c)
}

// locate finds the value at ptr in doc, returning it (nil when there is none) and its path as a DecodeError
// names it ("accepts[1].amount"). It reads the document again, so it serves error paths only.
func locate(doc []byte, ptr jsontext.Pointer) (jsontext.Value, string) {
	dec := jsontext.NewDecoder(bytes.NewReader(doc), allowLoneSurrogates, jsontext.AllowDuplicateNames(true))
	var field strings.Builder
	found := true
	for tok := range ptr.Tokens() {
		kind := dec.PeekKind()
		if found && kind == '[' {
			field.WriteString("[" + tok + "]")
		} else {
			if field.Len() > 0 {
				field.WriteByte('.')
			}
			field.WriteString(tok)
		}
		if !found {
			continue
		}
		found = false
		switch kind {
		case '{':
			dec.ReadToken()
			for dec.PeekKind() == '"' {
				name, err := dec.ReadToken()
				if err != nil {
					break
				}
				if name.String() == tok {
					found = true
					break
				}
				if dec.SkipValue() != nil {
					break
				}
			}
		case '[':
			n, err := strconv.Atoi(tok)
			if err != nil {
				continue
			}
			dec.ReadToken()
			for i := 0; i < n && dec.PeekKind() != ']' && dec.SkipValue() == nil; i++ {
			}
			found = dec.PeekKind() != ']'
		}
	}
	if !found {
		return nil, field.String()
	}
	v, err := dec.ReadValue()
	if err != nil {
		return nil, field.String()
	}
	return v, field.String()
}

// pointerOf turns a field path as DecodeError names it into a JSON Pointer (the protocol's names hold no '.',
// '[', '~' or '/').
func pointerOf(field string) jsontext.Pointer {
	if field == "" {
		return ""
	}
	return jsontext.Pointer("/" + strings.NewReplacer(".", "/", "[", "/", "]", "").Replace(field))
}

// fail records a problem unless one is already recorded.
func (c *checker) fail(kind DecodeErrorKind, at *fieldPath, detail string) {
	if c.err == nil {
		c.err = &DecodeError{Kind: kind, Field: at.String(), Detail: detail}
	}
}

// member returns the value of member name of the object at `at`, nil when it is absent.
func (c *checker) member(at *fieldPath, name string) jsontext.Value {
	f := at.key(name)
	v, _ := locate(c.doc, pointerOf(f.String()))
	return v
}

// missing records member name of the object at `at` as missing: absent, or null or empty.
func (c *checker) missing(at *fieldPath, name string) {
	if c.err != nil {
		return
	}
	f := at.key(name)
	if c.member(at, name) == nil {
		c.fail(DecodeMissingField, &f, "is missing")
	} else {
		c.fail(DecodeMissingField, &f, "is empty or null, expected a value")
	}
}

// requireString records a required string member that is absent, null or empty.
func (c *checker) requireString(at *fieldPath, name, v string) {
	if v == "" {
		c.missing(at, name)
	}
}

// present reports whether member name of the object at `at` is there and not null, for a member that was
// decoded as zero; zero members that are present are rare, so the document is read again only for them.
func (c *checker) present(at *fieldPath, name string, zero bool) bool {
	if !zero {
		return true
	}
	v := c.member(at, name)
	return v != nil && v.Kind() != 'n'
}

// require records a required member of another type than string that is absent or null.
func (c *checker) require(at *fieldPath, name string, zero bool) {
	if c.err == nil && !c.present(at, name, zero) {
		c.missing(at, name)
	}
}

// positiveTimeout refuses a maxTimeoutSeconds that is there but not a positive number of seconds (its absence is
// require's to report, before this).
func (c *checker) positiveTimeout(at *fieldPath, seconds int64) {
	if seconds > 0 || c.err != nil || !c.present(at, "maxTimeoutSeconds", seconds == 0) {
		return
	}
	f := at.key("maxTimeoutSeconds")
	c.fail(DecodeInvalidValue, &f, fmt.Sprintf("is %d, expected a positive number of seconds", seconds))
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

// version checks the x402Version of the object at `at`, decoded as got, and reports whether it is one of want.
// An absent or unsupported version replaces any problem found before it, which is likely just the other
// version's shape, unless that problem is the version itself or its object. The version is read from the
// document again when it is not one of want, as json/v2 may have stopped before reading it.
func (c *checker) version(at *fieldPath, got int, doc string, want versionSet) bool {
	f := at.key("x402Version")
	if c.err != nil && (c.err.Field == f.String() || c.err.Field == at.String()) {
		return false
	}
	if want.has(int64(got)) {
		return true
	}
	raw := c.member(at, "x402Version")
	var n int64
	switch {
	case raw == nil || raw.Kind() == 'n':
		c.err = &DecodeError{Kind: DecodeMissingField, Field: f.String(), Detail: "is missing; expected " + want.String()}
		return false
	case raw.Kind() != '0':
		c.err = &DecodeError{Kind: DecodeWrongType, Field: f.String(), Detail: "got " + describeKind(raw.Kind()) + ", expected a number"}
		return false
	case jsonv2.Unmarshal(raw, &n) != nil:
		c.err = &DecodeError{Kind: DecodeWrongType, Field: f.String(), Detail: fmt.Sprintf("got %s, expected an integer", quoteInput(string(raw)))}
		return false
	case want.has(n):
		return true
	}
	detail := fmt.Sprintf("is %d; %s must be %s", n, doc, want)
	if n == Version1 && want == onlyV2 && at == nil && doc == docPaymentVersioned {
		detail += " (a version 1 payment goes in the X-PAYMENT header, or re-sign it as version 2)"
	}
	c.err = &DecodeError{Kind: DecodeUnsupportedVersion, Field: f.String(), Detail: detail}
	return false
}

// paymentWire is a payment of either version as read, before the version decides which fields must be there.
type paymentWire struct {
	PaymentPayload
	Scheme  string `json:"scheme"`  // version 1
	Network string `json:"network"` // version 1
}

// paymentParts checks the members of a payment that are there (the ones it requires are checked by
// paymentRequires), and reports which of accepted and payload are.
func (c *checker) paymentParts(at *fieldPath, w *paymentWire) (hasAccepted, hasPayload bool) {
	if hasAccepted = c.present(at, "accepted", w.Accepted == PaymentRequirements{}); hasAccepted {
		f := at.key("accepted")
		c.requirements(&f, &w.Accepted)
	}
	if hasPayload = c.present(at, "payload", w.Payload == ExactEVMPayload{}); hasPayload {
		f := at.key("payload")
		c.exactPayload(&f, &w.Payload)
	}
	w.Extensions = compactExtensions(w.Extensions)
	return hasAccepted, hasPayload
}

// paymentRequires checks the members a payment's version requires (once the version is known to be 1 or 2).
func (c *checker) paymentRequires(at *fieldPath, w *paymentWire, hasAccepted, hasPayload bool) {
	if w.X402Version == Version1 {
		c.requireString(at, "scheme", w.Scheme)
		c.requireString(at, "network", w.Network)
	} else if !hasAccepted {
		c.missing(at, "accepted")
	}
	if !hasPayload {
		c.missing(at, "payload")
	}
}

// zero reports whether nothing of the payment was read.
func (p *PaymentPayload) zero() bool {
	return p.X402Version == 0 && p.Resource == nil && p.Accepted == PaymentRequirements{} && p.Payload == ExactEVMPayload{} && p.Extensions == nil
}

// requirements checks a version 2 PaymentRequirements (spec 2.6: every field required).
func (c *checker) requirements(at *fieldPath, rq *PaymentRequirements) {
	c.requireString(at, "scheme", rq.Scheme)
	c.requireString(at, "network", rq.Network)
	c.requireString(at, "amount", rq.Amount)
	c.requireString(at, "asset", rq.Asset)
	c.requireString(at, "payTo", rq.PayTo)
	c.require(at, "maxTimeoutSeconds", rq.MaxTimeoutSeconds == 0)
	c.require(at, "extra", rq.Extra == Extra{})
	c.positiveTimeout(at, rq.MaxTimeoutSeconds)
}

// requirementsV1 checks a version 1 PaymentRequirements. Description and mimeType may be empty or absent, as
// many version 1 servers leave them out; outputSchema and extra are optional.
func (c *checker) requirementsV1(at *fieldPath, rq *PaymentRequirementsV1) {
	c.requireString(at, "scheme", rq.Scheme)
	c.requireString(at, "network", rq.Network)
	c.requireString(at, "maxAmountRequired", rq.MaxAmountRequired)
	c.requireString(at, "resource", rq.Resource)
	c.requireString(at, "payTo", rq.PayTo)
	c.require(at, "maxTimeoutSeconds", rq.MaxTimeoutSeconds == 0)
	c.requireString(at, "asset", rq.Asset)
	c.positiveTimeout(at, rq.MaxTimeoutSeconds)
	if rq.OutputSchema = compactRaw(rq.OutputSchema); string(rq.OutputSchema) == "null" {
		rq.OutputSchema = nil
	}
}

// checkAccepts checks the requirements of a 402 answer; an element must be an object, never null.
func checkAccepts[R any](c *checker, list []R, check func(*checker, *fieldPath, *R)) {
	f := (*fieldPath)(nil).key("accepts")
	for i := range list {
		e := f.elem(i)
		if c.err == nil && reflect.ValueOf(&list[i]).Elem().IsZero() {
			if v, _ := locate(c.doc, pointerOf(e.String())); v.Kind() == 'n' {
				c.fail(DecodeWrongType, &e, "got null, expected a requirement object")
			}
		}
		check(c, &e, &list[i])
	}
}

// exactPayload checks the signed part of an exact EVM payment: a signature and exactly one authorization.
func (c *checker) exactPayload(at *fieldPath, p *ExactEVMPayload) {
	if p.Authorization != nil {
		f := at.key("authorization")
		c.authorization(&f, p.Authorization)
	}
	if p.Permit2Authorization != nil {
		f := at.key("permit2Authorization")
		c.permit2Authorization(&f, p.Permit2Authorization)
	}
	c.requireString(at, "signature", p.Signature)
	switch {
	case p.Authorization == nil && p.Permit2Authorization == nil:
		f := at.key("authorization")
		c.fail(DecodeMissingField, &f, "is missing: expected exactly one of authorization (erc2612) or permit2Authorization (permit2)")
	case p.Authorization != nil && p.Permit2Authorization != nil:
		c.fail(DecodeInvalidValue, at, "has both authorization and permit2Authorization, expected exactly one")
	}
}

// authorization checks an EIP-2612 (or EIP-3009) authorization; all six fields are required strings.
func (c *checker) authorization(at *fieldPath, a *EIP2612Authorization) {
	c.requireString(at, "from", a.From)
	c.requireString(at, "to", a.To)
	c.requireString(at, "value", a.Value)
	c.requireString(at, "validAfter", a.ValidAfter)
	c.requireString(at, "validBefore", a.ValidBefore)
	c.requireString(at, "nonce", a.Nonce)
}

// permit2Authorization checks a Permit2 authorization; every field of it and of its permitted and witness
// objects is a required string.
func (c *checker) permit2Authorization(at *fieldPath, a *Permit2Authorization) {
	c.requireString(at, "from", a.From)
	if c.present(at, "permitted", a.Permitted == TokenPermissions{}) {
		f := at.key("permitted")
		c.requireString(&f, "token", a.Permitted.Token)
		c.requireString(&f, "amount", a.Permitted.Amount)
	} else {
		c.missing(at, "permitted")
	}
	c.requireString(at, "spender", a.Spender)
	c.requireString(at, "nonce", a.Nonce)
	c.requireString(at, "deadline", a.Deadline)
	if c.present(at, "witness", a.Witness == Permit2Witness{}) {
		f := at.key("witness")
		c.requireString(&f, "to", a.Witness.To)
		c.requireString(&f, "validAfter", a.Witness.ValidAfter)
	} else {
		c.missing(at, "witness")
	}
}

// compactExtensions keeps each extension as compact raw JSON, and reads an empty object as none, so that
// decoding what was encoded (where an empty map is omitted) gives the same value.
func compactExtensions(m map[string]json.RawMessage) map[string]json.RawMessage {
	if len(m) == 0 {
		return nil
	}
	for k, v := range m {
		m[k] = compactRaw(v)
	}
	return m
}

// compactRaw removes insignificant whitespace from a valid raw value, leaving strings as they were written.
func compactRaw(v json.RawMessage) json.RawMessage {
	if !bytes.ContainsAny(v, " \t\r\n") {
		return v
	}
	jv := jsontext.Value(v)
	if jv.Compact() != nil {
		return v
	}
	return json.RawMessage(jv)
}

// fieldPath is the JSON path of a value, built as a chain of stack values and spelled out
// ("payload.authorization.value", "accepts[1].amount") only when an error names it.
type fieldPath struct {
	parent *fieldPath
	name   string // object key, or "" for an array element
	index  int
}

// key is the path of member name of the object at p.
func (p *fieldPath) key(name string) fieldPath { return fieldPath{parent: p, name: name} }

// elem is the path of element i of the array at p.
func (p *fieldPath) elem(i int) fieldPath { return fieldPath{parent: p, index: i} }

// String spells the path; the root (nil) is "". It walks the chain twice (measure, then fill from the end)
// rather than recursing, because a recursive method makes the compiler move every path node to the heap.
func (p *fieldPath) String() string {
	n := 0
	for q := p; q != nil; q = q.parent {
		if q.name == "" {
			n += len(strconv.Itoa(q.index)) + 2
		} else {
			n += len(q.name)
			if q.parent != nil {
				n++
			}
		}
	}
	buf := make([]byte, n)
	for q := p; q != nil; q = q.parent {
		if q.name == "" {
			idx := strconv.Itoa(q.index)
			n--
			buf[n] = ']'
			n -= len(idx)
			copy(buf[n:], idx)
			n--
			buf[n] = '['
		} else {
			n -= len(q.name)
			copy(buf[n:], q.name)
			if q.parent != nil {
				n--
				buf[n] = '.'
			}
		}
	}
	return string(buf)
}
