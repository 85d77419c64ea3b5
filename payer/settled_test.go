package payer_test

import (
	"context"
	"errors"
	"math/big"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
	"time"

	"github.com/ethereum/go-ethereum/common"

	"github.com/x402-gateway/caddy-x402/chain"
	"github.com/x402-gateway/caddy-x402/chain/chaintest"
	"github.com/x402-gateway/caddy-x402/chain/contracts"
	"github.com/x402-gateway/caddy-x402/chain/journal"
	"github.com/x402-gateway/caddy-x402/payer"
	"github.com/x402-gateway/caddy-x402/x402"
)

// uptoMax is the most each upto payment of these tests may cost: 0.01 of a 6-decimal token.
const uptoMax = 10_000

// meteredSeller sells one upto resource on the simulated chain, through the real engine: each payment is
// verified, then answered as answer decides (settled honestly, settled and lied about, or held).
type meteredSeller struct {
	t     *testing.T
	c     *chaintest.Chain
	f     *chain.Facilitator
	req   x402.PaymentRequirements
	url   string
	payTo common.Address

	mu     sync.Mutex
	answer func(w http.ResponseWriter, vr x402.VerifyRequest)
	held   []x402.VerifyRequest
	paid   int
}

func newMeteredSeller(t *testing.T, c *chaintest.Chain) *meteredSeller {
	t.Helper()
	nc := chain.NetworkConfig{
		Network: x402.EIP155(c.ChainID.Uint64()), Backend: c.Client, ReceiptPoll: 2 * time.Millisecond,
		Assets: []chain.AssetConfig{{Address: c.Token, Name: contracts.StableCoinName, Version: contracts.StableCoinVersion, Decimals: 6}},
	}
	for _, w := range c.Wallets {
		nc.Keys = append(nc.Keys, w.Key)
	}
	f, err := chain.New(context.Background(), chain.Config{Networks: []chain.NetworkConfig{nc}, Journal: journal.NewMemory(journal.Options{})})
	if err != nil {
		t.Fatalf("starting the facilitator: %v", err)
	}
	t.Cleanup(func() { f.Close() })
	s := &meteredSeller{t: t, c: c, f: f, payTo: common.HexToAddress("0x5e11e75e11e75e11e75e11e75e11e75e11e75e11")}
	s.req = x402.PaymentRequirements{Scheme: x402.SchemeUpto, Network: nc.Network, Amount: big.NewInt(uptoMax).String(), Asset: c.Token.Hex(),
		PayTo: s.payTo.Hex(), MaxTimeoutSeconds: 300, Extra: x402.Extra{AssetTransferMethod: x402.TransferPermit2,
			Name: contracts.StableCoinName, Version: contracts.StableCoinVersion, FacilitatorAddress: c.Wallets[0].Address.Hex()}}
	srv := httptest.NewServer(s)
	t.Cleanup(srv.Close)
	s.url = srv.URL + "/metered"
	return s
}

func (s *meteredSeller) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	h := r.Header.Get(x402.HeaderPaymentSignature)
	if h == "" {
		v, err := x402.EncodeHeader(x402.PaymentRequired{X402Version: x402.Version2, Resource: x402.ResourceInfo{URL: s.url}, Accepts: []x402.PaymentRequirements{s.req}})
		if err != nil {
			s.t.Error(err)
		}
		w.Header().Set(x402.HeaderPaymentRequired, v)
		w.WriteHeader(http.StatusPaymentRequired)
		return
	}
	p, err := x402.DecodePaymentPayload(h)
	if err != nil {
		s.t.Errorf("decoding the payment: %v", err)
		return
	}
	vr := x402.VerifyRequest{X402Version: x402.Version2, PaymentPayload: p, PaymentRequirements: s.req}
	if v, err := s.f.Verify(r.Context(), vr); err != nil || !v.IsValid {
		s.t.Errorf("the payer's payment does not verify: %+v, %v", v, err)
		return
	}
	s.mu.Lock()
	s.paid++
	answer := s.answer
	s.mu.Unlock()
	answer(w, vr)
}

// settle settles vr for amount raw units (at most the maximum it was signed for) and returns the engine's answer.
func (s *meteredSeller) settle(vr x402.VerifyRequest, amount int64) x402.SettleResponse {
	s.t.Helper()
	vr.PaymentRequirements.Amount = big.NewInt(amount).String()
	resp, err := s.f.Settle(context.Background(), vr)
	if err != nil || !resp.Success {
		s.t.Fatalf("settling %d: %+v, %v", amount, resp, err)
	}
	return resp
}

func (s *meteredSeller) serve(w http.ResponseWriter, settled x402.SettleResponse) {
	v, err := x402.EncodeHeader(settled)
	if err != nil {
		s.t.Error(err)
	}
	w.Header().Set(x402.HeaderPaymentResponse, v)
	w.Write([]byte("metered"))
}

func (s *meteredSeller) setAnswer(a func(w http.ResponseWriter, vr x402.VerifyRequest)) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.answer = a
}

// get fetches the metered resource through c; a *payer.LimitError is returned as it is.
func get(t *testing.T, c *http.Client, url string) error {
	t.Helper()
	resp, err := c.Get(url)
	if err != nil {
		return err
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("answer %s, want 200", resp.Status)
	}
	return nil
}

func TestTransportGivesBackWhatAnUptoPaymentDidNotCostOnlyWhenTheChainShowsIt(t *testing.T) {
	c := chaintest.New(t, chaintest.WithHTTP())
	t.Cleanup(c.AutoCommit(5 * time.Millisecond))
	s := newMeteredSeller(t, c)
	account := c.Payers[0]
	c.Approve(account, contracts.Permit2Address, new(big.Int).Lsh(big.NewInt(1), 200))
	network, token := s.req.Network, c.Token.Hex()

	p, err := payer.New(account.Key, payer.Options{RPC: c.RPCURL})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	moved := func(before *big.Int) *big.Int { return new(big.Int).Sub(before, c.TokenBalance(account.Address)) }

	var honestTx string
	t.Run("an honest seller's charge is proved on chain and the rest of the maximum given back", func(t *testing.T) {
		tr := &payer.Transport{Payer: p, Limits: []payer.Limit{{Network: network, Asset: token, Total: big.NewInt(100_000)}}}
		hc := &http.Client{Transport: tr}
		s.setAnswer(func(w http.ResponseWriter, vr x402.VerifyRequest) {
			r := s.settle(vr, 2500)
			honestTx = r.Transaction
			s.serve(w, r)
		})
		before := c.TokenBalance(account.Address)
		if err := get(t, hc, s.url); err != nil {
			t.Fatal(err)
		}
		if got := moved(before); got.Cmp(big.NewInt(2500)) != 0 {
			t.Fatalf("the chain moved %s from the payer, want 2500", got)
		}
		if spent, signed := tr.Spent(network, token), tr.Signed(network, token); spent.Cmp(big.NewInt(2500)) != 0 || signed.Cmp(big.NewInt(uptoMax)) != 0 || tr.Pending() != 0 {
			t.Errorf("Spent %s, Signed %s, Pending %d; want 2500 (what the chain moved), %d (the maximum signed), 0", spent, signed, tr.Pending(), uptoMax)
		}
	})

	t.Run("a gas-sponsored payment, settled by settleWithPermit, is proved too", func(t *testing.T) {
		sponsored, err := payer.New(c.PayerNoGas.Key, payer.Options{RPC: c.RPCURL})
		if err != nil {
			t.Fatal(err)
		}
		defer sponsored.Close()
		tr := &payer.Transport{Payer: sponsored, Limits: []payer.Limit{{Network: network, Asset: token, Total: big.NewInt(100_000)}}}
		var withPermit bool
		s.setAnswer(func(w http.ResponseWriter, vr x402.VerifyRequest) {
			_, withPermit = vr.PaymentPayload.Extensions[x402.ExtensionEIP2612GasSponsoring]
			s.serve(w, s.settle(vr, 4000))
		})
		before := c.TokenBalance(c.PayerNoGas.Address)
		if err := get(t, &http.Client{Transport: tr}, s.url); err != nil {
			t.Fatal(err)
		}
		if got := new(big.Int).Sub(before, c.TokenBalance(c.PayerNoGas.Address)); !withPermit || got.Cmp(big.NewInt(4000)) != 0 {
			t.Fatalf("sponsored %v, the chain moved %s; want a sponsored payment moving 4000", withPermit, got)
		}
		if spent := tr.Spent(network, token); spent.Cmp(big.NewInt(4000)) != 0 || tr.Pending() != 0 {
			t.Errorf("Spent %s, Pending %d; want 4000 and 0", spent, tr.Pending())
		}
	})

	t.Run("a seller that settles the maximum and says it charged nothing is counted the maximum", func(t *testing.T) {
		tr := &payer.Transport{Payer: p, Limits: []payer.Limit{{Network: network, Asset: token, Total: big.NewInt(100_000)}}}
		hc := &http.Client{Transport: tr}
		s.setAnswer(func(w http.ResponseWriter, vr x402.VerifyRequest) {
			r := s.settle(vr, uptoMax)
			r.Amount = "0"
			s.serve(w, r)
		})
		before := c.TokenBalance(account.Address)
		if err := get(t, hc, s.url); err != nil {
			t.Fatal(err)
		}
		if got := moved(before); got.Cmp(big.NewInt(uptoMax)) != 0 {
			t.Fatalf("the chain moved %s from the payer, want %d", got, uptoMax)
		}
		if spent := tr.Spent(network, token); spent.Cmp(big.NewInt(uptoMax)) != 0 {
			t.Errorf("Spent %s after a settlement of %d said to cost 0; want %d, what the chain moved", spent, uptoMax, uptoMax)
		}
	})

	t.Run("a seller that holds ten authorizations under a total of two gets two, and the chain gives back what they did not cost", func(t *testing.T) {
		tr := &payer.Transport{Payer: p, Limits: []payer.Limit{{Network: network, Asset: token, Total: big.NewInt(2 * uptoMax)}}}
		hc := &http.Client{Transport: tr}
		// Decoys the seller names as its settlements: a real settlement of this payer to this seller through the
		// proxy (another payment's), and a plain transfer of this payer to the seller.
		plain := c.TransferToken(account, s.payTo, big.NewInt(1)).TxHash.Hex()
		decoys := []string{honestTx, plain}
		s.setAnswer(func(w http.ResponseWriter, vr x402.VerifyRequest) {
			s.mu.Lock()
			s.held = append(s.held, vr)
			decoy := decoys[(len(s.held)-1)%len(decoys)]
			s.mu.Unlock()
			s.serve(w, x402.SettleResponse{Success: true, Transaction: decoy, Network: network, Payer: account.Address.Hex(), Amount: "0"})
		})
		var refused int
		for range 10 {
			err := get(t, hc, s.url)
			var le *payer.LimitError
			switch {
			case errors.As(err, &le):
				refused++
			case err != nil:
				t.Fatal(err)
			}
		}
		if len(s.held) != 2 || refused != 8 {
			t.Fatalf("the seller holds %d authorizations of %d and %d requests were refused, under a total of %d; want 2 and 8", len(s.held), uptoMax, refused, 2*uptoMax)
		}
		if spent := tr.Spent(network, token); spent.Cmp(big.NewInt(2*uptoMax)) != 0 || tr.Pending() != 2 {
			t.Fatalf("Spent %s, Pending %d while the seller holds two authorizations; want %d and 2", spent, tr.Pending(), 2*uptoMax)
		}
		if err := tr.Reconcile(context.Background()); err != nil {
			t.Fatal(err)
		}
		if spent := tr.Spent(network, token); spent.Cmp(big.NewInt(2*uptoMax)) != 0 || tr.Pending() != 2 {
			t.Fatalf("Reconcile gave back while both authorizations are unspent and valid: Spent %s, Pending %d", spent, tr.Pending())
		}

		// The seller settles the first for 1000, later: Reconcile finds the transfer and gives back the rest.
		before := c.TokenBalance(account.Address)
		s.settle(s.held[0], 1000)
		if got := moved(before); got.Cmp(big.NewInt(1000)) != 0 {
			t.Fatalf("the chain moved %s, want 1000", got)
		}
		if err := tr.Reconcile(context.Background()); err != nil {
			t.Fatal(err)
		}
		if spent := tr.Spent(network, token); spent.Cmp(big.NewInt(1000+uptoMax)) != 0 || tr.Pending() != 1 {
			t.Fatalf("after the chain shows 1000 moved by one: Spent %s, Pending %d; want %d and 1", spent, tr.Pending(), 1000+uptoMax)
		}

		// The second expires unspent: once the chain is past its deadline, all of it comes back, and it can
		// indeed no longer be settled.
		c.AdjustTime(11 * time.Minute)
		if err := tr.Reconcile(context.Background()); err != nil {
			t.Fatal(err)
		}
		if spent := tr.Spent(network, token); spent.Cmp(big.NewInt(1000)) != 0 || tr.Pending() != 0 {
			t.Fatalf("after the second expired unspent: Spent %s, Pending %d; want 1000 and 0", spent, tr.Pending())
		}
		if signed := tr.Signed(network, token); signed.Cmp(big.NewInt(2*uptoMax)) != 0 {
			t.Errorf("Signed %s, want %d", signed, 2*uptoMax)
		}
		vr := s.held[1]
		vr.PaymentRequirements.Amount = "1"
		if r, err := s.f.Settle(context.Background(), vr); err == nil && r.Success {
			t.Errorf("the expired authorization settled: %+v", r)
		}
	})
}
