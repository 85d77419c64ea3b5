package caddymodule

import (
	"errors"
	"fmt"
	"math/big"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ethereum/go-ethereum/common/hexutil"
	"github.com/ethereum/go-ethereum/crypto"

	"github.com/x402-gateway/caddy-x402/chain"
	"github.com/x402-gateway/caddy-x402/x402"
)

// batchRoute is a batch-settlement resource server with no chain: it judges each payment with the engine's
// off-chain checks and credits deposits as the escrow would, keeping one channel's balance and accepted amount.
type batchRoute struct {
	t     *testing.T
	req   x402.BatchRequirements
	terms *chain.BatchTerms

	mu       sync.Mutex
	balance  *big.Int
	charged  *big.Int
	payloads []string
	// refuse, when set, names the reason the paid request of a turn (0, 1, ...) is refused with, "" for none.
	refuse func(turn int) string
}

func newBatchRoute(t *testing.T) (*batchRoute, *httptest.Server) {
	key, _ := crypto.GenerateKey()
	b := &batchRoute{t: t, balance: new(big.Int), charged: new(big.Int), req: x402.BatchRequirements{
		Scheme: x402.SchemeBatchSettlement, Network: "eip155:72344", Amount: "1000", Asset: "0x7e57000000000000000000000000000000007e57",
		PayTo: "0x5e11e75e11e75e11e75e11e75e11e75e11e75e11", MaxTimeoutSeconds: 60,
		Extra: x402.BatchExtra{ReceiverAuthorizer: crypto.PubkeyToAddress(key.PublicKey).Hex(), WithdrawDelay: 900, Name: "Stable Coin", Version: "1", MinDeposit: "4000"},
	}}
	var err error
	if b.terms, err = chain.NewBatchTerms(b.req, big.NewInt(72344), time.Minute); err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(b)
	t.Cleanup(srv.Close)
	return b, srv
}

func (b *batchRoute) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	b.mu.Lock()
	defer b.mu.Unlock()
	offer := func(reason string) {
		h, _ := x402.EncodeHeader(map[string]any{"x402Version": 2, "error": reason,
			"resource": x402.ResourceInfo{URL: "http://" + r.Host + r.URL.Path}, "accepts": []any{b.req}})
		w.Header().Set(x402.HeaderPaymentRequired, h)
		w.WriteHeader(http.StatusPaymentRequired)
	}
	h := r.Header.Get(x402.HeaderPaymentSignature)
	if h == "" {
		offer("")
		return
	}
	p, err := x402.DecodeBatchPayment(h)
	if err != nil {
		b.t.Errorf("the payment does not decode: %v", err)
		offer(x402.ReasonInvalidPayload)
		return
	}
	b.payloads = append(b.payloads, p.Payload.Type+"@"+p.Payload.Voucher.MaxClaimableAmount)
	if b.refuse != nil {
		if reason := b.refuse(len(b.payloads) - 1); reason != "" {
			offer(reason)
			return
		}
	}
	view := chain.ChannelView{Balance: new(big.Int).Set(b.balance), Charged: new(big.Int).Set(b.charged), TotalClaimed: new(big.Int), ReadAt: time.Now()}
	if p.Payload.Type == x402.BatchDeposit {
		if refusal := b.terms.CheckDepositAuthorization(&p, time.Now()); refusal != nil {
			b.t.Errorf("the deposit is refused: %v", refusal)
			offer(refusal.Reason)
			return
		}
		d, _ := x402.ParseAmount(p.Payload.Deposit.Amount)
		view.Balance.Add(view.Balance, d)
	}
	av, err := b.terms.CheckVoucher(&p, view, time.Now())
	var refusal *chain.BatchRefusal
	if errors.As(err, &refusal) {
		offer(refusal.Reason)
		return
	} else if err != nil {
		b.t.Errorf("checking the voucher: %v", err)
		return
	}
	charge := av.Charge
	if p.Payload.Type == x402.BatchRefund {
		view.Balance.Set(av.Cumulative)
		charge = new(big.Int)
	}
	b.balance, b.charged = view.Balance, av.Cumulative
	settled, _ := x402.EncodeHeader(x402.BatchSettleResponse{Success: true, Network: b.req.Network, Transaction: hexutil.Encode(make([]byte, 32)),
		Extra: &x402.BatchResponseExtra{ChargedAmount: charge.String(), ChannelState: &x402.BatchChannelState{ChannelID: av.ChannelID.Hex(),
			Balance: b.balance.String(), TotalClaimed: "0", RefundNonce: "0", ChargedCumulativeAmount: b.charged.String()}}})
	w.Header().Set(x402.HeaderPaymentResponse, settled)
	fmt.Fprint(w, "the paid report")
}

func TestPayOpensABatchChannelWithinMaxAndPrintsTheChannelTheCumulativeAmountAndWhatIsLeft(t *testing.T) {
	b, srv := newBatchRoute(t)
	key, _ := crypto.GenerateKey()
	keyHex := hexutil.Encode(crypto.FromECDSA(key))

	// The offer's minDeposit (4000) is over a --max of 3999: nothing is signed.
	_, _, err := runX402(t, "", "pay", "--key", keyHex, "--max", "3999", srv.URL+"/report")
	if err == nil || !strings.Contains(err.Error(), "deposit of at least 4000") {
		t.Fatalf("pay --max 3999: %v; want a deposit of at least 4000 refused", err)
	}
	if len(b.payloads) != 0 {
		t.Fatalf("the server got %v, want nothing", b.payloads)
	}

	stdout, stderr, err := runX402(t, "", "pay", "--key", keyHex, "--max", "10000", srv.URL+"/report")
	if err != nil {
		t.Fatalf("pay: %v\n%s\n%s", err, stdout, stderr)
	}
	if !strings.Contains(stdout, "the paid report") || !strings.Contains(stderr, "cumulative 1000 charged, balance 10000, left 9000") {
		t.Errorf("pay printed\n%s\n%s\nwant the report and the channel at cumulative 1000, balance 10000, left 9000", stdout, stderr)
	}
	if strings.Contains(stdout+stderr, strings.TrimPrefix(keyHex, "0x")) {
		t.Error("pay printed the payer's key")
	}
	if got := strings.Join(b.payloads, ","); got != "deposit@1000" {
		t.Errorf("the server got %s, want deposit@1000", got)
	}

	// A new run knows the channel only through the escrow: without --rpc it cannot ask for a refund.
	_, _, err = runX402(t, "", "pay", "--key", keyHex, "--refund", srv.URL+"/report")
	if err == nil || !strings.Contains(err.Error(), "no RPC to read it from the escrow") {
		t.Errorf("pay --refund without --rpc: %v; want it to say the channel is unknown without an RPC", err)
	}
}
