package x402

import (
	"fmt"
	"strconv"
	"strings"
	"unicode/utf16"
	"unicode/utf8"
)

// maxJSONDepth bounds the nesting of objects and arrays; protocol documents nest a few levels, so deeper input
// is an attack or a mistake, and refusing it keeps the reader's recursion small.
const maxJSONDepth = 64

// jsonReader reads one JSON document (RFC 8259) held in a string. It is the strict, low-allocation decoder behind
// the Decode functions: strings without escapes are returned as substrings of the document, keys match exactly
// (not case-insensitively as encoding/json does), and the callers know which fields are present.
//
// A syntax error stops reading at once and is returned. A semantic error (a field of the wrong type, a
// duplicate key) is recorded in err and reading goes on, so that a document that is also broken further on is
// reported as not-json; the first semantic error is the one reported.
type jsonReader struct {
	s     string
	pos   int
	depth int
	err   *DecodeError
}

// syntax returns a not-json error at the current position.
func (r *jsonReader) syntax(format string, args ...any) error {
	return &DecodeError{Kind: DecodeNotJSON, Offset: r.pos, Detail: fmt.Sprintf(format, args...)}
}

// fail records a semantic error unless one is already recorded.
func (r *jsonReader) fail(kind DecodeErrorKind, field, detail string) {
	if r.err == nil {
		r.err = &DecodeError{Kind: kind, Field: field, Detail: detail}
	}
}

// ws skips insignificant whitespace.
func (r *jsonReader) ws() {
	for r.pos < len(r.s) {
		switch r.s[r.pos] {
		case ' ', '\t', '\n', '\r':
			r.pos++
		default:
			return
		}
	}
}

// peek returns the next significant byte, or 0 at the end of input.
func (r *jsonReader) peek() byte {
	r.ws()
	if r.pos < len(r.s) {
		return r.s[r.pos]
	}
	return 0
}

// end checks that nothing but whitespace follows the document. (Not through peek, whose 0 at the end of input
// would let a trailing NUL byte pass for the end.)
func (r *jsonReader) end() error {
	r.ws()
	if r.pos < len(r.s) {
		return r.syntax("unexpected %s after the end of the JSON document", describeByte(r.s[r.pos]))
	}
	return nil
}

// object reads an object, calling member with each key and the reader at the member's value; member must
// consume the value. A value that is not an object is recorded as wrong-type and skipped, and present is false.
func (r *jsonReader) object(at *fieldPath, member func(key string) error) (present bool, err error) {
	switch r.peek() {
	case '{':
	case 'n':
		return false, r.literal("null")
	default:
		r.wrongType(at, "an object")
		return false, r.skipValue()
	}
	if err := r.enter(); err != nil {
		return true, err
	}
	if r.peek() == '}' {
		r.pos++
		r.depth--
		return true, nil
	}
	for {
		if r.peek() != '"' {
			return true, r.syntax("expected a string object key, found %s", r.describeNext())
		}
		key, err := r.readString()
		if err != nil {
			return true, err
		}
		if r.peek() != ':' {
			return true, r.syntax("expected ':' after object key %q, found %s", key, r.describeNext())
		}
		r.pos++
		r.ws()
		if err := member(key); err != nil {
			return true, err
		}
		switch r.peek() {
		case ',':
			r.pos++
		case '}':
			r.pos++
			r.depth--
			return true, nil
		default:
			return true, r.syntax("expected ',' or '}' after an object member, found %s", r.describeNext())
		}
	}
}

// array reads an array, calling elem with each index and the reader at the element; elem must consume it.
func (r *jsonReader) array(at *fieldPath, elem func(i int) error) (present bool, err error) {
	switch r.peek() {
	case '[':
	case 'n':
		return false, r.literal("null")
	default:
		r.wrongType(at, "an array")
		return false, r.skipValue()
	}
	if err := r.enter(); err != nil {
		return true, err
	}
	if r.peek() == ']' {
		r.pos++
		r.depth--
		return true, nil
	}
	for i := 0; ; i++ {
		r.ws()
		if err := elem(i); err != nil {
			return true, err
		}
		switch r.peek() {
		case ',':
			r.pos++
		case ']':
			r.pos++
			r.depth--
			return true, nil
		default:
			return true, r.syntax("expected ',' or ']' after an array element, found %s", r.describeNext())
		}
	}
}

// enter steps over '{' or '[' and enforces the nesting limit.
func (r *jsonReader) enter() error {
	r.depth++
	if r.depth > maxJSONDepth {
		return r.syntax("nested deeper than %d levels", maxJSONDepth)
	}
	r.pos++
	return nil
}

// str reads a string value. Null counts as absent; any other type is recorded as wrong-type.
func (r *jsonReader) str(at *fieldPath) (val string, present bool, err error) {
	switch r.peek() {
	case '"':
		s, err := r.readString()
		return s, true, err
	case 'n':
		return "", false, r.literal("null")
	default:
		r.wrongType(at, "a string")
		return "", true, r.skipValue()
	}
}

// integer reads a number that must be an integer fitting 64 bits.
func (r *jsonReader) integer(at *fieldPath) (val int64, present bool, err error) {
	switch c := r.peek(); {
	case c == '-' || isDigit(c):
		lit, integral, err := r.readNumber()
		if err != nil {
			return 0, true, err
		}
		if !integral {
			r.fail(DecodeWrongType, at.String(), fmt.Sprintf("got %s, expected an integer", lit))
			return 0, true, nil
		}
		n, perr := strconv.ParseInt(lit, 10, 64)
		if perr != nil {
			r.fail(DecodeWrongType, at.String(), fmt.Sprintf("got %s, expected an integer that fits 64 bits", quoteInput(lit)))
		}
		return n, true, nil
	case c == 'n':
		return 0, false, r.literal("null")
	default:
		r.wrongType(at, "a number")
		return 0, true, r.skipValue()
	}
}

// boolean reads true or false.
func (r *jsonReader) boolean(at *fieldPath) (val bool, present bool, err error) {
	switch r.peek() {
	case 't':
		return true, true, r.literal("true")
	case 'f':
		return false, true, r.literal("false")
	case 'n':
		return false, false, r.literal("null")
	default:
		r.wrongType(at, "a boolean")
		return false, true, r.skipValue()
	}
}

// raw reads any value and returns its text, compacted so that decoding the re-encoded value gives the same text.
func (r *jsonReader) raw() (string, error) {
	r.ws()
	start := r.pos
	if err := r.skipValue(); err != nil {
		return "", err
	}
	v := r.s[start:r.pos]
	if !strings.ContainsAny(v, " \t\r\n") {
		return v, nil
	}
	return compactJSON(v), nil
}

// compactJSON removes insignificant whitespace from a syntactically valid JSON value.
func compactJSON(v string) string {
	var b strings.Builder
	b.Grow(len(v))
	inString := false
	for i := 0; i < len(v); i++ {
		c := v[i]
		switch {
		case inString:
			b.WriteByte(c)
			if c == '\\' {
				i++
				b.WriteByte(v[i])
			} else if c == '"' {
				inString = false
			}
		case c == '"':
			inString = true
			b.WriteByte(c)
		case c == ' ' || c == '\t' || c == '\r' || c == '\n':
		default:
			b.WriteByte(c)
		}
	}
	return b.String()
}

// skipValue reads and discards any value, checking its syntax.
func (r *jsonReader) skipValue() error {
	switch c := r.peek(); {
	case c == '{':
		_, err := r.object(nil, func(string) error { return r.skipValue() })
		return err
	case c == '[':
		_, err := r.array(nil, func(int) error { return r.skipValue() })
		return err
	case c == '"':
		_, err := r.readString()
		return err
	case c == '-' || isDigit(c):
		_, _, err := r.readNumber()
		return err
	case c == 't':
		return r.literal("true")
	case c == 'f':
		return r.literal("false")
	case c == 'n':
		return r.literal("null")
	default:
		return r.syntax("expected a JSON value, found %s", r.describeNext())
	}
}

// literal reads the keyword lit (true, false or null).
func (r *jsonReader) literal(lit string) error {
	if !strings.HasPrefix(r.s[r.pos:], lit) {
		return r.syntax("expected %s, found %s", lit, r.describeNext())
	}
	r.pos += len(lit)
	return nil
}

// readNumber reads a number per the JSON grammar and reports whether it is written as an integer.
func (r *jsonReader) readNumber() (lit string, integral bool, err error) {
	start := r.pos
	i := r.pos
	if i < len(r.s) && r.s[i] == '-' {
		i++
	}
	switch {
	case i < len(r.s) && r.s[i] == '0':
		i++
	case i < len(r.s) && r.s[i] >= '1' && r.s[i] <= '9':
		for i < len(r.s) && isDigit(r.s[i]) {
			i++
		}
	default:
		r.pos = i
		return "", false, r.syntax("malformed number: expected a digit")
	}
	integral = true
	if i < len(r.s) && r.s[i] == '.' {
		integral = false
		i++
		if i >= len(r.s) || !isDigit(r.s[i]) {
			r.pos = i
			return "", false, r.syntax("malformed number: expected a digit after '.'")
		}
		for i < len(r.s) && isDigit(r.s[i]) {
			i++
		}
	}
	if i < len(r.s) && (r.s[i] == 'e' || r.s[i] == 'E') {
		integral = false
		i++
		if i < len(r.s) && (r.s[i] == '+' || r.s[i] == '-') {
			i++
		}
		if i >= len(r.s) || !isDigit(r.s[i]) {
			r.pos = i
			return "", false, r.syntax("malformed number: expected a digit in the exponent")
		}
		for i < len(r.s) && isDigit(r.s[i]) {
			i++
		}
	}
	r.pos = i
	return r.s[start:i], integral, nil
}

// readString reads a string at '"'. Without escapes the result shares the document's memory.
func (r *jsonReader) readString() (string, error) {
	start := r.pos + 1
	for i := start; i < len(r.s); {
		c := r.s[i]
		if plainStringByte(c) {
			i++
			continue
		}
		switch {
		case c == '"':
			r.pos = i + 1
			return r.s[start:i], nil
		case c == '\\':
			return r.readEscapedString(start, i)
		case c < 0x20:
			r.pos = i
			return "", r.syntax("control character %#02x inside a string; it must be escaped", c)
		case c >= utf8.RuneSelf:
			rn, size := utf8.DecodeRuneInString(r.s[i:])
			if rn == utf8.RuneError && size == 1 {
				r.pos = i
				return "", r.syntax("invalid UTF-8 inside a string")
			}
			i += size
		default:
			i++
		}
	}
	r.pos = len(r.s)
	return "", r.syntax("unterminated string")
}

// plainStringByte reports whether c stands for itself inside a string: printable ASCII other than '"' and '\\'.
// Strings of the protocol are hex and decimal digits, so this one comparison pair settles almost every byte.
func plainStringByte(c byte) bool { return c >= 0x20 && c < utf8.RuneSelf && c != '"' && c != '\\' }

// readEscapedString finishes a string that has an escape at esc, building its value.
func (r *jsonReader) readEscapedString(start, esc int) (string, error) {
	var b strings.Builder
	b.Grow(esc - start + 16)
	b.WriteString(r.s[start:esc])
	i := esc
	for i < len(r.s) {
		c := r.s[i]
		switch {
		case c == '"':
			r.pos = i + 1
			return b.String(), nil
		case c == '\\':
			if i+1 >= len(r.s) {
				r.pos = i
				return "", r.syntax("unterminated escape sequence")
			}
			switch e := r.s[i+1]; e {
			case '"', '\\', '/':
				b.WriteByte(e)
			case 'b':
				b.WriteByte('\b')
			case 'f':
				b.WriteByte('\f')
			case 'n':
				b.WriteByte('\n')
			case 'r':
				b.WriteByte('\r')
			case 't':
				b.WriteByte('\t')
			case 'u':
				rn, ok := hex4(r.s, i+2)
				if !ok {
					r.pos = i
					return "", r.syntax("malformed \\u escape: expected 4 hex digits")
				}
				i += 6
				if utf16.IsSurrogate(rn) {
					// A pair forms one rune; a lone surrogate becomes U+FFFD, as encoding/json does.
					if lo, ok := hex4(r.s, i+2); ok && i+1 < len(r.s) && r.s[i] == '\\' && r.s[i+1] == 'u' {
						if dec := utf16.DecodeRune(rn, lo); dec != utf8.RuneError {
							b.WriteRune(dec)
							i += 6
							continue
						}
					}
					rn = utf8.RuneError
				}
				b.WriteRune(rn)
				continue
			default:
				r.pos = i
				return "", r.syntax("invalid escape \\%c inside a string", e)
			}
			i += 2
		case c < 0x20:
			r.pos = i
			return "", r.syntax("control character %#02x inside a string; it must be escaped", c)
		case c >= utf8.RuneSelf:
			rn, size := utf8.DecodeRuneInString(r.s[i:])
			if rn == utf8.RuneError && size == 1 {
				r.pos = i
				return "", r.syntax("invalid UTF-8 inside a string")
			}
			b.WriteString(r.s[i : i+size])
			i += size
		default:
			b.WriteByte(c)
			i++
		}
	}
	r.pos = len(r.s)
	return "", r.syntax("unterminated string")
}

// hex4 parses four hex digits at s[i:].
func hex4(s string, i int) (rune, bool) {
	if i < 0 || i+4 > len(s) {
		return 0, false
	}
	var v rune
	for _, c := range []byte(s[i : i+4]) {
		v <<= 4
		switch {
		case c >= '0' && c <= '9':
			v |= rune(c - '0')
		case c >= 'a' && c <= 'f':
			v |= rune(c - 'a' + 10)
		case c >= 'A' && c <= 'F':
			v |= rune(c - 'A' + 10)
		default:
			return 0, false
		}
	}
	return v, true
}

// wrongType records that the value at the reader has a type other than want.
func (r *jsonReader) wrongType(at *fieldPath, want string) {
	got := describeJSONType(r.peek())
	detail := fmt.Sprintf("got %s, expected %s", got, want)
	if want == "a string" && got == "a number" {
		detail += ": amounts, nonces and timestamps are decimal strings, such as \"10000\""
	}
	r.fail(DecodeWrongType, at.String(), detail)
}

// duplicate records a key that appears twice in one object: peers could disagree on which one counts.
func (r *jsonReader) duplicate(at *fieldPath) {
	r.fail(DecodeInvalidValue, at.String(), "appears more than once in its object")
}

// describeNext names what is at the reader, for syntax errors.
func (r *jsonReader) describeNext() string {
	if r.pos >= len(r.s) {
		return "the end of input"
	}
	return describeByte(r.s[r.pos])
}

func describeByte(c byte) string {
	if c >= 0x20 && c < 0x7f {
		return fmt.Sprintf("%q", c)
	}
	return fmt.Sprintf("byte %#02x", c)
}

// describeJSONType names the JSON type that starts with c.
func describeJSONType(c byte) string {
	switch {
	case c == '{':
		return "an object"
	case c == '[':
		return "an array"
	case c == '"':
		return "a string"
	case c == 't' || c == 'f':
		return "a boolean"
	case c == 'n':
		return "null"
	case c == '-' || isDigit(c):
		return "a number"
	default:
		return "something that is not JSON"
	}
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
