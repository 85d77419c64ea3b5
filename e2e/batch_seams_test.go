package e2e

import (
	"context"
	"crypto/ecdsa"
	"fmt"
	"io"
	"math/big"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ethereum/go-ethereum"
	"github.com/ethereum/go-ethereum/common"
	"github.com/ethereum/go-ethereum/common/hexutil"
	"github.com/ethereum/go-ethereum/crypto"
	"github.com/ethereum/go-ethereum/signer/core/apitypes"

	"github.com/x402-gateway/caddy-x402/chain/chaintest"
	"github.com/x402-gateway/caddy-x402/chain/contracts"
	"github.com/x402-gateway/caddy-x402/chain/devchain"
	"github.com/x402-gateway/caddy-x402/chain/journal/pgtest"
	"github.com/x402-gateway/caddy-x402/x402"
)

// The batch-settlement route at its seams with the rest of the gate, judged on chain: real Caddy processes with a
// route of scheme batch (and the embedded facilitator's own route, where the test plays the seller's server for
// a refund), an in-process dev chain, a bbolt journal or one PostgreSQL for several gateways. The payers sign
// their deposits and vouchers here, by hand, so that each test decides what is presented where and when.

// batchSeamPrice is the batch route's price in raw units of the dev USDCoin ($0.001).
const batchSeamPrice = 1000

// batchSeamContent is the batch route's response body.
const batchSeamContent = "a response bought by a voucher"

// batchSetup is the shape of a batch world.
type batchSetup struct {
	gateways int
	postgres bool
	payers   int
	// claim is the claim policy's lines in the network's batch block.
	claim string
	// upstream, when set, is the host:port the batch route proxies to, in place of responding itself.
	upstream string
	// admin: each gateway's admin API listens on a port of its own, for reloads.
	admin bool
}

// batchWorld is the dev chain, the journal and the gateways of one test.
type batchWorld struct {
	t          *testing.T
	dir        string
	s          batchSetup
	d          *devChain
	chainURL   string
	chainID    *big.Int
	network    string
	usdc       common.Address
	receiver   common.Address
	authorizer *ecdsa.PrivateKey
	wallets    []*ecdsa.PrivateKey
	payers     []*ecdsa.PrivateKey
	journal    string // a file, or a DSN (never logged)
	env        []string
	gates      []*seamGate
}

// seamGate is one Caddy process of the world.
type seamGate struct {
	w      *batchWorld
	n      int
	name   string
	url    string
	admin  string
	file   string
	claim  string // the claim policy it runs now
	amount int64  // the batch route's price it runs now
	proc   *process
}

// startBatchWorld starts the chain, the journal and the gateways, and waits until each offers batch-settlement.
func startBatchWorld(t *testing.T, s batchSetup) *batchWorld {
	t.Helper()
	needBinary(t)
	started := time.Now()
	w := &batchWorld{t: t, dir: t.TempDir(), s: s, usdc: devchain.EIP3009TokenAddress}
	if s.postgres {
		pgtest.Need(t)
		w.journal = pgtest.Start(t).DSN()
	} else {
		w.journal = filepath.Join(w.dir, "journal.db")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	dev, err := devchain.Start(ctx, devchain.Config{Listen: "127.0.0.1:0", Wallets: 2, Payers: s.payers})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := dev.Close(); err != nil {
			t.Errorf("closing the dev chain: %v", err)
		}
	})
	w.chainURL, w.network = dev.RPCURL(), dev.Network()
	id, err := x402.ChainID(w.network)
	if err != nil {
		t.Fatal(err)
	}
	w.chainID = new(big.Int).SetUint64(id)
	w.d = dialChain(t, w.chainURL)
	w.wallets, w.payers = dev.WalletKeys(), dev.Payers()
	receiverKey, err := crypto.GenerateKey()
	if err != nil {
		t.Fatal(err)
	}
	w.receiver = crypto.PubkeyToAddress(receiverKey.PublicKey)
	if w.authorizer, err = crypto.GenerateKey(); err != nil {
		t.Fatal(err)
	}
	w.env = childEnv(t, "X402_TEST_RECEIVER_AUTHORIZER_KEY="+hexutil.Encode(crypto.FromECDSA(w.authorizer))[2:])
	for i := range s.gateways {
		g := &seamGate{w: w, n: i, name: fmt.Sprintf("gateway %d", i), url: fmt.Sprintf("http://127.0.0.1:%d", freePort(t)), claim: s.claim,
			amount: batchSeamPrice}
		if s.admin {
			g.admin = fmt.Sprintf("127.0.0.1:%d", freePort(t))
		}
		g.file = filepath.Join(w.dir, fmt.Sprintf("gateway%d.Caddyfile", i))
		w.gates = append(w.gates, g)
		g.start()
	}
	t.Logf("the batch world is up in %v: %d gateway(s) on %s", time.Since(started).Round(100*time.Millisecond), s.gateways,
		map[bool]string{true: "one PostgreSQL", false: "a bbolt journal"}[s.postgres])
	return w
}

// config is the gateway's Caddyfile with its claim policy and price.
func (g *seamGate) config() string {
	w := g.w
	var keys []string
	for _, k := range w.wallets {
		keys = append(keys, hexutil.Encode(crypto.FromECDSA(k))[2:])
	}
	serve := fmt.Sprintf("respond %q", batchSeamContent)
	if w.s.upstream != "" {
		serve = "reverse_proxy " + w.s.upstream
	}
	admin := "off"
	if g.admin != "" {
		admin = g.admin
	}
	return fmt.Sprintf(`{
	admin %s
	x402 {
		network %s {
			rpc %s
			asset %s name %q version %s decimals 6 eip3009
			wallet_keys %s
			receipt_poll 20ms
			batch {
				receiver_authorizer_key {env.X402_TEST_RECEIVER_AUTHORIZER_KEY}
				%s
			}
		}
		journal %s
	}
}

%s {
	bind 127.0.0.1
	handle_path /facilitator/* {
		x402_facilitator {
			open
		}
	}
	handle /batch {
		x402 {
			scheme batch
			amount %d
			pay_to %s
		}
		%s
	}
}
`, admin, w.network, w.chainURL, w.usdc.Hex(), contracts.USDCoinName, contracts.USDCoinVersion, strings.Join(keys, ","),
		g.claim, w.journal, g.url, g.amount, w.receiver.Hex(), serve)
}

// start starts the gateway's Caddy on its Caddyfile and waits until its /batch offers batch-settlement.
func (g *seamGate) start() {
	g.w.t.Helper()
	writeFile(g.w.t, g.w.dir, filepath.Base(g.file), g.config())
	g.proc = startProcess(g.w.t, g.name, g.w.dir, g.w.env, "run", "--adapter", "caddyfile", "--config", g.file)
	g.proc.waitUntil("a 402 offering batch-settlement", 90*time.Second, func() error {
		_, err := g.offer()
		return err
	})
}

// reload loads the gateway's Caddyfile with its claim policy and price now through its admin API, as `caddy
// reload` does.
func (g *seamGate) reload() error {
	config := g.config()
	writeFile(g.w.t, g.w.dir, filepath.Base(g.file), config)
	req, err := http.NewRequest(http.MethodPost, "http://"+g.admin+"/load", strings.NewReader(config))
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", "text/caddyfile")
	resp, err := httpClient.Do(req)
	if err != nil {
		return fmt.Errorf("reloading %s: %w", g.name, err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("reloading %s: %d %s", g.name, resp.StatusCode, shorten(string(body)))
	}
	return nil
}

// offer is the batch-settlement requirement of the gateway's /batch 402.
func (g *seamGate) offer() (x402.BatchRequirements, error) {
	a, err := get(g.url + "/batch")
	if err != nil {
		return x402.BatchRequirements{}, err
	}
	pr, err := x402.DecodePaymentRequired(a.header.Get(x402.HeaderPaymentRequired))
	if a.status != http.StatusPaymentRequired || err != nil {
		return x402.BatchRequirements{}, fmt.Errorf("unpaid GET /batch: %d (%v)", a.status, err)
	}
	for _, rq := range pr.Accepts {
		if rq.Scheme == x402.SchemeBatchSettlement {
			return x402.BatchRequirements{Scheme: rq.Scheme, Network: rq.Network, Amount: rq.Amount, Asset: rq.Asset, PayTo: rq.PayTo,
				MaxTimeoutSeconds: rq.MaxTimeoutSeconds, Extra: x402.BatchExtra{ReceiverAuthorizer: rq.Extra.ReceiverAuthorizer,
					WithdrawDelay: rq.Extra.WithdrawDelay, Name: rq.Extra.Name, Version: rq.Extra.Version, AssetTransferMethod: rq.Extra.AssetTransferMethod}}, nil
		}
	}
	return x402.BatchRequirements{}, fmt.Errorf("the 402 offers no batch-settlement yet: %+v", pr.Accepts)
}

// batchChannel is one payer's channel to the world's receiver, its deposits and vouchers signed by the test.
type batchChannel struct {
	w   *batchWorld
	key *ecdsa.PrivateKey
	rq  x402.BatchRequirements
	cfg contracts.ChannelConfig
	id  common.Hash
}

// channel opens (on paper: nothing is sent) a channel of payer key under the offer of gateway 0.
func (w *batchWorld) channel(key *ecdsa.PrivateKey) *batchChannel {
	w.t.Helper()
	rq, err := w.gates[0].offer()
	if err != nil {
		w.t.Fatal(err)
	}
	payer := crypto.PubkeyToAddress(key.PublicKey)
	c := &batchChannel{w: w, key: key, rq: rq, cfg: contracts.ChannelConfig{Payer: payer, PayerAuthorizer: payer,
		Receiver: common.HexToAddress(rq.PayTo), ReceiverAuthorizer: common.HexToAddress(rq.Extra.ReceiverAuthorizer),
		Token: common.HexToAddress(rq.Asset), WithdrawDelay: uint64(rq.Extra.WithdrawDelay), Salt: common.BigToHash(chaintest.RandomNonce())}}
	c.id = chaintest.ChannelID(w.chainID, c.cfg)
	return c
}

// signTyped signs typed data with key as an EOA does (v 27 or 28).
func signTyped(t *testing.T, key *ecdsa.PrivateKey, td apitypes.TypedData) []byte {
	t.Helper()
	hash, _, err := apitypes.TypedDataAndHash(td)
	if err != nil {
		t.Fatalf("hashing %s typed data: %v", td.PrimaryType, err)
	}
	sig, err := crypto.Sign(hash, key)
	if err != nil {
		t.Fatal(err)
	}
	sig[64] += 27
	return sig
}

// payment is the channel's voucher for cumulative, signed by signer (the payer when nil), as a payment.
func (c *batchChannel) payment(cumulative int64, signer *ecdsa.PrivateKey) x402.BatchPayment {
	if signer == nil {
		signer = c.key
	}
	sig := signTyped(c.w.t, signer, chaintest.VoucherTypedData(c.w.chainID, c.id, big.NewInt(cumulative)))
	wire := &x402.ChannelConfig{Payer: c.cfg.Payer.Hex(), PayerAuthorizer: c.cfg.PayerAuthorizer.Hex(), Receiver: c.cfg.Receiver.Hex(),
		ReceiverAuthorizer: c.cfg.ReceiverAuthorizer.Hex(), Token: c.cfg.Token.Hex(), WithdrawDelay: int64(c.cfg.WithdrawDelay),
		Salt: hexutil.Encode(c.cfg.Salt[:])}
	return x402.BatchPayment{X402Version: x402.Version2, Accepted: c.rq, Payload: x402.BatchPayload{Type: x402.BatchVoucher, ChannelConfig: wire,
		Voucher: &x402.BatchVoucherFields{ChannelID: c.id.Hex(), MaxClaimableAmount: fmt.Sprint(cumulative), Signature: hexutil.Encode(sig)}}}
}

// header is p as a PAYMENT-SIGNATURE value.
func (c *batchChannel) header(p x402.BatchPayment) string {
	c.w.t.Helper()
	h, err := x402.EncodeHeader(p)
	if err != nil {
		c.w.t.Fatal(err)
	}
	return h
}

// voucher is the PAYMENT-SIGNATURE of the channel's voucher for cumulative.
func (c *batchChannel) voucher(cumulative int64) string { return c.header(c.payment(cumulative, nil)) }

// deposit is the PAYMENT-SIGNATURE of a deposit of amount (ERC-3009) with the voucher for cumulative.
func (c *batchChannel) deposit(amount, cumulative int64) string {
	t := c.w.t
	t.Helper()
	salt := common.BigToHash(chaintest.RandomNonce())
	// Valid for half the offer's maxTimeoutSeconds from the chain's head, as a client signs.
	validBefore := new(big.Int).SetUint64(uint64(c.w.chainTime().Unix()) + uint64(c.rq.MaxTimeoutSeconds/2))
	nonce := contracts.ERC3009DepositNonce(c.id, salt)
	sig := signTyped(t, c.key, chaintest.ReceiveAuthorizationTypedData(contracts.USDCoinName, contracts.USDCoinVersion, c.w.chainID,
		c.cfg.Token, c.cfg.Payer, big.NewInt(amount), big.NewInt(0), validBefore, nonce))
	p := c.payment(cumulative, nil)
	p.Payload.Type = x402.BatchDeposit
	p.Payload.Deposit = &x402.BatchDepositFields{Amount: fmt.Sprint(amount), Authorization: x402.BatchDepositAuthorization{
		ERC3009Authorization: &x402.BatchERC3009Authorization{ValidAfter: "0", ValidBefore: validBefore.String(), Salt: salt.Hex(), Signature: hexutil.Encode(sig)}}}
	return c.header(p)
}

// onChain is the channel's balance and total claimed in the escrow.
func (c *batchChannel) onChain() (balance, claimed int64) {
	t := c.w.t
	t.Helper()
	data, err := contracts.PackBatchSettlement("channels", c.id)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := rpcContext()
	defer cancel()
	to := contracts.BatchSettlementAddress
	raw, err := c.w.d.client.CallContract(ctx, ethereum.CallMsg{To: &to, Data: data}, nil)
	if err != nil {
		t.Fatalf("reading channel %s: %v", c.id.Hex(), err)
	}
	out, err := contracts.BatchSettlementABI.Unpack("channels", raw)
	if err != nil {
		t.Fatal(err)
	}
	return out[0].(*big.Int).Int64(), out[1].(*big.Int).Int64()
}

// refund is the payer's refund of all that is left, presented at gateway gate's batch route: a payment whose
// voucher stands at the channel's last accepted cumulative amount. It returns the answer and, when there is one,
// the refund's settlement from PAYMENT-RESPONSE.
func (c *batchChannel) refund(gate int, cumulative int64) (batchAnswer, x402.BatchSettleResponse) {
	return c.refundAt(c.w.gates[gate].url+"/batch", cumulative)
}

// refundAt is refund presented at url.
func (c *batchChannel) refundAt(url string, cumulative int64) (batchAnswer, x402.BatchSettleResponse) {
	p := c.payment(cumulative, nil)
	p.Payload.Type = x402.BatchRefund
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		c.w.t.Fatal(err)
	}
	req.Header.Set(x402.HeaderPaymentSignature, c.header(p))
	resp, err := batchClient.Do(req)
	if err != nil {
		return batchAnswer{err: err}, x402.BatchSettleResponse{}
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	a := batchAnswer{status: resp.StatusCode, body: string(body), err: err}
	s, _ := x402.DecodeBatchSettleResponse(resp.Header.Get(x402.HeaderPaymentResponse))
	return a, s
}

// refundAll is refund, which must return exactly left to the payer.
func (c *batchChannel) refundAll(gate int, cumulative, left int64) {
	c.w.t.Helper()
	a, s := c.refund(gate, cumulative)
	if a.err != nil || a.status != http.StatusOK || !s.Success || s.Amount != fmt.Sprint(left) {
		c.w.t.Fatalf("channel %s's refund of the rest through gateway %d: %s, settlement %+v; want 200 and %d refunded", c.id.Hex()[:10], gate, a, s, left)
	}
}

// chainTime is the time of the chain's head block.
func (w *batchWorld) chainTime() time.Time {
	ctx, cancel := rpcContext()
	defer cancel()
	h, err := w.d.client.HeaderByNumber(ctx, nil)
	if err != nil {
		w.t.Fatalf("reading the head: %v", err)
	}
	return time.Unix(int64(h.Time), 0)
}

// batchAnswer is what a presentation of a batch payment got.
type batchAnswer struct {
	status     int
	body       string
	cumulative string // the channel's cumulative amount PAYMENT-RESPONSE names, "" without one
	err        error
}

// delivered reports whether the answer is the response, whole, with its cumulative amount.
func (a batchAnswer) delivered(cumulative int64) bool {
	return a.err == nil && a.status == http.StatusOK && a.body == batchSeamContent && a.cumulative == fmt.Sprint(cumulative)
}

// refused reports whether the answer is a 402 naming reason.
func (a batchAnswer) refused(reason string) bool {
	return a.err == nil && a.status == http.StatusPaymentRequired && strings.Contains(a.body, reason)
}

func (a batchAnswer) String() string {
	if a.err != nil {
		return "no answer: " + shorten(a.err.Error())
	}
	return fmt.Sprintf("%d %s (cumulative %q)", a.status, shorten(a.body), a.cumulative)
}

// batchClient is the clients' HTTP client: no connection kept, so that a restarted gateway is reached afresh.
var batchClient = &http.Client{Timeout: time.Minute, Transport: &http.Transport{DisableKeepAlives: true}}

// present sends payment value to gateway gate's /batch.
func (w *batchWorld) present(ctx context.Context, gate int, value string) batchAnswer {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, w.gates[gate].url+"/batch", nil)
	if err != nil {
		return batchAnswer{err: err}
	}
	req.Header.Set(x402.HeaderPaymentSignature, value)
	resp, err := batchClient.Do(req)
	if err != nil {
		return batchAnswer{err: err}
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	a := batchAnswer{status: resp.StatusCode, body: string(body), err: err}
	if h := resp.Header.Get(x402.HeaderPaymentResponse); h != "" {
		if s, err := x402.DecodeBatchSettleResponse(h); err == nil && s.Extra != nil && s.Extra.ChannelState != nil {
			a.cumulative = s.Extra.ChannelState.ChargedCumulativeAmount
		}
	}
	return a
}

// presentAnswered is present until there is an answer (a connection the reload's old server closed is none),
// at most for 10 s.
func (w *batchWorld) presentAnswered(ctx context.Context, gate int, value string) batchAnswer {
	deadline := time.Now().Add(10 * time.Second)
	for {
		a := w.present(ctx, gate, value)
		if a.err == nil || time.Now().After(deadline) {
			return a
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// sent is how many transactions the gateways' settlement wallets have sent.
func (w *batchWorld) sent() uint64 {
	var n uint64
	for _, k := range w.wallets {
		n += sentFrom(w.t, w.d, crypto.PubkeyToAddress(k.PublicKey))
	}
	return n
}

// waitClaimed waits until each channel's total claimed on chain is what want says, and fails the test past timeout.
func (w *batchWorld) waitClaimed(timeout time.Duration, want map[*batchChannel]int64) {
	w.t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		var off []string
		for c, n := range want {
			if _, claimed := c.onChain(); claimed != n {
				off = append(off, fmt.Sprintf("channel %s claimed %d, want %d", c.id.Hex()[:10], claimed, n))
			}
		}
		if len(off) == 0 {
			return
		}
		if time.Now().After(deadline) {
			w.t.Fatalf("after %v: %s", timeout, strings.Join(off, "; "))
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// balances reads the token balances the tests judge: each payer's, the receiver's and the escrow's.
func (w *batchWorld) balances() map[common.Address]int64 {
	out := map[common.Address]int64{}
	holders := []common.Address{w.receiver, contracts.BatchSettlementAddress}
	for _, k := range w.payers {
		holders = append(holders, crypto.PubkeyToAddress(k.PublicKey))
	}
	for _, h := range holders {
		out[h] = w.d.balanceOf(w.usdc, h).Int64()
	}
	return out
}

// TestABatchVoucherAcceptedBeforeASIGKILLIsServedOnceAfterTheRestartAndClaimedOnce: a voucher accepted (durably,
// before its upstream runs) and then its gateway SIGKILLed while the upstream holds its response: nothing was
// delivered. Presented again after the restart (with the same price, or another one the restarted config names),
// it gets the response at the same cumulative amount (charged once), and a third time it is refused as used; the
// channel carries on from it at the price now. The claimer (claim_after 1s) claims exactly what was served, and
// the payer's refund returns exactly the rest. About 2 s each: two Caddy starts.
func TestABatchVoucherAcceptedBeforeASIGKILLIsServedOnceAfterTheRestartAndClaimedOnce(t *testing.T) {
	for _, tc := range []struct {
		name  string
		after int64 // the price the restarted gateway runs
	}{{"the same price", batchSeamPrice}, {"another price", 2 * batchSeamPrice}} {
		t.Run(tc.name, func(t *testing.T) { acceptThenSIGKILL(t, tc.after) })
	}
}

func acceptThenSIGKILL(t *testing.T, after int64) {
	var holding atomic.Bool
	arrived := make(chan struct{}, 4)
	up := httptest.NewServer(http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		if holding.Load() {
			arrived <- struct{}{}
			<-r.Context().Done() // until the gateway is gone
			return
		}
		io.WriteString(rw, batchSeamContent)
	}))
	t.Cleanup(up.Close)
	w := startBatchWorld(t, batchSetup{gateways: 1, payers: 1, claim: "claim_every 1000\n\t\t\t\tclaim_after 1s",
		upstream: strings.TrimPrefix(up.URL, "http://")})
	before := w.balances()
	c := w.channel(w.payers[0])
	ctx := context.Background()
	const deposit = 10 * batchSeamPrice
	if a := w.present(ctx, 0, c.deposit(deposit, batchSeamPrice)); !a.delivered(batchSeamPrice) {
		t.Fatalf("the deposit with the first voucher: %s; want the response at %d", a, batchSeamPrice)
	}

	holding.Store(true)
	second := c.voucher(2 * batchSeamPrice)
	cut := make(chan batchAnswer, 1)
	go func() { cut <- w.present(ctx, 0, second) }()
	select {
	case <-arrived:
	case a := <-cut:
		t.Fatalf("the second voucher was answered %s before its upstream was reached", a)
	case <-time.After(30 * time.Second):
		t.Fatal("the second voucher's request never reached the upstream")
	}
	w.gates[0].proc.kill()
	if a := <-cut; a.status == http.StatusOK {
		t.Fatalf("the voucher whose gateway was SIGKILLed got %s", a)
	}
	holding.Store(false)
	w.gates[0].amount = after
	w.gates[0].start()

	if a := w.present(ctx, 0, second); !a.delivered(2 * batchSeamPrice) {
		t.Fatalf("the accepted voucher presented again after the restart (price %d): %s; want its response at %d, charged once", after, a, 2*batchSeamPrice)
	}
	if a := w.present(ctx, 0, second); !a.refused(x402.ReasonPaymentAlreadyUsed) {
		t.Fatalf("the voucher presented a third time: %s; want 402 %s", a, x402.ReasonPaymentAlreadyUsed)
	}
	rq, err := w.gates[0].offer()
	if err != nil {
		t.Fatal(err)
	}
	c.rq = rq
	last := 2*batchSeamPrice + after
	if a := w.present(ctx, 0, c.voucher(last)); !a.delivered(last) {
		t.Fatalf("the next voucher: %s; want its response at %d", a, last)
	}
	w.waitClaimed(30*time.Second, map[*batchChannel]int64{c: last})
	c.refundAll(0, last, deposit-last)
	w.checkPaid(before, map[*batchChannel]int64{c: last})
}

// checkPaid waits for the refunds to land and checks the balances against what each channel served: each payer
// paid exactly its channel's, the receiver got their sum, and the escrow holds what it held before.
func (w *batchWorld) checkPaid(before map[common.Address]int64, served map[*batchChannel]int64) {
	w.t.Helper()
	want := map[common.Address]int64{}
	for a, b := range before {
		want[a] = b
	}
	for c, n := range served {
		want[c.cfg.Payer] -= n
		want[w.receiver] += n
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		got := w.balances()
		var off []string
		for a, b := range want {
			if got[a] != b {
				off = append(off, fmt.Sprintf("%s holds %d, want %d (%+d since the start)", a.Hex()[:10], got[a], b, got[a]-before[a]))
			}
		}
		if len(off) == 0 {
			return
		}
		if time.Now().After(deadline) {
			w.t.Fatalf("the balances after the refunds: %s", strings.Join(off, "; "))
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// TestTwoGatewaysOnOnePostgresJournalRefuseBatchVouchersBeyondTheDepositAndTheAdversarialTable: two gateways on
// one PostgreSQL journal, one channel of deposit 6 prices. Every voucher a dishonest payer can sign is refused at
// either gateway with the SDK's reason and nothing served: below the last cumulative amount, skipping ahead,
// above the deposit, naming another channel than its config, a channel to another receiver or receiver
// authorizer, a channel with no deposit, signed by another key. The same voucher presented at both gateways at
// once is served once, and so is the deposit presented again at the other gateway; the channel is then paid to
// 5 prices, alternating gateways, and a voucher past the deposit is refused at both at once. The payer's refund
// at one gateway returns exactly the rest; replayed at either, it sends nothing more, and a voucher within the
// old deposit is refused after it. The seller is paid exactly what was served, never more than the deposit, and
// the escrow holds what it held. About 5 s.
func TestTwoGatewaysOnOnePostgresJournalRefuseBatchVouchersBeyondTheDepositAndTheAdversarialTable(t *testing.T) {
	w := startBatchWorld(t, batchSetup{gateways: 2, postgres: true, payers: 2, claim: "claim_every 1000\n\t\t\t\tclaim_after 1s"})
	before := w.balances()
	c := w.channel(w.payers[0])
	ctx := context.Background()
	const deposit, paid = 6 * batchSeamPrice, 5 * batchSeamPrice
	first := c.deposit(deposit, batchSeamPrice)
	if a := w.present(ctx, 0, first); !a.delivered(batchSeamPrice) {
		t.Fatalf("the deposit with the first voucher: %s; want the response at %d", a, batchSeamPrice)
	}
	if a := w.present(ctx, 1, first); !a.refused(x402.ReasonPaymentAlreadyUsed) {
		t.Fatalf("the deposit presented again at the other gateway: %s; want 402 %s and no second deposit", a, x402.ReasonPaymentAlreadyUsed)
	}

	other := func(edit func(*contracts.ChannelConfig)) *batchChannel {
		o := *c
		edit(&o.cfg)
		o.id = chaintest.ChannelID(w.chainID, o.cfg)
		return &o
	}
	stranger, err := crypto.GenerateKey()
	if err != nil {
		t.Fatal(err)
	}
	undeposited := other(func(cfg *contracts.ChannelConfig) { cfg.Salt = common.BigToHash(chaintest.RandomNonce()) })
	misnamed := c.payment(2*batchSeamPrice, nil)
	misnamed.Payload.Voucher.ChannelID = undeposited.id.Hex()
	for _, row := range []struct {
		name, value, reason string
		or                  string // another reason as right, when the timing decides
	}{
		// Below the first voucher, once the 1 s claim of it landed, is below what the chain holds claimed.
		{"below the last cumulative amount", c.voucher(batchSeamPrice / 2), x402.ReasonBatchCumulativeAmountMismatch, x402.ReasonBatchCumulativeBelowClaimed},
		{"skipping a price ahead", c.voucher(3 * batchSeamPrice), x402.ReasonBatchCumulativeAmountMismatch, ""},
		{"above the deposit", c.voucher(deposit + batchSeamPrice), x402.ReasonBatchCumulativeExceedsBalance, ""},
		{"naming another channel than its config", c.header(misnamed), x402.ReasonBatchChannelIDMismatch, ""},
		{"for a channel to another receiver", other(func(cfg *contracts.ChannelConfig) { cfg.Receiver = seller }).voucher(2 * batchSeamPrice), x402.ReasonBatchReceiverMismatch, ""},
		{"for a channel to another receiver authorizer", other(func(cfg *contracts.ChannelConfig) { cfg.ReceiverAuthorizer = seller }).voucher(2 * batchSeamPrice), x402.ReasonBatchReceiverAuthorizerMismatch, ""},
		{"for a channel with no deposit", undeposited.voucher(batchSeamPrice), x402.ReasonBatchChannelNotFound, ""},
		{"signed by another key", c.header(c.payment(2*batchSeamPrice, stranger)), x402.ReasonBatchInvalidVoucherSignature, ""},
	} {
		for gate := range w.gates {
			a := w.present(ctx, gate, row.value)
			if refused := a.refused(row.reason) || (row.or != "" && a.refused(row.or)); !refused || strings.Contains(a.body, batchSeamContent) {
				t.Errorf("a voucher %s at gateway %d: %s; want 402 %s and nothing served", row.name, gate, a, row.reason)
			}
		}
	}

	// The same voucher at both gateways at once buys one response.
	presentAtOnce := func(value string) []batchAnswer {
		answers := make([]batchAnswer, 4)
		var wg sync.WaitGroup
		for i := range answers {
			wg.Add(1)
			go func() {
				defer wg.Done()
				answers[i] = w.present(ctx, i%len(w.gates), value)
			}()
		}
		wg.Wait()
		return answers
	}
	served := 0
	second := presentAtOnce(c.voucher(2 * batchSeamPrice))
	for _, a := range second {
		switch {
		case a.delivered(2 * batchSeamPrice):
			served++
		case !a.refused(x402.ReasonPaymentAlreadyUsed):
			t.Errorf("the second voucher presented four times at once at two gateways: one answered %s; want its response or 402 %s", a, x402.ReasonPaymentAlreadyUsed)
		}
	}
	if served != 1 {
		t.Fatalf("the second voucher presented four times at once at two gateways was served %d times, want once: %v", served, second)
	}
	for k := int64(3); k <= paid/batchSeamPrice; k++ {
		if a := w.present(ctx, int(k%2), c.voucher(k*batchSeamPrice)); !a.delivered(k * batchSeamPrice) {
			t.Fatalf("voucher %d at gateway %d: %s; want its response", k, k%2, a)
		}
	}
	// Past the deposit, at both gateways at once: each refused, by the engine for the deposit, or (while another
	// request presents it) by the gate's in-flight mark, which tells the client to wait for that answer.
	exceeds := 0
	for _, a := range presentAtOnce(c.voucher(deposit + batchSeamPrice)) {
		switch {
		case a.refused(x402.ReasonBatchCumulativeExceedsBalance):
			exceeds++
		case !a.refused(x402.ReasonPaymentAlreadyUsed) || !strings.Contains(a.body, "presenting this voucher right now"):
			t.Errorf("the voucher past the deposit, at both gateways at once: %s; want 402 %s (or another request is presenting it)", a, x402.ReasonBatchCumulativeExceedsBalance)
		}
	}
	if exceeds == 0 {
		t.Errorf("the voucher past the deposit, at both gateways at once, was never refused with %s", x402.ReasonBatchCumulativeExceedsBalance)
	}

	// The payer asks for the rest at gateway 1 while its next voucher is presented at gateway 0, again and again
	// while the answer is "channel busy": the refund's mark on the channel's row closes the channel to vouchers at
	// both gateways before the refund leaves. So the voucher is either accepted before the mark (then the refund,
	// naming the voucher before it, is refused, and nothing is left to refund), or refused until the refund is done
	// and then refused as above what the refund left: never served on money the refund hands back to the payer.
	total := int64(paid)
	refunded := make(chan [2]any, 1)
	go func() {
		a, s := c.refund(1, paid)
		refunded <- [2]any{a, s}
	}()
	var next batchAnswer
	for range 2000 {
		if next = w.present(ctx, 0, c.voucher(paid+batchSeamPrice)); !next.refused(x402.ReasonBatchChannelBusy) {
			break
		}
	}
	got := <-refunded
	ra, rs := got[0].(batchAnswer), got[1].(x402.BatchSettleResponse)
	switch {
	case next.delivered(paid + batchSeamPrice):
		total = paid + batchSeamPrice
		if ra.status != http.StatusPaymentRequired || rs.Success {
			t.Fatalf("the refund at gateway 1 of a channel whose next voucher gateway 0 served first: %s %+v; want 402, nothing left to refund", ra, rs)
		}
		t.Logf("the voucher at gateway 0 was accepted before the refund at gateway 1 marked the channel")
	case next.refused(x402.ReasonBatchCumulativeExceedsBalance) || next.refused(x402.ReasonBatchChannelNotFound):
		if ra.status != http.StatusOK || !rs.Success || rs.Amount != fmt.Sprint(deposit-paid) {
			t.Fatalf("the refund of the rest at gateway 1: %s, settlement %+v; want 200 and %d refunded", ra, rs, deposit-paid)
		}
	default:
		t.Fatalf("the next voucher at gateway 0 while gateway 1 refunded the channel: %s; want its response, or 402 %s", next, x402.ReasonBatchCumulativeExceedsBalance)
	}
	// The claimer's claims and the refund settle the channel, and the refund presented again, at either gateway, is
	// answered from its record and sends nothing more.
	w.waitClaimed(30*time.Second, map[*batchChannel]int64{c: total})
	sent := w.sent()
	for gate := range w.gates {
		a, s := c.refund(gate, paid)
		if a.err != nil || s.Amount == fmt.Sprint(2*(deposit-paid)) {
			t.Errorf("the refund replayed at gateway %d: %s %+v", gate, a, s)
		}
	}
	if a := w.present(ctx, 0, c.voucher(paid+batchSeamPrice)); a.status != http.StatusPaymentRequired || strings.Contains(a.body, batchSeamContent) {
		t.Errorf("a voucher within the deposit, after the refund of the rest: %s; want 402 and nothing served", a)
	}
	if got := w.sent(); got != sent {
		t.Errorf("the replayed refunds and the voucher after them sent %d transactions; want none", got-sent)
	}
	w.checkPaid(before, map[*batchChannel]int64{c: total})
}

// batchDrillSeedEnv replays the batch drill's fault points; the seed is logged at the start.
const batchDrillSeedEnv = "X402_BATCH_DRILL_SEED"

// batchDrillPolicies are the claim policies the batch drill reloads between: each due within a few seconds, by a
// count, an amount or an age, so that claims are sent while the load runs and the faults land among them.
var batchDrillPolicies = []string{
	"claim_every 5\n\t\t\t\tclaim_after 2s",
	"claim_amount 3000\n\t\t\t\tclaim_after 1s",
	"claim_every 2\n\t\t\t\tclaim_after 3s",
}

// batchDrillWorker is one paying client of the batch drill: its own channel, paid voucher after voucher.
type batchDrillWorker struct {
	c          *batchChannel
	served     int64 // the vouchers whose response it got: its channel's cumulative amount in prices
	presented  int
	violations []string
}

// TestBatchVouchersThroughSIGKILLsAndClaimPolicyReloadsAreEachClaimedOnceAndTheRefundReturnsTheRest is the crash
// drill of a batch route: four clients pay it by voucher, each on its own channel (a deposit of 100,000 prices with
// the first voucher), while the gateway is SIGKILLed three times at random moments and restarted on the same
// journal, and reloaded twice in between with another claim policy (the old and the new engine both claimers on
// one journal for a moment), claims being sent throughout. A client presents each voucher until its answer is
// final: the response (then the next voucher), or a refusal, which is a violation here: no voucher of these
// honest clients may be refused, and none refused as used unless its response was delivered. In the end every
// channel is claimed exactly the vouchers whose response was delivered, the last of them presented again is
// refused as used, and the payer's refund returns exactly the rest: each payer paid what it was served, the
// receiver got the sum, the escrow holds what it held. $X402_BATCH_DRILL_SEED replays the fault points. About 15 s.
func TestBatchVouchersThroughSIGKILLsAndClaimPolicyReloadsAreEachClaimedOnceAndTheRefundReturnsTheRest(t *testing.T) {
	seed := seedFromEnv(t, batchDrillSeedEnv, "kill and reload points")
	rng := rand.New(rand.NewPCG(seed, seed))
	const workers, deposit = 4, 100_000 * batchSeamPrice
	w := startBatchWorld(t, batchSetup{gateways: 1, payers: workers, admin: true, claim: batchDrillPolicies[0]})
	before := w.balances()
	ws := make([]*batchDrillWorker, workers)
	for i := range ws {
		ws[i] = &batchDrillWorker{c: w.channel(w.payers[i])}
	}

	stop := make(chan struct{})
	var wg sync.WaitGroup
	for _, dw := range ws {
		wg.Add(1)
		go func() {
			defer wg.Done()
			w.drillWorker(dw, deposit, stop)
		}()
	}
	kills, reloads := 0, 0
	for i := range 5 {
		time.Sleep(time.Duration(300+rng.IntN(1200)) * time.Millisecond)
		g := w.gates[0]
		if i%2 == 0 {
			g.proc.kill()
			time.Sleep(time.Duration(rng.IntN(500)) * time.Millisecond)
			g.start()
			kills++
			continue
		}
		g.claim = batchDrillPolicies[(i/2+1)%len(batchDrillPolicies)]
		if err := g.reload(); err != nil {
			t.Fatal(err)
		}
		reloads++
	}
	time.Sleep(time.Duration(300+rng.IntN(700)) * time.Millisecond)
	close(stop)
	wg.Wait()

	served := map[*batchChannel]int64{}
	total, counts := 0, []int64{}
	for _, dw := range ws {
		counts = append(counts, dw.served)
		for _, v := range dw.violations {
			t.Errorf("channel %s: %s", dw.c.id.Hex()[:10], v)
		}
		served[dw.c] = dw.served * batchSeamPrice
		total += dw.presented
		if dw.served == 0 {
			t.Errorf("channel %s was served nothing: the drill drove no load", dw.c.id.Hex()[:10])
		}
	}
	if t.Failed() {
		t.FailNow()
	}
	t.Logf("%d kills, %d reloads of the claim policy; %d presentations, of which %d again after no final answer; vouchers served per channel: %v",
		kills, reloads, total, total-int(batchSum(counts)), counts)
	w.waitClaimed(60*time.Second, served)
	ctx := context.Background()
	for _, dw := range ws {
		if a := w.present(ctx, 0, dw.c.voucher(dw.served*batchSeamPrice)); !a.refused(x402.ReasonPaymentAlreadyUsed) {
			t.Errorf("channel %s's last voucher presented again: %s; want 402 %s", dw.c.id.Hex()[:10], a, x402.ReasonPaymentAlreadyUsed)
		}
		dw.c.refundAll(0, dw.served*batchSeamPrice, deposit-dw.served*batchSeamPrice)
	}
	w.checkPaid(before, served)
}

// drillWorker pays its channel voucher after voucher until stop closes, each presented until its answer is
// final, and notes what it was served and what no honest client may be answered.
func (w *batchWorld) drillWorker(dw *batchDrillWorker, deposit int64, stop <-chan struct{}) {
	ctx := context.Background()
	for k := int64(1); ; k++ {
		select {
		case <-stop:
			return
		default:
		}
		value := dw.c.voucher(k * batchSeamPrice)
		if k == 1 {
			value = dw.c.deposit(deposit, batchSeamPrice)
		}
		giveUp := time.Now().Add(2 * time.Minute)
		for {
			a := w.present(ctx, 0, value)
			dw.presented++
			if a.delivered(k * batchSeamPrice) {
				dw.served = k
				break
			}
			// No answer (the gateway is down, or went down while answering), a 5xx, or another request of
			// ours still presenting it in a gateway that died: not final; presented again.
			retry := a.err != nil || a.status >= 500 ||
				(a.refused(x402.ReasonPaymentAlreadyUsed) && strings.Contains(a.body, "presenting this voucher right now"))
			if !retry {
				dw.violations = append(dw.violations, fmt.Sprintf("voucher %d (cumulative %d) answered %s; its response was never delivered", k, k*batchSeamPrice, a))
				return
			}
			if time.Now().After(giveUp) {
				dw.violations = append(dw.violations, fmt.Sprintf("voucher %d had no final answer in 2 minutes: last %s", k, a))
				return
			}
			time.Sleep(100 * time.Millisecond)
		}
	}
}

// batchSum is the sum of xs.
func batchSum(xs []int64) int64 {
	var n int64
	for _, x := range xs {
		n += x
	}
	return n
}

// TestABatchVoucherAcceptedBeforeAReloadThatChangesThePriceIsServedWhenPresentedAgain: a voucher accepted (charged)
// whose upstream failed, so that nothing was delivered, then a reload that changes the route's price. Presented
// again for its response, the voucher is judged by what it was accepted under, as any payment presented again
// is: served at its cumulative amount, charged once, not refused for the new price while the claimer claims it.
// The channel then carries on at the new price. About 3 s.
func TestABatchVoucherAcceptedBeforeAReloadThatChangesThePriceIsServedWhenPresentedAgain(t *testing.T) {
	var failing atomic.Bool
	up := httptest.NewServer(http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		if failing.Load() {
			http.Error(rw, "the report is not ready", http.StatusInternalServerError)
			return
		}
		io.WriteString(rw, batchSeamContent)
	}))
	t.Cleanup(up.Close)
	w := startBatchWorld(t, batchSetup{gateways: 1, payers: 1, admin: true, claim: "claim_every 1000\n\t\t\t\tclaim_after 1s",
		upstream: strings.TrimPrefix(up.URL, "http://")})
	before := w.balances()
	c := w.channel(w.payers[0])
	ctx := context.Background()
	const deposit = 10 * batchSeamPrice
	if a := w.present(ctx, 0, c.deposit(deposit, batchSeamPrice)); !a.delivered(batchSeamPrice) {
		t.Fatalf("the deposit with the first voucher: %s; want the response at %d", a, batchSeamPrice)
	}
	failing.Store(true)
	second := c.voucher(2 * batchSeamPrice)
	if a := w.present(ctx, 0, second); a.status != http.StatusInternalServerError {
		t.Fatalf("the second voucher while the upstream fails: %s; want the upstream's 500", a)
	}
	failing.Store(false)
	g := w.gates[0]
	g.amount = 2 * batchSeamPrice
	if err := g.reload(); err != nil {
		t.Fatal(err)
	}
	if a := w.presentAnswered(ctx, 0, second); !a.delivered(2 * batchSeamPrice) {
		t.Fatalf("the accepted voucher presented again after a reload that changed the price: %s; want its response at %d, charged once", a, 2*batchSeamPrice)
	}
	if a := w.present(ctx, 0, second); !a.refused(x402.ReasonPaymentAlreadyUsed) {
		t.Fatalf("the voucher presented a third time: %s; want 402 %s", a, x402.ReasonPaymentAlreadyUsed)
	}
	// The channel carries on at the new price, under the new offer.
	rq, err := g.offer()
	if err != nil {
		t.Fatal(err)
	}
	c.rq = rq
	const last = 4 * batchSeamPrice
	if a := w.present(ctx, 0, c.voucher(last)); !a.delivered(last) {
		t.Fatalf("the next voucher at the new price: %s; want its response at %d", a, last)
	}
	w.waitClaimed(30*time.Second, map[*batchChannel]int64{c: last})
	c.refundAll(0, last, deposit-last)
	w.checkPaid(before, map[*batchChannel]int64{c: last})
}
