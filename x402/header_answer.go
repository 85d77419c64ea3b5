package x402

import (
	"encoding/base64"
	"strconv"
	"unicode/utf8"
)

// A paid request's answer goes out in PAYMENT-RESPONSE on every response a gate serves. encoding/json spends
// most of its time there on reflection; appendAnswer writes the two answers a gate sends most (SettleResponse,
// BatchSettleResponse, without extensions) member by member, byte for byte what EncodeHeader's encoder writes
// (TestTheAnswerEncoderWritesWhatEncodingJSONWrites, FuzzTheAnswerEncoder). Anything else goes through
// encoding/json.

// appendAnswer appends v's compact JSON and reports whether it could: false for a type or value it leaves to
// encoding/json.
func appendAnswer(b []byte, v any) ([]byte, bool) {
	switch r := v.(type) {
	case SettleResponse:
		return appendSettleResponse(b, &r)
	case *SettleResponse:
		if r == nil {
			return b, false
		}
		return appendSettleResponse(b, r)
	case BatchSettleResponse:
		return appendBatchSettleResponse(b, &r)
	case *BatchSettleResponse:
		if r == nil {
			return b, false
		}
		return appendBatchSettleResponse(b, r)
	}
	return b, false
}

func appendSettleResponse(b []byte, r *SettleResponse) ([]byte, bool) {
	if r.Extensions != nil {
		return b, false
	}
	b = append(b, `{"success":`...)
	b = strconv.AppendBool(b, r.Success)
	b = appendMember(b, "transaction", r.Transaction)
	b = appendMember(b, "network", r.Network)
	b = appendMember(b, "payer", r.Payer)
	b = appendErrorMembers(b, r.Amount, r.ErrorReason, r.ErrorMessage)
	return append(b, '}'), true
}

func appendBatchSettleResponse(b []byte, r *BatchSettleResponse) ([]byte, bool) {
	if r.Extensions != nil {
		return b, false
	}
	b = append(b, `{"success":`...)
	b = strconv.AppendBool(b, r.Success)
	b = appendMember(b, "transaction", r.Transaction)
	b = appendMember(b, "network", r.Network)
	if r.Payer != "" {
		b = appendMember(b, "payer", r.Payer)
	}
	b = appendErrorMembers(b, r.Amount, r.ErrorReason, r.ErrorMessage)
	if e := r.Extra; e != nil {
		b = append(b, `,"extra":{`...)
		comma := false
		if e.ChargedAmount != "" {
			b = appendField(b, &comma, "chargedAmount", e.ChargedAmount)
		}
		if s := e.ChannelState; s != nil {
			b = appendSep(b, &comma)
			b = append(b, `"channelState":{"channelId":`...)
			b = appendString(b, s.ChannelID)
			b = appendMember(b, "balance", s.Balance)
			b = appendMember(b, "totalClaimed", s.TotalClaimed)
			b = append(b, `,"withdrawRequestedAt":`...)
			b = strconv.AppendInt(b, s.WithdrawRequestedAt, 10)
			b = appendMember(b, "refundNonce", s.RefundNonce)
			if s.ChargedCumulativeAmount != "" {
				b = appendMember(b, "chargedCumulativeAmount", s.ChargedCumulativeAmount)
			}
			b = append(b, '}')
		}
		if s := e.VoucherState; s != nil {
			b = appendSep(b, &comma)
			b = append(b, `"voucherState":{`...)
			inner := false
			if s.SignedMaxClaimable != "" {
				b = appendField(b, &inner, "signedMaxClaimable", s.SignedMaxClaimable)
			}
			if s.Signature != "" {
				b = appendField(b, &inner, "signature", s.Signature)
			}
			b = append(b, '}')
		}
		b = append(b, '}')
	}
	return append(b, '}'), true
}

// appendErrorMembers appends the omitempty members amount, errorReason and errorMessage both answers share.
func appendErrorMembers(b []byte, amount, reason, message string) []byte {
	if amount != "" {
		b = appendMember(b, "amount", amount)
	}
	if reason != "" {
		b = appendMember(b, "errorReason", reason)
	}
	if message != "" {
		b = appendMember(b, "errorMessage", message)
	}
	return b
}

// appendSep appends the comma before an object's member unless it is the first (*comma false), and notes that
// the next is not.
func appendSep(b []byte, comma *bool) []byte {
	if *comma {
		b = append(b, ',')
	}
	*comma = true
	return b
}

// appendField appends `"name":"value"` as a member of an object whose first member may be this one (appendSep).
func appendField(b []byte, comma *bool, name, value string) []byte {
	b = appendSep(b, comma)
	b = append(b, '"')
	b = append(b, name...)
	b = append(b, '"', ':')
	return appendString(b, value)
}

// appendMember appends `,"name":"value"`: name is one of this file's own, which need no escaping.
func appendMember(b []byte, name, value string) []byte {
	b = append(b, ',', '"')
	b = append(b, name...)
	b = append(b, '"', ':')
	return appendString(b, value)
}

const hexDigits = "0123456789abcdef"

// appendString appends s as a JSON string as encoding/json does with HTML escaping off: '"' and '\\' escaped,
// control characters as \b \f \n \r \t or \u00XX, invalid UTF-8 as \ufffd, and U+2028 and U+2029 escaped (JSONP).
func appendString(b []byte, s string) []byte {
	b = append(b, '"')
	start := 0
	for i := 0; i < len(s); {
		if c := s[i]; c < utf8.RuneSelf {
			if c >= 0x20 && c != '"' && c != '\\' {
				i++
				continue
			}
			b = append(b, s[start:i]...)
			switch c {
			case '"', '\\':
				b = append(b, '\\', c)
			case '\b':
				b = append(b, '\\', 'b')
			case '\f':
				b = append(b, '\\', 'f')
			case '\n':
				b = append(b, '\\', 'n')
			case '\r':
				b = append(b, '\\', 'r')
			case '\t':
				b = append(b, '\\', 't')
			default:
				b = append(b, '\\', 'u', '0', '0', hexDigits[c>>4], hexDigits[c&0xf])
			}
			i++
			start = i
			continue
		}
		r, size := utf8.DecodeRuneInString(s[i:])
		if r == utf8.RuneError && size == 1 {
			b = append(b, s[start:i]...)
			b = append(b, `\ufffd`...)
			i += size
			start = i
			continue
		}
		if r == '\u2028' || r == '\u2029' {
			b = append(b, s[start:i]...)
			b = append(b, '\\', 'u', '2', '0', '2', hexDigits[r&0xf])
			i += size
			start = i
			continue
		}
		i += size
	}
	b = append(b, s[start:]...)
	return append(b, '"')
}

// encodeAnswerHeader is EncodeHeader for the answers appendAnswer writes; ok is false for anything else.
func encodeAnswerHeader(v any) (h string, ok bool, err error) {
	var arr [512]byte
	doc, ok := appendAnswer(arr[:0], v)
	if !ok {
		return "", false, nil
	}
	if len(doc) > MaxHeaderBytes {
		return "", true, headerTooLarge(len(doc))
	}
	return base64.StdEncoding.EncodeToString(doc), true, nil
}
