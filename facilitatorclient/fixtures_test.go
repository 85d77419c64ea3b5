package facilitatorclient

import (
	"encoding/json"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/x402-gateway/caddy-x402/x402"
)

// Addresses and values shaped like the wire facts sheet's examples.
const (
	mainnet       = "eip155:723487"
	testnet       = "eip155:72344"
	token         = "0x5FbDB2315678afecb367f032d93F642f64180aa3"
	payTo         = "0x70997970C51812dc3A010C7d01b50e0d17dc79C8"
	payer         = "0xf39Fd6e51aad88F6F4ce6aB8827279cffFb92266"
	permit2Proxy  = "0x402085c248EeA27D92E8b30b2C58ed07f9E20001"
	walletA       = "0x3C44CdDdB6a900fa2b585dd299e03d12FA4293BC"
	walletB       = "0x90F79bf6EB2c4f870365E785982E1f101E93b906"
	signature65   = "0x8c1a2b3c4d5e6f708192a3b4c5d6e7f8091a2b3c4d5e6f708192a3b4c5d6e7f80102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f201b"
	txHash        = "0x9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"
	amount        = "10000"
	deadline      = "1767225660"
	permit2Nonce  = "54861927012373649487285918409372158027359165498218730238442447155046036592411"
	apiKeyForTest = "sk_live_4f9c2d1e8b7a6c5d"
)

func requirements(network, method string) x402.PaymentRequirements {
	return x402.PaymentRequirements{
		Scheme:            x402.SchemeExact,
		Network:           network,
		Amount:            amount,
		Asset:             token,
		PayTo:             payTo,
		MaxTimeoutSeconds: 60,
		Extra:             x402.Extra{AssetTransferMethod: method, Name: "Stable Coin", Version: "1"},
	}
}

// permit2Request is a version 2 permit2 payment with the gas-sponsoring extension.
func permit2Request(network string) x402.VerifyRequest {
	req := requirements(network, x402.TransferPermit2)
	sponsoring, _ := json.Marshal(map[string]any{"info": x402.EIP2612GasSponsoringInfo{
		From: payer, Asset: token, Spender: "0x000000000022D473030F116dDEE9F6B43aC78BA3",
		Amount: amount, Nonce: "0", Deadline: deadline, Signature: signature65, Version: "1",
	}})
	return x402.VerifyRequest{
		X402Version: x402.Version2,
		PaymentPayload: x402.PaymentPayload{
			X402Version: x402.Version2,
			Resource:    &x402.ResourceInfo{URL: "https://api.example.com/weather", MimeType: "application/json"},
			Accepted:    req,
			Payload: x402.ExactEVMPayload{
				Signature: signature65,
				Permit2Authorization: &x402.Permit2Authorization{
					From:      payer,
					Permitted: x402.TokenPermissions{Token: token, Amount: amount},
					Spender:   permit2Proxy,
					Nonce:     permit2Nonce,
					Deadline:  deadline,
					Witness:   x402.Permit2Witness{To: payTo, ValidAfter: "1767225000"},
				},
			},
			Extensions: map[string]json.RawMessage{x402.ExtensionEIP2612GasSponsoring: sponsoring},
		},
		PaymentRequirements: req,
	}
}

// erc2612Request is a version 2 erc2612 payment whose permit names spender as the settlement wallet.
func erc2612Request(network, spender string) x402.VerifyRequest {
	req := requirements(network, x402.TransferERC2612)
	return x402.VerifyRequest{
		X402Version: x402.Version2,
		PaymentPayload: x402.PaymentPayload{
			X402Version: x402.Version2,
			Accepted:    req,
			Payload: x402.ExactEVMPayload{
				Signature: signature65,
				Authorization: &x402.EIP2612Authorization{
					From: payer, To: spender, Value: amount, ValidAfter: "0", ValidBefore: deadline, Nonce: "3",
				},
			},
		},
		PaymentRequirements: req,
	}
}

func permit2Supported(networks ...string) x402.SupportedResponse {
	s := x402.SupportedResponse{Extensions: []string{x402.ExtensionEIP2612GasSponsoring}, Signers: map[string][]string{}}
	for _, n := range networks {
		s.Kinds = append(s.Kinds, x402.SupportedKind{X402Version: 2, Scheme: x402.SchemeExact, Network: n,
			Extra: x402.Extra{AssetTransferMethod: x402.TransferPermit2, Name: "Stable Coin", Version: "1"}})
	}
	return s
}

func erc2612Supported(wallet string, networks ...string) x402.SupportedResponse {
	s := x402.SupportedResponse{Extensions: []string{}, Signers: map[string][]string{"eip155:*": {wallet}}}
	for _, n := range networks {
		for _, v := range []int{1, 2} {
			s.Kinds = append(s.Kinds, x402.SupportedKind{X402Version: v, Scheme: x402.SchemeExact, Network: n,
				Extra: x402.Extra{AssetTransferMethod: x402.TransferERC2612, Name: "Stable Coin", Version: "1"}})
		}
	}
	return s
}

// fakeFacilitator is a facilitator over real HTTP on 127.0.0.1 that counts and records what it is sent.
// Its handlers answer like a healthy facilitator unless a test replaces them before the first request.
type fakeFacilitator struct {
	srv *httptest.Server

	supported   func(w http.ResponseWriter, r *http.Request)
	verify      func(w http.ResponseWriter, r *http.Request, body []byte)
	settle      func(w http.ResponseWriter, r *http.Request, body []byte)
	health      func(w http.ResponseWriter, r *http.Request)
	supportedOf atomic.Pointer[x402.SupportedResponse]

	supportedCalls, verifyCalls, settleCalls, healthCalls atomic.Int64

	// prefix, when set, is the base path the facilitator is mounted under.
	prefix string

	mu           sync.Mutex
	settleBodies [][]byte
	apiKeys      []string
	paths        []string
}

func newFakeFacilitator(t testing.TB, s x402.SupportedResponse, setup ...func(*fakeFacilitator)) *fakeFacilitator {
	t.Helper()
	f := &fakeFacilitator{}
	f.supportedOf.Store(&s)
	for _, fn := range setup {
		fn(f)
	}
	mux := http.NewServeMux()
	mux.HandleFunc("GET /supported", func(w http.ResponseWriter, r *http.Request) {
		f.supportedCalls.Add(1)
		f.noteKey(r)
		if f.supported != nil {
			f.supported(w, r)
			return
		}
		writeJSON(w, http.StatusOK, f.supportedOf.Load())
	})
	mux.HandleFunc("POST /verify", func(w http.ResponseWriter, r *http.Request) {
		f.verifyCalls.Add(1)
		f.noteKey(r)
		body, _ := io.ReadAll(r.Body)
		if f.verify != nil {
			f.verify(w, r, body)
			return
		}
		writeJSON(w, http.StatusOK, x402.VerifyResponse{IsValid: true, Payer: payer})
	})
	mux.HandleFunc("POST /settle", func(w http.ResponseWriter, r *http.Request) {
		f.settleCalls.Add(1)
		f.noteKey(r)
		body, _ := io.ReadAll(r.Body)
		f.mu.Lock()
		f.settleBodies = append(f.settleBodies, body)
		f.mu.Unlock()
		if f.settle != nil {
			f.settle(w, r, body)
			return
		}
		var req x402.SettleRequest
		_ = json.Unmarshal(body, &req)
		writeJSON(w, http.StatusOK, x402.SettleResponse{Success: true, Transaction: txHash,
			Network: req.PaymentRequirements.Network, Payer: payer, Amount: req.PaymentRequirements.Amount})
	})
	mux.HandleFunc("GET /health", func(w http.ResponseWriter, r *http.Request) {
		f.healthCalls.Add(1)
		if f.health != nil {
			f.health(w, r)
			return
		}
		writeJSON(w, http.StatusOK, x402.HealthResponse{Status: x402.HealthOK})
	})
	f.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		f.mu.Lock()
		f.paths = append(f.paths, r.Method+" "+r.URL.Path)
		f.mu.Unlock()
		if f.prefix != "" {
			http.StripPrefix(f.prefix, mux).ServeHTTP(w, r)
			return
		}
		mux.ServeHTTP(w, r)
	}))
	t.Cleanup(f.srv.Close)
	return f
}

func (f *fakeFacilitator) URL() string { return f.srv.URL }

func (f *fakeFacilitator) noteKey(r *http.Request) {
	f.mu.Lock()
	f.apiKeys = append(f.apiKeys, r.Header.Get("x-api-key"))
	f.mu.Unlock()
}

func (f *fakeFacilitator) settled() [][]byte {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([][]byte(nil), f.settleBodies...)
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
}

func writeRaw(w http.ResponseWriter, status int, body string) {
	w.WriteHeader(status)
	_, _ = io.WriteString(w, body)
}

// dropConnection closes the connection without a byte of answer, as a crashing facilitator or a reset does.
func dropConnection(w http.ResponseWriter) {
	conn, _, err := w.(http.Hijacker).Hijack()
	if err == nil {
		_ = conn.Close()
	}
}

// waitForClient blocks until the client has gone away or long enough has passed, as a hung facilitator does.
func waitForClient(r *http.Request) {
	select {
	case <-r.Context().Done():
	case <-time.After(5 * time.Second):
	}
}

// closedURL is an http URL of 127.0.0.1 on which nothing listens: connecting is refused.
func closedURL(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	url := "http://" + ln.Addr().String()
	_ = ln.Close()
	return url
}

// testClock is a clock the test moves by hand.
type testClock struct {
	mu  sync.Mutex
	now time.Time
}

func newTestClock() *testClock { return &testClock{now: time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)} }

func (c *testClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

func (c *testClock) Advance(d time.Duration) {
	c.mu.Lock()
	c.now = c.now.Add(d)
	c.mu.Unlock()
}

// mustClient is New for tests, with short pauses between retries unless the test says otherwise.
func mustClient(t *testing.T, url string, opts ...Option) *Client {
	t.Helper()
	c, err := New(url, append([]Option{WithRetries(DefaultRetries, 5*time.Millisecond)}, opts...)...)
	if err != nil {
		t.Fatalf("New(%q): %v", url, err)
	}
	return c
}

// failureOf asserts err is a *x402.FacilitatorError and returns it.
func failureOf(t *testing.T, err error) *x402.FacilitatorError {
	t.Helper()
	fe, ok := err.(*x402.FacilitatorError)
	if !ok {
		t.Fatalf("expected *x402.FacilitatorError, got %T: %v", err, err)
	}
	return fe
}

func mustJSON(t *testing.T, v any) []byte {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// supportedDownWhile makes a fake facilitator's /supported answer 503 while down is set, and its permit2 kind
// on the mainnet otherwise.
func supportedDownWhile(down *atomic.Bool) func(*fakeFacilitator) {
	return func(f *fakeFacilitator) {
		f.supported = func(w http.ResponseWriter, _ *http.Request) {
			if down.Load() {
				writeRaw(w, http.StatusServiceUnavailable, "")
				return
			}
			writeJSON(w, http.StatusOK, permit2Supported(mainnet))
		}
	}
}
