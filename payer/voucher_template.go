package payer

import (
	"bytes"
	"encoding/base64"
	"strconv"
	"strings"

	"github.com/x402-gateway/caddy-x402/x402"
)

// A channel pays request after request with the same requirement, resource and configuration: a plain voucher's
// payment differs from the last only in its cumulative amount and its signature. The JSON of the rest is encoded
// once a channel (voucherTemplate) and each voucher fills in its two values, which spares it the encoding of the
// whole payment inside the latency of its request (with the voucher's signature, the payer's work a request).

// Markers stand for the cumulative amount and the signature in a template's encoding: JSON leaves them as they are,
// and neither a requirement nor a resource holds them (a template whose encoding holds either twice is not used).
const (
	templateAmount    = "<x402-voucher-amount>"
	templateSignature = "<x402-voucher-signature>"
)

// voucherTemplate is a plain voucher payment's JSON around its cumulative amount and signature; key names what
// the rest was made of (the requirement as offered and the resource).
type voucherTemplate struct {
	key                  string
	before, between, end []byte
}

// templateKey names what a voucher payment of a channel is made of besides its two values. Each part is written
// after its length, so that no two different sets of parts (a server's strings may hold any byte) share a key.
func templateKey(accepted []byte, res *x402.ResourceInfo) string {
	var b strings.Builder
	b.Grow(len(accepted) + 256)
	part := func(s string) { // as "%d:%s" wrote it, without fmt (the key is made every voucher)
		b.WriteString(strconv.Itoa(len(s)))
		b.WriteByte(':')
		b.WriteString(s)
	}
	part(string(accepted))
	if res != nil {
		for _, s := range []string{res.URL, res.Description, res.MimeType, res.ServiceName, res.IconURL} {
			part(s)
		}
		b.WriteString(strconv.Itoa(len(res.Tags)))
		b.WriteString(" tags")
		for _, s := range res.Tags {
			part(s)
		}
	}
	return b.String()
}

// newVoucherTemplate encodes wire, a plain voucher payment, with the markers for its voucher's amount and
// signature, and splits the JSON around them; nil when it cannot (the caller encodes each payment whole).
func newVoucherTemplate(key string, wire batchPaymentWire) *voucherTemplate {
	if wire.Payload.Voucher == nil || wire.Payload.Type != x402.BatchVoucher {
		return nil
	}
	v := *wire.Payload.Voucher
	v.MaxClaimableAmount, v.Signature = templateAmount, templateSignature
	wire.Payload.Voucher = &v
	enc, err := x402.EncodeHeader(wire)
	if err != nil {
		return nil
	}
	doc, err := base64.StdEncoding.DecodeString(enc)
	if err != nil || bytes.Count(doc, []byte(templateAmount)) != 1 || bytes.Count(doc, []byte(templateSignature)) != 1 {
		return nil
	}
	a := bytes.Index(doc, []byte(templateAmount))
	s := bytes.Index(doc, []byte(templateSignature))
	if s < a {
		return nil
	}
	return &voucherTemplate{key: key, before: doc[:a], between: doc[a+len(templateAmount) : s], end: doc[s+len(templateSignature):]}
}

// encode is the header value of the template's payment with the voucher's cumulative amount (decimal digits) and
// signature (0x and hex digits), which JSON writes as they are; ok is false when the payment would be longer than
// a header may be (EncodeHeader says so).
func (t *voucherTemplate) encode(amount, signature string) (value string, ok bool) {
	n := len(t.before) + len(amount) + len(t.between) + len(signature) + len(t.end)
	if n > x402.MaxHeaderBytes {
		return "", false
	}
	doc := make([]byte, 0, n)
	doc = append(doc, t.before...)
	doc = append(doc, amount...)
	doc = append(doc, t.between...)
	doc = append(doc, signature...)
	doc = append(doc, t.end...)
	return base64.StdEncoding.EncodeToString(doc), true
}
