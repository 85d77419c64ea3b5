package payer_test

import (
	"bytes"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/big"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ethereum/go-ethereum/crypto"

	"github.com/x402-gateway/caddy-x402/payer"
	"github.com/x402-gateway/caddy-x402/x402"
)

const (
	testNetwork = "eip155:72344"
	testToken   = "0x7e57000000000000000000000000000000007e57"
	testPayTo   = "0x5e11e75e11e75e11e75e11e75e11e75e11e75e11"
	testTx      = "0x1111111111111111111111111111111111111111111111111111111111111111"
)

// seller is a resource server that asks amount of testToken for everything, by permit2 in version 2 or by
// the standard (eip3009) requirement in version 1, and answers a payment with 200 and a settlement response
// without checking it: these tests are about what the client sends, not about settling.
type seller struct {
	t       *testing.T
	version int
	amount  string
	always  bool // answer 402 even to a payment
	// extensions are the extensions its 402 declares.
	extensions map[string]json.RawMessage

	mu       sync.Mutex
	requests []*http.Request
	bodies   []string
	payments []string // the payment header of each request, "" when none
}

func newSeller(t *testing.T, version int, amount string) (*seller, *httptest.Server) {
	s := &seller{t: t, version: version, amount: amount}
	srv := httptest.NewServer(s)
	t.Cleanup(srv.Close)
	return s, srv
}

func (s *seller) requirement() x402.PaymentRequirements {
	r := x402.PaymentRequirements{Scheme: x402.SchemeExact, Network: testNetwork, Amount: s.amount, Asset: testToken,
		PayTo: testPayTo, MaxTimeoutSeconds: 60, Extra: x402.Extra{Name: "Stable Coin", Version: "1"}}
	if s.version == x402.Version2 {
		r.Extra.AssetTransferMethod = x402.TransferPermit2
	}
	return r
}

func (s *seller) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	body, _ := io.ReadAll(r.Body)
	header := x402.HeaderPaymentSignature
	if s.version == x402.Version1 {
		header = x402.HeaderXPayment
	}
	s.mu.Lock()
	s.requests = append(s.requests, r)
	s.bodies = append(s.bodies, string(body))
	s.payments = append(s.payments, r.Header.Get(header))
	s.mu.Unlock()

	if r.Header.Get(header) == "" || s.always {
		required := x402.PaymentRequired{X402Version: s.version, Resource: x402.ResourceInfo{URL: "http://" + r.Host + r.URL.Path},
			Accepts: []x402.PaymentRequirements{s.requirement()}, Extensions: s.extensions}
		if s.version == x402.Version1 {
			v1, err := x402.NewRegistry().PaymentRequiredToV1(required)
			if err != nil {
				s.t.Errorf("converting the offer to version 1: %v", err)
			}
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusPaymentRequired)
			json.NewEncoder(w).Encode(v1)
			return
		}
		h, err := x402.EncodeHeader(required)
		if err != nil {
			s.t.Errorf("encoding PAYMENT-REQUIRED: %v", err)
		}
		w.Header().Set(x402.HeaderPaymentRequired, h)
		w.WriteHeader(http.StatusPaymentRequired)
		return
	}
	settled, err := x402.EncodeHeader(x402.SettleResponse{Success: true, Transaction: testTx, Network: testNetwork, Payer: "0x0"})
	if err != nil {
		s.t.Errorf("encoding the settlement response: %v", err)
	}
	if s.version == x402.Version1 {
		w.Header().Set(x402.HeaderXPaymentResponse, settled)
	} else {
		w.Header().Set(x402.HeaderPaymentResponse, settled)
	}
	fmt.Fprint(w, "the paid report")
}

func (s *seller) seen() (payments, bodies []string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]string(nil), s.payments...), append([]string(nil), s.bodies...)
}

// newPayer is a payer with a fresh key, no RPC and a fixed clock.
func newPayer(t *testing.T) *payer.Payer {
	t.Helper()
	key, err := crypto.GenerateKey()
	if err != nil {
		t.Fatal(err)
	}
	p, err := payer.New(key, payer.Options{Now: func() time.Time { return time.Unix(1_700_000_000, 0) }})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	return p
}

// client pays through a Transport with the given limit of the test token per request.
func client(p *payer.Payer, perRequest int64) (*http.Client, *payer.Transport) {
	tr := &payer.Transport{Payer: p, Limits: []payer.Limit{{Network: testNetwork, Asset: testToken, PerRequest: big.NewInt(perRequest)}}}
	return &http.Client{Transport: tr}, tr
}

func TestTransportPaysA402AndReturnsTheSettlement(t *testing.T) {
	s, srv := newSeller(t, x402.Version2, "10000")
	p := newPayer(t)
	c, tr := client(p, 10_000)

	resp, err := c.Get(srv.URL + "/report")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK || string(body) != "the paid report" {
		t.Fatalf("answer %s %q, want 200 and the report", resp.Status, body)
	}
	settled, err := payer.Settlement(resp)
	if err != nil || settled == nil || !settled.Success || settled.Transaction != testTx {
		t.Fatalf("Settlement = %+v, %v; want the server's successful settlement", settled, err)
	}
	payments, _ := s.seen()
	if len(payments) != 2 || payments[0] != "" || payments[1] == "" {
		t.Fatalf("the server saw payments %q, want none on the first request and one on the second", payments)
	}
	pl, err := x402.DecodePaymentPayload(payments[1])
	if err != nil {
		t.Fatalf("the payment does not decode: %v", err)
	}
	if pl.Accepted.Amount != "10000" || pl.Payload.Permit2Authorization == nil || !x402.SameAddress(pl.Payload.Permit2Authorization.From, p.Address().Hex()) {
		t.Fatalf("payment = %+v, want a permit2 payment of 10000 from %s", pl, p.Address().Hex())
	}
	if got := tr.Spent(testNetwork, testToken); got.Cmp(big.NewInt(10_000)) != 0 {
		t.Fatalf("Spent = %s, want 10000", got)
	}
}

func TestTransportNeverSendsAPaymentOverTheLimit(t *testing.T) {
	s, srv := newSeller(t, x402.Version2, "10000")
	c, tr := client(newPayer(t), 9_999)

	resp, err := c.Get(srv.URL + "/report")
	if err == nil {
		resp.Body.Close()
		t.Fatalf("answer %s, want an error", resp.Status)
	}
	var le *payer.LimitError
	if !errors.As(err, &le) || le.Amount.Cmp(big.NewInt(10_000)) != 0 || le.Limit.Cmp(big.NewInt(9_999)) != 0 {
		t.Fatalf("err = %v, want a LimitError of 10000 over 9999", err)
	}
	for _, w := range []string{"10000", "9999", testToken} {
		if !strings.Contains(err.Error(), w) {
			t.Errorf("error %q does not name %s", err, w)
		}
	}
	if payments, _ := s.seen(); len(payments) != 1 || payments[0] != "" {
		t.Fatalf("the server saw payments %q, want only the unpaid request", payments)
	}
	if got := tr.Spent(testNetwork, testToken); got.Sign() != 0 {
		t.Fatalf("Spent = %s after a refused payment, want 0", got)
	}
}

func TestTransportStopsPayingWhenTheTotalIsSpent(t *testing.T) {
	s, srv := newSeller(t, x402.Version2, "10000")
	tr := &payer.Transport{Payer: newPayer(t), Limits: []payer.Limit{{Total: big.NewInt(25_000)}}}
	c := &http.Client{Transport: tr}
	for i := range 3 {
		resp, err := c.Get(srv.URL + "/report")
		if i < 2 {
			if err != nil || resp.StatusCode != http.StatusOK {
				t.Fatalf("payment %d: %v", i+1, err)
			}
			resp.Body.Close()
			continue
		}
		var le *payer.LimitError
		if !errors.As(err, &le) || le.Spent.Cmp(big.NewInt(20_000)) != 0 || !strings.Contains(err.Error(), "total budget of 25000") {
			t.Fatalf("the third payment = %v, want a LimitError naming the total of 25000 with 20000 spent", err)
		}
	}
	if payments, _ := s.seen(); len(payments) != 5 {
		t.Fatalf("the server saw %d requests, want 2 paid pairs and 1 unpaid", len(payments))
	}
}

func TestTransportSendsAPOSTBodyAgainWithThePayment(t *testing.T) {
	for _, tc := range []struct {
		name string
		body func(string) io.Reader
	}{
		{"with GetBody", func(s string) io.Reader { return strings.NewReader(s) }},
		{"buffered", func(s string) io.Reader { return io.NopCloser(bytes.NewBufferString(s)) }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s, srv := newSeller(t, x402.Version2, "1")
			c, _ := client(newPayer(t), 1)
			resp, err := c.Post(srv.URL+"/report", "text/plain", tc.body("the question"))
			if err != nil || resp.StatusCode != http.StatusOK {
				t.Fatalf("POST: %v", err)
			}
			resp.Body.Close()
			payments, bodies := s.seen()
			if len(bodies) != 2 || bodies[0] != "the question" || bodies[1] != "the question" || payments[1] == "" {
				t.Fatalf("the server saw bodies %q, want the question twice, the second time paid", bodies)
			}
		})
	}
}

func TestTransportRefusesToPayForABodyItCannotSendAgain(t *testing.T) {
	s, srv := newSeller(t, x402.Version2, "1")
	tr := &payer.Transport{Payer: newPayer(t), Limits: []payer.Limit{{PerRequest: big.NewInt(1)}}, MaxBufferedBody: 4}
	c := &http.Client{Transport: tr}
	_, err := c.Post(srv.URL+"/report", "text/plain", io.NopCloser(strings.NewReader("longer than four bytes")))
	if err == nil || !strings.Contains(err.Error(), "cannot be sent again") {
		t.Fatalf("POST = %v, want an error saying the body cannot be sent again", err)
	}
	if payments, bodies := s.seen(); len(payments) != 1 || payments[0] != "" || bodies[0] != "longer than four bytes" {
		t.Fatalf("the server saw payments %q and bodies %q, want one unpaid request with the whole body", payments, bodies)
	}
}

func TestTransportPaysAVersion1ServerByXPayment(t *testing.T) {
	s, srv := newSeller(t, x402.Version1, "10000")
	c, _ := client(newPayer(t), 10_000)
	resp, err := c.Get(srv.URL + "/report")
	if err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("GET: %v", err)
	}
	defer resp.Body.Close()
	payments, _ := s.seen()
	v1, err := x402.DecodePaymentPayloadV1(payments[len(payments)-1])
	if err != nil || v1.Payload.Authorization == nil {
		t.Fatalf("the payment is no version 1 eip3009 payment: %+v, %v", v1, err)
	}
	if settled, err := payer.Settlement(resp); err != nil || settled == nil || settled.Transaction != testTx {
		t.Fatalf("Settlement = %+v, %v; want the X-PAYMENT-RESPONSE", settled, err)
	}
}

func TestTransportPaysOnceAndReturnsASecond402(t *testing.T) {
	s, srv := newSeller(t, x402.Version2, "1")
	s.always = true
	c, _ := client(newPayer(t), 1)
	resp, err := c.Get(srv.URL + "/report")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if payments, _ := s.seen(); resp.StatusCode != http.StatusPaymentRequired || len(payments) != 2 {
		t.Fatalf("answer %s after %d requests, want the second 402 after 2", resp.Status, len(payments))
	}
}

func TestTransportPassesThroughA402ThatIsNoX402Offer(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusPaymentRequired)
		fmt.Fprint(w, "pay at the counter")
	}))
	defer srv.Close()
	c, _ := client(newPayer(t), 1)
	resp, err := c.Get(srv.URL)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusPaymentRequired || string(body) != "pay at the counter" {
		t.Fatalf("answer %s %q, want the 402 as it came", resp.Status, body)
	}
	if s, err := payer.Settlement(resp); s != nil || err != nil {
		t.Fatalf("Settlement of an unpaid answer = %+v, %v; want nil, nil", s, err)
	}
}

func TestAPayerNeverPrintsItsKey(t *testing.T) {
	key, err := crypto.GenerateKey()
	if err != nil {
		t.Fatal(err)
	}
	p, err := payer.New(key, payer.Options{})
	if err != nil {
		t.Fatal(err)
	}
	secret := hex.EncodeToString(crypto.FromECDSA(key))
	decimal := key.D.String()
	for _, verb := range []string{"%v", "%+v", "%#v", "%s"} {
		out := fmt.Sprintf(verb, p)
		if strings.Contains(out, secret) || strings.Contains(out, decimal) || !strings.Contains(out, p.Address().Hex()) {
			t.Errorf("%s prints %q: want the address and no key", verb, out)
		}
	}
}

func TestNewRefusesAMethodItCannotPay(t *testing.T) {
	key, _ := crypto.GenerateKey()
	if _, err := payer.New(key, payer.Options{Method: "upto"}); err == nil || !strings.Contains(err.Error(), `"upto"`) {
		t.Fatalf("New with method upto = %v, want an error naming it", err)
	}
	if _, err := payer.New(key, payer.Options{Method: x402.TransferERC2612}); err == nil || !strings.Contains(err.Error(), "RPC") {
		t.Fatalf("New with method erc2612 and no RPC = %v, want an error saying it needs one", err)
	}
}
