package e2e

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math/big"
	"net/http"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"crypto/ecdsa"

	"github.com/ethereum/go-ethereum/common"
	"github.com/ethereum/go-ethereum/common/hexutil"
	"github.com/ethereum/go-ethereum/core/types"
	"github.com/ethereum/go-ethereum/crypto"
	"github.com/ethereum/go-ethereum/ethclient"

	"github.com/x402-gateway/caddy-x402/chain/contracts"
	"github.com/x402-gateway/caddy-x402/chain/devchain"
	"github.com/x402-gateway/caddy-x402/internal/needs"
	"github.com/x402-gateway/caddy-x402/payer"
	"github.com/x402-gateway/caddy-x402/x402"
)

// The public TypeScript client (@x402/fetch with @x402/evm's exact scheme) pays our gate on the dev chain through
// a sponsored approval (erc20ApprovalGasSponsoring): the payer holds the token, no Permit2 allowance and no ether;
// the gate declares only the approval's sponsoring (gas_sponsoring erc20_approval), so the client signs its own
// approve(Permit2, max) transaction although the token has a permit. On chain afterwards: the seller +price, the
// payer -price, Permit2 approved for the maximum, and the payer's ether exactly what the engine sent it less what
// its approval spent; one funding transfer, one approval and one settlement, nothing else from or to the payer.
func TestThePublicTypeScriptClientPaysOurGateThroughASponsoredApproval(t *testing.T) {
	needBinary(t)
	npm := needs.Command(t, "npm", "apt-get install nodejs npm")
	node := needs.Command(t, "node", "apt-get install nodejs")
	sdk := installTypeScriptClient(t, npm)

	chainURL := fmt.Sprintf("http://127.0.0.1:%d", freePort(t))
	gateURL := fmt.Sprintf("http://127.0.0.1:%d", freePort(t))
	dir := t.TempDir()
	config := writeFile(t, dir, "Caddyfile", fmt.Sprintf(`{
	admin off
	x402 {
		dev_chain {
			listen %s
			block_time 0
			approval_sponsoring
		}
	}
}

%s {
	bind 127.0.0.1
	x402 {
		price $0.01
		pay_to %s
		gas_sponsoring erc20_approval
	}
	respond "approved content"
}
`, strings.TrimPrefix(chainURL, "http://"), gateURL, seller.Hex()))
	caddy := startProcess(t, "Caddy with the dev chain taking approval sponsoring and a gate declaring only it", dir, childEnv(t), "run", "--adapter", "caddyfile", "--config", config)
	caddy.waitUntil("a 402 from the gate", 60*time.Second, answersWith(gateURL+"/", 402))
	dev := dialChain(t, chainURL)

	a, err := get(gateURL + "/")
	if err != nil {
		t.Fatal(err)
	}
	pr, err := x402.DecodePaymentRequired(a.header.Get(x402.HeaderPaymentRequired))
	if err != nil || pr.Extensions[x402.ExtensionERC20ApprovalGasSponsoring] == nil || pr.Extensions[x402.ExtensionEIP2612GasSponsoring] != nil {
		t.Fatalf("the 402 declares %s (%v); want erc20ApprovalGasSponsoring and not eip2612GasSponsoring", pr.Extensions, err)
	}

	// A fresh payer: the token, no allowance, no ether.
	key := devchain.PayerKeyN(2)
	payer := crypto.PubkeyToAddress(key.PublicKey)
	dev.send(devchain.PayerKey(), devchain.TokenAddress, nil, callToken(t, "transfer", payer, big.NewInt(1_000_000)))

	payByTypeScriptApproval(t, dev, sdk, node, chainURL, key, gateURL+"/", "approved content")
}

// payByTypeScriptApproval has the public TypeScript client pay url with key, a fresh payer holding the token, no
// allowance and no ether, by a sponsored approval, and checks what it left on chain (checkSponsoredApproval).
func payByTypeScriptApproval(t *testing.T, dev *devChain, sdk, node, chainURL string, key *ecdsa.PrivateKey, url, content string) {
	t.Helper()
	payer := crypto.PubkeyToAddress(key.PublicKey)
	if allowance, eth := permit2Allowance(t, dev, devchain.TokenAddress, payer), dev.ether(payer); allowance.Sign() != 0 || eth.Sign() != 0 {
		t.Fatalf("the payer has a Permit2 allowance of %s and %s wei; want neither", allowance, eth)
	}
	payerBefore, sellerBefore, from := dev.balance(payer), dev.balance(seller), dev.head()+1
	env := append(os.Environ(), "X402_PAYER_KEY="+hexutil.Encode(crypto.FromECDSA(key)), "X402_RPC_URL="+chainURL,
		"X402_ASSET="+devchain.TokenAddress.Hex(), fmt.Sprintf("X402_NETWORK=eip155:%d", devchain.DefaultChainID), "X402_METHOD=permit2")
	r := runCommand(t, 2*time.Minute, sdk, env, node, "pay.mjs", url)
	var got paidByTypeScript
	if err := json.Unmarshal([]byte(lastLines(r.stdout, 1)), &got); err != nil {
		t.Fatalf("pay.mjs exited %d without its JSON line (%v)\nstdout:\n%s\nstderr:\n%s", r.code, err, r.stdout, r.stderr)
	}
	if r.code != 0 || got.Status != 200 || got.Body != content || got.PaymentResponse == nil || !got.PaymentResponse.Success {
		t.Fatalf("the TypeScript client paying by a sponsored approval got exit %d, status %d, body %q, error %q, payment response %+v\nstderr:\n%s",
			r.code, got.Status, got.Body, got.Error, got.PaymentResponse, r.stderr)
	}
	if got.Sent == nil || !slices.Equal(got.Sent.Extensions, []string{x402.ExtensionERC20ApprovalGasSponsoring}) {
		t.Fatalf("the client sent %+v; want a permit2 payment carrying erc20ApprovalGasSponsoring alone", got.Sent)
	}
	dev.checkSponsoredApproval(payer, from, common.HexToHash(got.PaymentResponse.Transaction), payerBefore, sellerBefore)
}

// checkSponsoredApproval checks what a payment of 10000 by a sponsored approval left on chain since fromBlock:
// the seller +10000 and the payer -10000 (from the balances before), Permit2 approved for the maximum, one funding
// of the payer, one transaction of its own (approve(Permit2, max) on the token), one settlement (the one named),
// and the payer's ether exactly what the funding sent less what its approval spent.
func (dev *devChain) checkSponsoredApproval(payer common.Address, from uint64, settlement common.Hash, payerBefore, sellerBefore *big.Int) {
	t := dev.t
	t.Helper()
	if !receiptTransfersOf(dev, devchain.TokenAddress, settlement, payer, seller, big.NewInt(10_000)) {
		t.Errorf("the settlement %s holds no Transfer of 10000 from the payer to the seller", settlement)
	}
	if d := delta(payerBefore, dev.balance(payer)); d.Cmp(big.NewInt(-10_000)) != 0 {
		t.Errorf("the payer's balance moved by %s, want -10000", d)
	}
	if d := delta(sellerBefore, dev.balance(seller)); d.Cmp(big.NewInt(10_000)) != 0 {
		t.Errorf("the seller's balance moved by %s, want +10000", d)
	}
	if n := len(dev.transfers(payer, seller, from)); n != 1 {
		t.Errorf("%d Transfers from the payer to the seller, want 1", n)
	}
	if allowance := permit2Allowance(t, dev, devchain.TokenAddress, payer); allowance.Cmp(maxUint256) != 0 {
		t.Errorf("the payer's Permit2 allowance is %s, want the maximum its approval set", allowance)
	}
	// The payer's transactions since: the engine's gas money, the payer's approval, the settlement.
	funding, approval, settled := dev.payerTransactions(payer, from)
	if len(funding) != 1 || len(approval) != 1 || len(settled) != 1 || settled[0].Hash() != settlement {
		t.Fatalf("on chain: %d fundings of the payer, %d transactions from it, %d settlements of its payment (%s); want one each",
			len(funding), len(approval), len(settled), settlement)
	}
	if to := approval[0].To(); to == nil || *to != devchain.TokenAddress || !bytes.Equal(approval[0].Data(), callToken(t, "approve", contracts.Permit2Address, maxUint256)) {
		t.Errorf("the payer's transaction is to %v with data %x; want approve(Permit2, max) on the token", to, approval[0].Data())
	}
	spent := dev.receipt(approval[0].Hash())
	cost := new(big.Int).Mul(new(big.Int).SetUint64(spent.GasUsed), spent.EffectiveGasPrice)
	want := new(big.Int).Sub(funding[0].Value(), cost)
	if eth := dev.ether(payer); eth.Cmp(want) != 0 {
		t.Errorf("the payer holds %s wei, want %s: the %s the engine sent less the approval's %s", eth, want, funding[0].Value(), cost)
	}
	t.Logf("the facilitator sent the payer %s wei, its approval spent %s (%d gas at %s wei)", funding[0].Value(), cost, spent.GasUsed, spent.EffectiveGasPrice)
}

// payerTransactions are the transactions of the blocks from fromBlock on that concern payer: those that send it
// ether (funding), those it sent (its own), and those whose receipt moves its tokens to the seller (settlements).
func (d *devChain) payerTransactions(payer common.Address, fromBlock uint64) (funding, own, settlements []*types.Transaction) {
	d.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	signer := types.LatestSignerForChainID(big.NewInt(int64(devchain.DefaultChainID)))
	for n := fromBlock; n <= d.head(); n++ {
		b, err := d.client.BlockByNumber(ctx, new(big.Int).SetUint64(n))
		if err != nil {
			d.t.Fatalf("reading block %d: %v", n, err)
		}
		for _, tx := range b.Transactions() {
			from, err := types.Sender(signer, tx)
			if err != nil {
				d.t.Fatalf("the sender of %s: %v", tx.Hash(), err)
			}
			switch {
			case from == payer:
				own = append(own, tx)
			case tx.To() != nil && *tx.To() == payer && tx.Value().Sign() > 0:
				funding = append(funding, tx)
			case len(d.transfersIn(tx.Hash(), payer, seller)) > 0:
				settlements = append(settlements, tx)
			}
		}
	}
	return funding, own, settlements
}

// transfersIn are the token's Transfer logs from one address to another in a transaction's receipt.
func (d *devChain) transfersIn(tx common.Hash, from, to common.Address) []*types.Log {
	var out []*types.Log
	for _, l := range d.receipt(tx).Logs {
		if l.Address == devchain.TokenAddress && len(l.Topics) == 3 && l.Topics[0] == transferTopic &&
			common.BytesToAddress(l.Topics[1].Bytes()) == from && common.BytesToAddress(l.Topics[2].Bytes()) == to {
			out = append(out, l)
		}
	}
	return out
}

// An @x402/hono server declaring erc20ApprovalGasSponsoring (declareErc20ApprovalGasSponsoringExtension) settles
// through our x402_facilitator, whose dev chain takes approval sponsoring, and the public TypeScript client pays
// it by a sponsored approval: balances, the payer's ether and the transactions exact (checkSponsoredApproval).
func TestAnHonoServerDeclaringApprovalSponsoringIsPaidThroughOurFacilitatorByASponsoredApproval(t *testing.T) {
	needBinary(t)
	npm := needs.Command(t, "npm", "apt-get install nodejs npm")
	node := needs.Command(t, "node", "apt-get install nodejs")
	sdk := installTypeScriptClient(t, npm)

	chainURL := fmt.Sprintf("http://127.0.0.1:%d", freePort(t))
	facURL := fmt.Sprintf("http://127.0.0.1:%d", freePort(t))
	honoURL := fmt.Sprintf("http://127.0.0.1:%d", freePort(t))
	dir := t.TempDir()
	config := writeFile(t, dir, "Caddyfile", fmt.Sprintf(`{
	admin off
	x402 {
		dev_chain {
			listen %s
			block_time 0
			approval_sponsoring
		}
	}
}

%s {
	bind 127.0.0.1
	handle_path /facilitator/* {
		x402_facilitator
	}
}
`, strings.TrimPrefix(chainURL, "http://"), facURL))
	caddy := startProcess(t, "Caddy with the dev chain taking approval sponsoring and our facilitator", dir, childEnv(t), "run", "--adapter", "caddyfile", "--config", config)
	caddy.waitUntil("our facilitator's /supported", 60*time.Second, answersWith(facURL+"/facilitator/supported", 200))
	dev := dialChain(t, chainURL)
	hono := startProgram(t, "the @x402/hono server declaring erc20ApprovalGasSponsoring", sdk, append(os.Environ(),
		"X402_FACILITATOR_URL="+facURL+"/facilitator", fmt.Sprintf("X402_NETWORK=eip155:%d", devchain.DefaultChainID),
		"X402_ASSET="+devchain.TokenAddress.Hex(), "X402_PAY_TO="+seller.Hex(), "X402_AMOUNT=10000",
		"X402_GAS_SPONSORING=erc20_approval", "X402_LIFETIME_SECONDS=300"),
		node, "server.mjs", portOf(t, honoURL))
	hono.waitUntil("a 402 from the hono server", 60*time.Second, answersWith(honoURL+"/paid", 402))
	a, err := get(honoURL + "/paid")
	if err != nil {
		t.Fatal(err)
	}
	pr, err := x402.DecodePaymentRequired(a.header.Get(x402.HeaderPaymentRequired))
	if err != nil || pr.Extensions[x402.ExtensionERC20ApprovalGasSponsoring] == nil || pr.Extensions[x402.ExtensionEIP2612GasSponsoring] != nil {
		t.Fatalf("the hono server's 402 declares %s (%v); want erc20ApprovalGasSponsoring alone", pr.Extensions, err)
	}

	key := devchain.PayerKeyN(2)
	dev.send(devchain.PayerKey(), devchain.TokenAddress, nil, callToken(t, "transfer", crypto.PubkeyToAddress(key.PublicKey), big.NewInt(1_000_000)))
	payByTypeScriptApproval(t, dev, sdk, node, chainURL, key, honoURL+"/paid", "paid content from the hono server")
	hono.stop()
	caddy.stop()
}

// Our payer pays an @x402/hono server declaring erc20ApprovalGasSponsoring, settled by the reference TypeScript
// facilitator taking it (registerExtension of createErc20ApprovalGasSponsoringExtension): `caddy x402 pay` and
// payer.Transport, each for a fresh payer with the token, no allowance and no ether, sign their own approval of
// Permit2, which the reference facilitator funds, broadcasts and settles after; balances, the payer's ether and the
// transactions exact (checkSponsoredApproval).
func TestOurPayerPaysAnHonoServerDeclaringApprovalSponsoringSettledByTheReferenceFacilitator(t *testing.T) {
	needBinary(t)
	npm := needs.Command(t, "npm", "apt-get install nodejs npm")
	node := needs.Command(t, "node", "apt-get install nodejs")
	sdk := installTypeScriptClient(t, npm)

	chainURL := fmt.Sprintf("http://127.0.0.1:%d", freePort(t))
	tsFacURL := fmt.Sprintf("http://127.0.0.1:%d", freePort(t))
	honoURL := fmt.Sprintf("http://127.0.0.1:%d", freePort(t))
	network := fmt.Sprintf("eip155:%d", devchain.DefaultChainID)
	dir := t.TempDir()
	config := writeFile(t, dir, "Caddyfile", fmt.Sprintf(`{
	admin off
	x402 {
		dev_chain {
			listen %s
			block_time 0
		}
	}
}
`, strings.TrimPrefix(chainURL, "http://")))
	caddy := startProcess(t, "Caddy with the dev chain", dir, childEnv(t), "run", "--adapter", "caddyfile", "--config", config)
	caddy.waitUntil("the dev chain", 60*time.Second, func() error {
		c, err := ethclient.Dial(chainURL)
		if err != nil {
			return err
		}
		defer c.Close()
		ctx, cancel := rpcContext()
		defer cancel()
		_, err = c.BlockNumber(ctx)
		return err
	})
	dev := dialChain(t, chainURL)
	tsFacKey := devchain.PayerKeyN(9)
	dev.send(devchain.PayerKey(), crypto.PubkeyToAddress(tsFacKey.PublicKey), big.NewInt(1e18), nil)
	tsFac := startProgram(t, "the TypeScript reference facilitator taking erc20ApprovalGasSponsoring", sdk, append(os.Environ(),
		"X402_FACILITATOR_KEY="+hexutil.Encode(crypto.FromECDSA(tsFacKey)), "X402_RPC_URL="+chainURL, "X402_NETWORK="+network,
		"X402_APPROVAL_SPONSORING=1", "X402_LIFETIME_SECONDS=300"),
		node, "facilitator.mjs", portOf(t, tsFacURL))
	tsFac.waitUntil("its /supported", 60*time.Second, answersWith(tsFacURL+"/supported", 200))
	hono := startProgram(t, "the @x402/hono server declaring erc20ApprovalGasSponsoring", sdk, append(os.Environ(),
		"X402_FACILITATOR_URL="+tsFacURL, "X402_NETWORK="+network,
		"X402_ASSET="+devchain.TokenAddress.Hex(), "X402_PAY_TO="+seller.Hex(), "X402_AMOUNT=10000",
		"X402_GAS_SPONSORING=erc20_approval", "X402_LIFETIME_SECONDS=300"),
		node, "server.mjs", portOf(t, honoURL))
	hono.waitUntil("a 402 from the hono server", 60*time.Second, answersWith(honoURL+"/paid", 402))

	fresh := func(key *ecdsa.PrivateKey) common.Address {
		t.Helper()
		addr := crypto.PubkeyToAddress(key.PublicKey)
		dev.send(devchain.PayerKey(), devchain.TokenAddress, nil, callToken(t, "transfer", addr, big.NewInt(1_000_000)))
		if allowance, eth := permit2Allowance(t, dev, devchain.TokenAddress, addr), dev.ether(addr); allowance.Sign() != 0 || eth.Sign() != 0 {
			t.Fatalf("the payer has a Permit2 allowance of %s and %s wei; want neither", allowance, eth)
		}
		return addr
	}

	t.Run("caddy x402 pay", func(t *testing.T) {
		key := devchain.PayerKeyN(2)
		addr := fresh(key)
		payerBefore, sellerBefore, from := dev.balance(addr), dev.balance(seller), dev.head()+1
		r := runCommand(t, 2*time.Minute, dir, childEnv(t, "X402_PAYER_KEY="+hexutil.Encode(crypto.FromECDSA(key))), caddyBin, "x402", "pay", "--rpc", chainURL, honoURL+"/paid")
		if r.code != 0 || !strings.HasPrefix(r.stdout, "HTTP/1.1 200 OK\n") {
			t.Fatalf("caddy x402 pay exited %d\nstdout:\n%s\nstderr:\n%s", r.code, r.stdout, r.stderr)
		}
		s := printedSettlement(t, r.stdout)
		dev.checkSponsoredApproval(addr, from, common.HexToHash(s.Transaction), payerBefore, sellerBefore)
	})
	t.Run("payer.Transport", func(t *testing.T) {
		key := devchain.PayerKeyN(3)
		addr := fresh(key)
		payerBefore, sellerBefore, from := dev.balance(addr), dev.balance(seller), dev.head()+1
		p, err := payer.New(key, payer.Options{RPC: chainURL})
		if err != nil {
			t.Fatal(err)
		}
		defer p.Close()
		client := &http.Client{Transport: &payer.Transport{Payer: p, Limits: []payer.Limit{{Network: network,
			Asset: devchain.TokenAddress.Hex(), PerRequest: big.NewInt(10_000), Total: big.NewInt(10_000)}}}}
		resp, err := client.Get(honoURL + "/paid")
		if err != nil {
			t.Fatal(err)
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		settled, err := x402.DecodeSettleResponse(resp.Header.Get(x402.HeaderPaymentResponse))
		if resp.StatusCode != 200 || err != nil || !settled.Success {
			t.Fatalf("payer.Transport: %d, PAYMENT-RESPONSE %+v (%v); want 200 and a settlement", resp.StatusCode, settled, err)
		}
		dev.checkSponsoredApproval(addr, from, common.HexToHash(settled.Transaction), payerBefore, sellerBefore)
	})
	hono.stop()
	tsFac.stop()
	caddy.stop()
}
