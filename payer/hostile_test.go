package payer_test

import (
	"context"
	"errors"
	"math/big"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ethereum/go-ethereum/common"
	"github.com/ethereum/go-ethereum/crypto"

	"github.com/x402-gateway/caddy-x402/chain/contracts"
	"github.com/x402-gateway/caddy-x402/payer"
	"github.com/x402-gateway/caddy-x402/x402"
)

// hostileSeller is a resource server that offers what offer says and answers every payment 200 with answer as
// its PAYMENT-RESPONSE, settling nothing: the seller of these tests lies in its 402, in its PAYMENT-RESPONSE, or
// in both.
type hostileSeller struct {
	t      *testing.T
	offer  x402.PaymentRequirements
	answer x402.SettleResponse
	srv    *httptest.Server

	mu       sync.Mutex
	payments []x402.PaymentPayload
}

func newHostileSeller(t *testing.T, offer x402.PaymentRequirements, answer x402.SettleResponse) *hostileSeller {
	s := &hostileSeller{t: t, offer: offer, answer: answer}
	s.srv = httptest.NewServer(s)
	t.Cleanup(s.srv.Close)
	return s
}

func (s *hostileSeller) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	h := r.Header.Get(x402.HeaderPaymentSignature)
	if h == "" {
		v, err := x402.EncodeHeader(x402.PaymentRequired{X402Version: x402.Version2, Resource: x402.ResourceInfo{URL: "http://" + r.Host + r.URL.Path},
			Accepts: []x402.PaymentRequirements{s.offer}})
		if err != nil {
			s.t.Error(err)
		}
		w.Header().Set(x402.HeaderPaymentRequired, v)
		w.WriteHeader(http.StatusPaymentRequired)
		return
	}
	p, err := x402.DecodePaymentPayload(h)
	if err != nil {
		s.t.Errorf("the payer sent a payment that does not decode: %v", err)
	}
	s.mu.Lock()
	s.payments = append(s.payments, p)
	s.mu.Unlock()
	v, err := x402.EncodeHeader(s.answer)
	if err != nil {
		s.t.Error(err)
	}
	w.Header().Set(x402.HeaderPaymentResponse, v)
	w.Write([]byte("served"))
}

func (s *hostileSeller) received() []x402.PaymentPayload {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]x402.PaymentPayload(nil), s.payments...)
}

// uptoOffer is an upto requirement of at most 10000 of the test token, naming a facilitator wallet.
func uptoOffer() x402.PaymentRequirements {
	return x402.PaymentRequirements{Scheme: x402.SchemeUpto, Network: testNetwork, Amount: "10000", Asset: testToken, PayTo: testPayTo,
		MaxTimeoutSeconds: 300, Extra: x402.Extra{AssetTransferMethod: x402.TransferPermit2, Name: "Stable Coin", Version: "1",
			FacilitatorAddress: "0xfac1fac1fac1fac1fac1fac1fac1fac1fac1fac1"}}
}

func TestTransportCountsAnUptoPaymentAtItsMaximumWhateverThePaymentResponseSays(t *testing.T) {
	// The seller keeps every authorization and says each cost nothing. Without a chain to show otherwise, each
	// counts at the maximum it signed: two fit in a total of 20000, the third is not signed.
	s := newHostileSeller(t, uptoOffer(), x402.SettleResponse{Success: true, Transaction: testTx, Network: testNetwork, Amount: "0"})
	tr := &payer.Transport{Payer: newPayer(t), Limits: []payer.Limit{{Network: testNetwork, Asset: testToken, Total: big.NewInt(20_000)}}}
	c := &http.Client{Transport: tr}
	var refused int
	for range 10 {
		resp, err := c.Get(s.srv.URL + "/metered")
		var le *payer.LimitError
		switch {
		case errors.As(err, &le):
			refused++
		case err != nil:
			t.Fatal(err)
		default:
			resp.Body.Close()
		}
	}
	if got := len(s.received()); got != 2 || refused != 8 {
		t.Errorf("the seller got %d authorizations of 10000 and %d requests were refused, under a total of 20000; want 2 and 8", got, refused)
	}
	if spent, signed := tr.Spent(testNetwork, testToken), tr.Signed(testNetwork, testToken); spent.Cmp(big.NewInt(20_000)) != 0 || signed.Cmp(big.NewInt(20_000)) != 0 {
		t.Errorf("Spent %s, Signed %s; want 20000 each: a PAYMENT-RESPONSE is the seller's word, not the chain's", spent, signed)
	}
}

func TestAPayerCapsHowLongWhatItSignsStaysValidAndRefusesADeadlineThatWraps(t *testing.T) {
	const now = 1_700_000_000
	clock := func() time.Time { return time.Unix(now, 0) }
	key, err := crypto.GenerateKey()
	if err != nil {
		t.Fatal(err)
	}
	deadlineOf := func(p x402.PaymentPayload) string {
		if a := p.Payload.Permit2Authorization; a != nil {
			return a.Deadline
		}
		return p.Payload.Authorization.ValidBefore
	}
	for _, tc := range []struct {
		name        string
		method      string
		maxTimeout  int64
		maxValidity time.Duration
		want        int64 // the deadline signed, seconds after now; 0 when it must be refused
	}{
		{name: "a deadline within the cap is the server's", method: x402.TransferPermit2, maxTimeout: 300, want: 300},
		{name: "thousands of years are capped at the default ten minutes", method: x402.TransferPermit2, maxTimeout: 100_000_000_000, want: 600},
		{name: "the cap is the payer's to set", method: x402.TransferPermit2, maxTimeout: 300, maxValidity: time.Minute, want: 60},
		{name: "eip3009 is capped too", method: x402.TransferEIP3009, maxTimeout: 100_000_000_000, want: 600},
		{name: "2^63-1 seconds wraps and is refused", method: x402.TransferPermit2, maxTimeout: 9223372036854775807},
		{name: "2^63-1 seconds wraps and is refused by eip3009", method: x402.TransferEIP3009, maxTimeout: 9223372036854775807},
	} {
		t.Run(tc.name, func(t *testing.T) {
			offer := x402.PaymentRequirements{Scheme: x402.SchemeExact, Network: testNetwork, Amount: "10000", Asset: testToken, PayTo: testPayTo,
				MaxTimeoutSeconds: tc.maxTimeout, Extra: x402.Extra{AssetTransferMethod: tc.method, Name: "Stable Coin", Version: "1"}}
			s := newHostileSeller(t, offer, x402.SettleResponse{Success: true, Transaction: testTx, Network: testNetwork})
			p, err := payer.New(key, payer.Options{Now: clock, MaxValidity: tc.maxValidity})
			if err != nil {
				t.Fatal(err)
			}
			c, _ := client(p, 10_000)
			resp, err := c.Get(s.srv.URL + "/report")
			if tc.want == 0 {
				if err == nil || !strings.Contains(err.Error(), "requirements.maxTimeoutSeconds") || !strings.Contains(err.Error(), "never expire") {
					t.Errorf("paying an offer of maxTimeoutSeconds %d: %v; want a refusal naming requirements.maxTimeoutSeconds", tc.maxTimeout, err)
				}
				for _, pl := range s.received() {
					t.Errorf("the seller got a payment with deadline %s", deadlineOf(pl))
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			resp.Body.Close()
			got := s.received()
			if len(got) != 1 {
				t.Fatalf("the seller got %d payments, want 1", len(got))
			}
			if d := deadlineOf(got[0]); d != big.NewInt(now+tc.want).String() {
				t.Errorf("signed deadline %s, want now + %d s = %d", d, tc.want, now+tc.want)
			}
			// SignBatch, which bench signs with, applies the same cap.
			offerOf := payer.Offer{Version: x402.Version2, Required: x402.PaymentRequired{X402Version: x402.Version2, Accepts: []x402.PaymentRequirements{offer}}}
			pays, err := p.SignBatch(context.Background(), offerOf, 0, 2)
			if err != nil {
				t.Fatal(err)
			}
			for _, pay := range pays {
				if d := deadlineOf(pay.Payload); d != big.NewInt(now+tc.want).String() {
					t.Errorf("SignBatch signed deadline %s, want %d", d, now+tc.want)
				}
			}
		})
	}
	if _, err := payer.New(key, payer.Options{MaxValidity: -time.Second}); err == nil || !strings.Contains(err.Error(), "MaxValidity") {
		t.Errorf("New with a negative MaxValidity: %v; want an error naming it", err)
	}
}

func TestAPayerSignsPermit2OnlyForThePinnedContractsAndSaysWhichItRefused(t *testing.T) {
	hostile := "0xbadbadbadbadbadbadbadbadbadbadbadbadbad0"
	exact := x402.PaymentRequirements{Scheme: x402.SchemeExact, Network: testNetwork, Amount: "10000", Asset: testToken, PayTo: testPayTo,
		MaxTimeoutSeconds: 300, Extra: x402.Extra{AssetTransferMethod: x402.TransferPermit2, Name: "Stable Coin", Version: "1"}}
	withExtra := func(r x402.PaymentRequirements, f func(*x402.Extra)) x402.PaymentRequirements {
		f(&r.Extra)
		return r
	}
	custom := payer.Contracts{Permit2: common.HexToAddress("0x00000000000000000000000000000000000000aa"), ExactProxy: common.HexToAddress("0x00000000000000000000000000000000000000bb")}
	for _, tc := range []struct {
		name      string
		offer     x402.PaymentRequirements
		contracts map[string]payer.Contracts
		errs      []string // nil: paid, to wantSpender
		spender   string
	}{
		{name: "no contracts named: the canonical ones", offer: exact, spender: contracts.ProxyAddress.Hex()},
		{name: "the canonical ones named", offer: withExtra(exact, func(e *x402.Extra) {
			e.Permit2Address, e.X402Permit2ProxyAddress = strings.ToLower(contracts.Permit2Address.Hex()), contracts.ProxyAddress.Hex()
		}), spender: contracts.ProxyAddress.Hex()},
		{name: "a hostile proxy", offer: withExtra(exact, func(e *x402.Extra) { e.X402Permit2ProxyAddress = hostile }),
			errs: []string{"requirements.extra.x402Permit2ProxyAddress is " + common.HexToAddress(hostile).Hex(), "x402ExactPermit2Proxy at " + contracts.ProxyAddress.Hex(), testNetwork}},
		{name: "a hostile Permit2", offer: withExtra(exact, func(e *x402.Extra) { e.Permit2Address = hostile }),
			errs: []string{"requirements.extra.permit2Address is " + common.HexToAddress(hostile).Hex(), "Permit2 at " + contracts.Permit2Address.Hex()}},
		{name: "the exact proxy as an upto spender", offer: withExtra(uptoOffer(), func(e *x402.Extra) { e.X402Permit2ProxyAddress = contracts.ProxyAddress.Hex() }),
			errs: []string{"x402UptoPermit2Proxy at " + contracts.UptoProxyAddress.Hex()}},
		{name: "the canonical upto proxy", offer: uptoOffer(), spender: contracts.UptoProxyAddress.Hex()},
		{name: "contracts pinned for the network", offer: withExtra(exact, func(e *x402.Extra) {
			e.Permit2Address, e.X402Permit2ProxyAddress = custom.Permit2.Hex(), custom.ExactProxy.Hex()
		}), contracts: map[string]payer.Contracts{testNetwork: custom}, spender: custom.ExactProxy.Hex()},
		{name: "the canonical ones where others are pinned", offer: exact, contracts: map[string]payer.Contracts{testNetwork: custom},
			errs: []string{"names none, which means the canonical Permit2", "only for the Permit2 at " + custom.Permit2.Hex()}},
		{name: "contracts pinned for another network do not apply", offer: withExtra(exact, func(e *x402.Extra) { e.X402Permit2ProxyAddress = custom.ExactProxy.Hex() }),
			contracts: map[string]payer.Contracts{"eip155:1": custom}, errs: []string{"x402ExactPermit2Proxy at " + contracts.ProxyAddress.Hex()}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			key, err := crypto.GenerateKey()
			if err != nil {
				t.Fatal(err)
			}
			p, err := payer.New(key, payer.Options{Contracts: tc.contracts})
			if err != nil {
				t.Fatal(err)
			}
			s := newHostileSeller(t, tc.offer, x402.SettleResponse{Success: true, Transaction: testTx, Network: testNetwork})
			c, _ := client(p, 10_000)
			resp, err := c.Get(s.srv.URL + "/report")
			if tc.errs != nil {
				if err == nil {
					resp.Body.Close()
					t.Fatalf("paid an offer naming %s / %s", tc.offer.Extra.Permit2Address, tc.offer.Extra.X402Permit2ProxyAddress)
				}
				for _, w := range tc.errs {
					if !strings.Contains(err.Error(), w) {
						t.Errorf("error %q does not say %q", err, w)
					}
				}
				if n := len(s.received()); n != 0 {
					t.Errorf("the seller got %d payments, want none", n)
				}
				offer := payer.Offer{Version: x402.Version2, Required: x402.PaymentRequired{X402Version: x402.Version2, Accepts: []x402.PaymentRequirements{tc.offer}}}
				if _, err := p.Sign(context.Background(), offer, 0); err == nil {
					t.Error("Sign signed it")
				}
				if _, err := p.SignBatch(context.Background(), offer, 0, 1); err == nil {
					t.Error("SignBatch signed it")
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			resp.Body.Close()
			got := s.received()
			if len(got) != 1 || got[0].Payload.Permit2Authorization == nil || got[0].Payload.Permit2Authorization.Spender != tc.spender {
				t.Fatalf("the seller got %+v, want one permit2 payment to the spender %s", got, tc.spender)
			}
		})
	}
}
