package caddymodule_test

import (
	"cmp"
	"fmt"
	"math/big"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/ethereum/go-ethereum/common"

	"github.com/x402-gateway/caddy-x402/chain/chaintest"
	"github.com/x402-gateway/caddy-x402/x402"
)

// A payer charged for a response it did not receive whole gets it by presenting the same payment again, for the
// resource it was first presented for, whatever a reload did to the route's terms since: the payment is judged by
// its journal record (the terms it was accepted under, the payload byte for byte), not by today's offers. It still
// buys nothing elsewhere, and a payment never journalled gets no help from the records of others.

// otherSeller is the recipient a reload names in place of the test's seller.
var otherSeller = common.HexToAddress("0x0da7a5e11e70da7a5e11e70da7a5e11e70da7a5e")

// termsSetup is one configuration of a reload test's gate: its terms and how it settles.
type termsSetup struct {
	settle string // the settle mode; "" for the default (after)
	amount int64  // the price in raw units
	payTo  string // the recipient
	grace  string // price_grace; "" for none
	h2c    bool   // the site speaks HTTP/2 without TLS beside HTTP/1.1
}

// termsCaddyfile is a Caddy whose gate sells the files of root (/big.bin, larger than max_buffer, and /small.txt)
// on the terms of s, with its journal in a bbolt file and its log in caddy.log.
func (env *gateEnv) termsCaddyfile(root string, s termsSetup) string {
	var keys []string
	for _, w := range env.c.Wallets[:2] {
		keys = append(keys, hexKey(w))
	}
	var servers, lines string
	if s.h2c {
		servers = "\tservers {\n\t\tprotocols h1 h2c\n\t}\n"
	}
	if s.settle != "" {
		lines += "\t\tsettle " + s.settle + "\n"
	}
	if s.grace != "" {
		lines += "\t\tprice_grace " + s.grace + "\n"
	}
	return fmt.Sprintf(`{
	log {
		output file {{DATA}}/caddy.log
		format json
		level INFO
	}
%s	x402 {
		network %s {
			rpc %s
			asset %s name "Stable Coin" version 1 decimals 6
			wallet_keys %s
			receipt_poll 2ms
		}
		journal {{DATA}}/journal.db
	}
}

{{ADDR}} {
	x402 {
		pay_to %s
		amount %d
		asset %s
		network %s
		max_buffer 1MiB
		description "the files"
%s	}
	root * %s
	file_server
}
`, servers, env.net, env.c.RPCURL, env.c.Token.Hex(), strings.Join(keys, ","), s.payTo, s.amount, env.c.Token.Hex(), env.net, lines, root)
}

// resourceFiles writes the files a reload test's gate sells into a new folder and returns it.
func resourceFiles(t *testing.T) string {
	t.Helper()
	root := t.TempDir()
	big, err := os.Create(filepath.Join(root, "big.bin"))
	if err != nil {
		t.Fatal(err)
	}
	if err := writeBigBody(big, resourceBigSize, func(int) error { return nil }); err != nil {
		t.Fatal(err)
	}
	if err := big.Close(); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(root, "small.txt"), []byte(resourceSmall), 0o644); err != nil {
		t.Fatal(err)
	}
	return root
}

// movedTo checks that exactly amount went from payer to seller since payerBefore and sellerBefore.
func (env *gateEnv) movedTo(payer *chaintest.Account, seller common.Address, payerBefore, sellerBefore *big.Int, amount int64, what string) {
	env.t.Helper()
	paid := new(big.Int).Sub(payerBefore, env.c.TokenBalance(payer.Address))
	got := new(big.Int).Sub(env.c.TokenBalance(seller), sellerBefore)
	if paid.Int64() != amount || got.Int64() != amount {
		env.t.Errorf("%s: the payer paid %s and the seller %s received %s; want %d each", what, paid, seller.Hex(), got, amount)
	}
}

// waitReceived waits up to 20 s until seller holds at least want (background settlement).
func (env *gateEnv) waitReceived(seller common.Address, want *big.Int) {
	env.t.Helper()
	for deadline := time.Now().Add(20 * time.Second); env.c.TokenBalance(seller).Cmp(want) < 0; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			env.t.Fatalf("the seller %s holds %s, want at least %s: the payment did not settle in time", seller.Hex(), env.c.TokenBalance(seller), want)
		}
	}
}

// wantRefused checks that f is a 402 whose error begins with one of reasons and that carries none of the files.
func wantRefused(t *testing.T, f fetched, what string, reasons ...string) {
	t.Helper()
	ok := f.status == http.StatusPaymentRequired && f.n < 4<<10 && !strings.Contains(f.body, resourceSmall)
	matched := false
	for _, r := range reasons {
		matched = matched || strings.HasPrefix(f.paymentError(), r)
	}
	if !ok || !matched {
		t.Fatalf("%s: %v; want 402 %s and no file", what, f, strings.Join(reasons, " or "))
	}
}

// cutShortAcrossAReload pays for /big.bin on the terms of before, reads three quarters of it and hangs up (the
// payment is charged: settle after and before settle it before the body streams, async in the background), then
// reloads Caddy with the terms of after and presents the payment again: for /small.txt (refused), for /big.bin
// (served whole, not charged again), for /big.bin once more (refused: served). A second payment, signed on the
// terms of before and never presented, is refused after the reload. Only the first payment's price moves, once,
// to the recipient it was signed for.
func cutShortAcrossAReload(t *testing.T, before, after termsSetup) {
	env := newStoppedGateEnv(t)
	t.Cleanup(commitPending(t, env.c))
	root := resourceFiles(t)
	before.payTo, after.payTo = cmp.Or(before.payTo, env.payTo.Hex()), cmp.Or(after.payTo, env.payTo.Hex())
	env.srv = startCaddy(t, env.termsCaddyfile(root, before))
	client := resourceClient(t, before.h2c)
	payer := env.c.Payers[0]
	env.approvePermit2(payer)
	seller := common.HexToAddress(before.payTo)
	payerBefore, sellerBefore := env.c.TokenBalance(payer.Address), env.c.TokenBalance(seller)
	otherBefore := env.c.TokenBalance(otherSeller)

	header := env.permit2Header("/big.bin", payer)
	unsent := env.permit2Header("/big.bin", payer)
	cut := env.fetch(client, "/big.bin", header, resourceBigSize*3/4)
	if cut.status != http.StatusOK || cut.n != resourceBigSize*3/4 {
		t.Fatalf("the paid download of /big.bin: %v; want 200 and three quarters of it read", cut)
	}
	env.waitReceived(seller, new(big.Int).Add(sellerBefore, big.NewInt(before.amount)))
	env.movedTo(payer, seller, payerBefore, sellerBefore, before.amount, "charged for the download cut short")

	env.srv.load(env.termsCaddyfile(root, after))
	client.CloseIdleConnections()
	if rq := env.requirement("/big.bin", x402.TransferPermit2); rq.Amount != fmt.Sprint(after.amount) || !x402.SameAddress(rq.PayTo, after.payTo) {
		t.Fatalf("after the reload /big.bin offers %s raw units to %s, want %d to %s", rq.Amount, rq.PayTo, after.amount, after.payTo)
	}

	wantRefused(t, env.presentOnceFree(client, "/small.txt", header), "the payment of /big.bin presented for /small.txt after the reload",
		x402.ReasonPaymentAlreadyUsed, x402.ReasonValueMismatch, x402.ReasonRecipientMismatch)

	whole := env.presentOnceFree(client, "/big.bin", header)
	if whole.status != http.StatusOK || whole.n != resourceBigSize || whole.sum != bigBodySum(resourceBigSize) || whole.err != nil {
		t.Fatalf("the charged payment presented again for /big.bin after the reload: %v; want 200 and the whole file", whole)
	}
	if after.settle != "async" {
		resp, err := x402.DecodeSettleResponse(whole.header.Get(x402.HeaderPaymentResponse))
		if err != nil || !resp.Success || resp.Amount != fmt.Sprint(before.amount) {
			t.Errorf("PAYMENT-RESPONSE of the whole file: %+v (%v); want the settlement of %d it was charged", resp, err, before.amount)
		}
	}
	if !env.logged(`"level":"info"`, "judged by its record", `"resource":"GET 127.0.0.1/big.bin"`, fmt.Sprintf(`"amount":"%d"`, before.amount)) {
		t.Errorf("no info line says the payment was judged by its record")
	}
	wantRefused(t, env.presentOnceFree(client, "/big.bin", header), "presented a third time, after it bought /big.bin whole",
		x402.ReasonPaymentAlreadyUsed)
	wantRefused(t, env.presentOnceFree(client, "/big.bin", unsent), "a payment signed on the old terms and never presented, after the reload",
		x402.ReasonValueMismatch, x402.ReasonRecipientMismatch)

	time.Sleep(200 * time.Millisecond) // a settlement wrongly sent would have mined by now (blocks every 5 ms)
	env.movedTo(payer, seller, payerBefore, sellerBefore, before.amount, "after the reload")
	if seller != otherSeller {
		if got := new(big.Int).Sub(env.c.TokenBalance(otherSeller), otherBefore); got.Sign() != 0 {
			t.Errorf("the recipient the reload named received %s, want nothing", got)
		}
	}
	if n := env.c.CountTokenTransfers(payer.Address, seller); n != 1 {
		t.Errorf("%d token transfers from the payer to %s, want 1", n, seller.Hex())
	}
}

func TestAChargedPaymentCutShortIsServedByItsRecordAfterAReloadChangedTheRoutesPrice(t *testing.T) {
	for _, s := range []termsSetup{{settle: ""}, {settle: "async"}, {settle: "before", h2c: true}} {
		t.Run("settle "+cmp.Or(s.settle, "after"), func(t *testing.T) {
			before, after := s, s
			before.amount, after.amount = gatePrice, 2*gatePrice
			cutShortAcrossAReload(t, before, after)
		})
	}
}

func TestAChargedPaymentCutShortIsServedByItsRecordAfterAReloadChangedTheRoutesRecipient(t *testing.T) {
	for _, s := range []termsSetup{{settle: ""}, {settle: "async", h2c: true}} {
		t.Run("settle "+cmp.Or(s.settle, "after"), func(t *testing.T) {
			before, after := s, s
			before.amount, after.amount = gatePrice, gatePrice
			after.payTo = otherSeller.Hex()
			cutShortAcrossAReload(t, before, after)
		})
	}
}

// A payment taken within price_grace after a reload, its response cut short, is still served by its record once
// the grace has passed: the terms it was accepted under are no longer offered anywhere.
func TestAChargedPaymentTakenWithinPriceGraceAndCutShortIsServedByItsRecordOnceTheGraceHasPassed(t *testing.T) {
	const grace = 2 * time.Second
	env := newStoppedGateEnv(t)
	t.Cleanup(commitPending(t, env.c))
	root := resourceFiles(t)
	before := termsSetup{amount: gatePrice, payTo: env.payTo.Hex(), grace: grace.String()}
	after := before
	after.amount = 2 * gatePrice
	env.srv = startCaddy(t, env.termsCaddyfile(root, before))
	client := resourceClient(t, false)
	payer := env.c.Payers[0]
	env.approvePermit2(payer)
	payerBefore, sellerBefore := env.c.TokenBalance(payer.Address), env.c.TokenBalance(env.payTo)

	header := env.permit2Header("/big.bin", payer)
	lastOffered := time.Now()
	env.srv.load(env.termsCaddyfile(root, after))
	cut := env.fetch(client, "/big.bin", header, resourceBigSize*3/4)
	if cut.status != http.StatusOK || cut.n != resourceBigSize*3/4 {
		t.Fatalf("the download of /big.bin paid at the old price within the grace: %v; want 200 and three quarters of it read", cut)
	}
	env.movedTo(payer, env.payTo, payerBefore, sellerBefore, gatePrice, "charged within the grace")

	time.Sleep(time.Until(lastOffered.Add(grace + 200*time.Millisecond)))
	whole := env.presentOnceFree(client, "/big.bin", header)
	if whole.status != http.StatusOK || whole.n != resourceBigSize || whole.sum != bigBodySum(resourceBigSize) || whole.err != nil {
		t.Fatalf("the charged payment presented again once the grace had passed: %v; want 200 and the whole file", whole)
	}
	wantRefused(t, env.presentOnceFree(client, "/big.bin", header), "presented a third time, after it bought /big.bin whole",
		x402.ReasonPaymentAlreadyUsed)
	env.movedTo(payer, env.payTo, payerBefore, sellerBefore, gatePrice, "once served")
}

// Two routes sell the same URL, chosen by a header, describing different resources at different prices. A payment
// of the cheap one whose response was cut short is served again by its route, and refused by the other: judged by
// its record only where the resource is described as it was when the payment was first presented.
func TestAChargedPaymentCutShortIsNotServedByAnotherRouteOfTheSameURL(t *testing.T) {
	env := newStoppedGateEnv(t)
	t.Cleanup(commitPending(t, env.c))
	root := resourceFiles(t)
	var keys []string
	for _, w := range env.c.Wallets[:2] {
		keys = append(keys, hexKey(w))
	}
	route := func(description string, amount int64) string {
		return fmt.Sprintf("\t\tx402 {\n\t\t\tpay_to %s\n\t\t\tamount %d\n\t\t\tmax_buffer 1MiB\n\t\t\tdescription %q\n\t\t}\n\t\troot * %s\n\t\tfile_server\n",
			env.payTo.Hex(), amount, description, root)
	}
	env.srv = startCaddy(t, fmt.Sprintf(`{
	x402 {
		network %s {
			rpc %s
			asset %s name "Stable Coin" version 1 decimals 6
			wallet_keys %s
			receipt_poll 2ms
		}
		journal {{DATA}}/journal.db
	}
}

{{ADDR}} {
	@premium header X-Tier premium
	handle @premium {
%s	}
	handle {
%s	}
}
`, env.net, env.c.RPCURL, env.c.Token.Hex(), strings.Join(keys, ","), route("the premium files", 5*gatePrice), route("the files", gatePrice)))
	client := resourceClient(t, false)
	premium := &http.Client{Transport: headerTransport{base: client.Transport, name: "X-Tier", value: "premium"}, Timeout: client.Timeout}
	payer := env.c.Payers[0]
	env.approvePermit2(payer)
	payerBefore, sellerBefore := env.c.TokenBalance(payer.Address), env.c.TokenBalance(env.payTo)

	header := env.permit2Header("/big.bin", payer)
	cut := env.fetch(client, "/big.bin", header, resourceBigSize*3/4)
	if cut.status != http.StatusOK || cut.n != resourceBigSize*3/4 {
		t.Fatalf("the paid download of /big.bin: %v; want 200 and three quarters of it read", cut)
	}
	env.movedTo(payer, env.payTo, payerBefore, sellerBefore, gatePrice, "charged for the download cut short")

	wantRefused(t, env.presentOnceFree(premium, "/big.bin", header), "the cheap route's payment presented to the premium route of the same URL",
		x402.ReasonValueMismatch, x402.ReasonPaymentAlreadyUsed)
	whole := env.presentOnceFree(client, "/big.bin", header)
	if whole.status != http.StatusOK || whole.n != resourceBigSize || whole.sum != bigBodySum(resourceBigSize) || whole.err != nil {
		t.Fatalf("the payment presented again to its own route: %v; want 200 and the whole file", whole)
	}
	env.movedTo(payer, env.payTo, payerBefore, sellerBefore, gatePrice, "once served")
}

// tieredCaddyfile is a Caddy with two routes of one URL chosen by a header, neither describing its resource (the
// default): X-Tier premium gets "the premium content" at 100 times the price, the rest the files of root at
// cheap raw units. premiumLines are more lines of the premium gate.
func (env *gateEnv) tieredCaddyfile(root string, cheap int64, premiumLines string) string {
	var keys []string
	for _, w := range env.c.Wallets[:2] {
		keys = append(keys, hexKey(w))
	}
	return fmt.Sprintf(`{
	x402 {
		network %s {
			rpc %s
			asset %s name "Stable Coin" version 1 decimals 6
			wallet_keys %s
			receipt_poll 2ms
		}
		journal {{DATA}}/journal.db
	}
}

{{ADDR}} {
	@premium header X-Tier premium
	handle @premium {
		x402 {
			pay_to %s
			amount %d
%s		}
		respond "the premium content"
	}
	handle {
		x402 {
			pay_to %s
			amount %d
			max_buffer 1MiB
		}
		root * %s
		file_server
	}
}
`, env.net, env.c.RPCURL, env.c.Token.Hex(), strings.Join(keys, ","), env.payTo.Hex(), 100*gatePrice, premiumLines, env.payTo.Hex(), cheap, root)
}

// Two routes of one URL, chosen by a header, say nothing of their resource: they describe it alike, and sell it at
// different prices. A payment of the cheap route whose response was cut short, presented with the premium route's
// header, is refused for its terms, not served the premium response on the cheap record; its own route serves it
// whole, after a reload that doubled the cheap route's price too (judged by its record there). With the premium
// gate configured exactly as the cheap one but for its price, only the order of the two tells their routes apart.
func TestACheapPaymentCutShortDoesNotBuyTheExpensiveRouteOfTheSameURL(t *testing.T) {
	for _, tc := range []struct{ name, premiumLines string }{
		{"the premium gate configured otherwise (max_buffer)", ""},
		{"the premium gate configured alike but for its price", "\t\t\tmax_buffer 1MiB\n"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			env := newStoppedGateEnv(t)
			t.Cleanup(commitPending(t, env.c))
			root := resourceFiles(t)
			env.srv = startCaddy(t, env.tieredCaddyfile(root, gatePrice, tc.premiumLines))
			client := resourceClient(t, false)
			premium := &http.Client{Transport: headerTransport{base: client.Transport, name: "X-Tier", value: "premium"}, Timeout: client.Timeout}
			payer := env.c.Payers[0]
			env.approvePermit2(payer)
			payerBefore, sellerBefore := env.c.TokenBalance(payer.Address), env.c.TokenBalance(env.payTo)

			header := env.permit2Header("/big.bin", payer)
			cut := env.fetch(client, "/big.bin", header, resourceBigSize*3/4)
			if cut.status != http.StatusOK || cut.n != resourceBigSize*3/4 {
				t.Fatalf("the paid download of /big.bin: %v; want 200 and three quarters of it read", cut)
			}
			env.movedTo(payer, env.payTo, payerBefore, sellerBefore, gatePrice, "charged for the download cut short")

			got := env.presentOnceFree(premium, "/big.bin", header)
			if got.status == http.StatusOK || strings.Contains(got.body, "premium") {
				t.Errorf("the cheap route's payment (%d raw units) presented to the premium route (%d) of the same URL: %v; want 402 value_mismatch",
					gatePrice, 100*gatePrice, got)
			}
			wantRefused(t, got, "the cheap route's payment presented to the premium route", x402.ReasonValueMismatch)

			env.srv.load(env.tieredCaddyfile(root, 2*gatePrice, tc.premiumLines))
			client.CloseIdleConnections()
			wantRefused(t, env.presentOnceFree(premium, "/big.bin", header), "the cheap route's payment presented to the premium route after a reload",
				x402.ReasonValueMismatch)
			whole := env.presentOnceFree(client, "/big.bin", header)
			if whole.status != http.StatusOK || whole.n != resourceBigSize || whole.sum != bigBodySum(resourceBigSize) || whole.err != nil {
				t.Fatalf("the payment presented again to its own route, its price doubled by a reload: %v; want 200 and the whole file", whole)
			}
			time.Sleep(200 * time.Millisecond) // a settlement wrongly sent would have mined by now (blocks every 5 ms)
			env.movedTo(payer, env.payTo, payerBefore, sellerBefore, gatePrice, "once served")
		})
	}
}

// With a price_grace on both routes of one URL chosen by a header, the grace keeps the offers of each route's own
// 402s: a payment signed against the cheap route's offer, within its grace, is refused by the premium route
// (value_mismatch, its upstream never runs, nothing is charged), and bought the cheap route's response.
func TestAPaymentSignedForACheapRouteWithinItsPriceGraceDoesNotBuyTheExpensiveRouteOfTheSameURL(t *testing.T) {
	env := newStoppedGateEnv(t)
	t.Cleanup(commitPending(t, env.c))
	root := resourceFiles(t)
	graced := strings.Replace(env.tieredCaddyfile(root, gatePrice, "\t\t\tmax_buffer 1MiB\n\t\t\tprice_grace 1m\n"),
		"\t\t\tmax_buffer 1MiB\n\t\t}\n\t\troot", "\t\t\tmax_buffer 1MiB\n\t\t\tprice_grace 1m\n\t\t}\n\t\troot", 1)
	if strings.Count(graced, "price_grace 1m") != 2 {
		t.Fatalf("want both gates with a price grace:\n%s", graced)
	}
	env.srv = startCaddy(t, graced)
	client := resourceClient(t, false)
	premium := &http.Client{Transport: headerTransport{base: client.Transport, name: "X-Tier", value: "premium"}, Timeout: client.Timeout}
	payer := env.c.Payers[0]
	env.approvePermit2(payer)
	payerBefore, sellerBefore := env.c.TokenBalance(payer.Address), env.c.TokenBalance(env.payTo)

	header := env.permit2Header("/small.txt", payer) // the cheap route's 402, remembered for the grace
	got := env.presentOnceFree(premium, "/small.txt", header)
	wantRefused(t, got, "a payment signed for the cheap route's offer, within its grace, presented to the premium route", x402.ReasonValueMismatch)
	if strings.Contains(got.body, "premium") {
		t.Errorf("the premium route's content was sent: %v", got)
	}
	time.Sleep(200 * time.Millisecond) // a settlement wrongly sent would have mined by now (blocks every 5 ms)
	env.movedTo(payer, env.payTo, payerBefore, sellerBefore, 0, "refused by the premium route")
	if f := env.presentOnceFree(client, "/small.txt", header); f.status != http.StatusOK || f.body != resourceSmall {
		t.Fatalf("the payment presented to the cheap route it was signed for: %v; want 200 and the file", f)
	}
	env.movedTo(payer, env.payTo, payerBefore, sellerBefore, gatePrice, "served by the cheap route")
}

// headerTransport sets a request header on every request it carries.
type headerTransport struct {
	base        http.RoundTripper
	name, value string
}

func (h headerTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	r = r.Clone(r.Context())
	r.Header.Set(h.name, h.value)
	return h.base.RoundTrip(r)
}
