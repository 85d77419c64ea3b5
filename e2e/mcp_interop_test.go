package e2e

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/big"
	"net/http"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/ethereum/go-ethereum/common/hexutil"
	"github.com/ethereum/go-ethereum/crypto"

	"github.com/x402-gateway/caddy-x402/chain/contracts"
	"github.com/x402-gateway/caddy-x402/chain/devchain"
	"github.com/x402-gateway/caddy-x402/internal/needs"
	"github.com/x402-gateway/caddy-x402/payer"
	"github.com/x402-gateway/caddy-x402/x402"
)

// mcpToolResult is a tool result as mcp-client.mjs prints it.
type mcpToolResult struct {
	IsError           bool                       `json:"isError"`
	StructuredContent *x402.PaymentRequired      `json:"structuredContent"`
	Content           []map[string]any           `json:"content"`
	Meta              map[string]json.RawMessage `json:"_meta"`
}

// settlement is the result's _meta["x402/payment-response"], nil when it has none.
func (r mcpToolResult) settlement(t *testing.T) *x402.SettleResponse {
	t.Helper()
	raw, ok := r.Meta[x402.MCPMetaPaymentResponse]
	if !ok {
		return nil
	}
	var s x402.SettleResponse
	if err := json.Unmarshal(raw, &s); err != nil {
		t.Fatalf("_meta[%s] = %s: %v", x402.MCPMetaPaymentResponse, raw, err)
	}
	return &s
}

func (r mcpToolResult) text() string {
	if len(r.Content) == 0 {
		return ""
	}
	s, _ := r.Content[0]["text"].(string)
	return s
}

// mcpRun is the JSON line of mcp-client.mjs.
type mcpRun struct {
	OK        bool              `json:"ok"`
	Error     string            `json:"error"`
	SessionID string            `json:"sessionId"`
	Prices    map[string]string `json:"prices"`
	Echo      mcpToolResult     `json:"echo"`
	Unpaid    mcpToolResult     `json:"unpaid"`
	Paid      mcpToolResult     `json:"paid"`
	Again     mcpToolResult     `json:"again"`
	Failed    mcpToolResult     `json:"failed"`
	// The batches' answers, in the order of their requests.
	BatchUnpaid []struct {
		Result mcpToolResult `json:"result"`
		Error  *struct {
			Message string `json:"message"`
		} `json:"error"`
	} `json:"batchUnpaid"`
	BatchPaid []struct {
		Result mcpToolResult `json:"result"`
	} `json:"batchPaid"`
}

// An MCP server built on the official @modelcontextprotocol/sdk behind a real Caddy whose gate prices its tools
// (mcp { tool search $0.01 ... default free }), on the dev chain, called by that SDK's client, over both of the
// transport's answers (an SSE stream per POST, the SDK's default, and JSON): tools/list names the prices; a free
// tool runs unpaid; the unpaid priced call is a tool result with isError and the PaymentRequired in
// structuredContent and content[0].text (and never reaches the server); the call paid in _meta["x402/payment"]
// by the public TypeScript x402 client runs once, without the payment reaching the server, and its result carries
// the settlement; the same payment again is refused; a paid call whose tool fails is answered with the SDK's
// isError result and not charged; a batch with the priced call unpaid is refused whole, and one
// with it paid runs whole. The chain shows exactly the two payments of each run. Then payer.MCPClient pays in Go,
// within its limits.
func TestTheMCPSDKsClientPaysToolCallsThroughTheGateOnTheDevChain(t *testing.T) {
	needBinary(t)
	npm := needs.Command(t, "npm", "apt-get install nodejs npm")
	node := needs.Command(t, "node", "apt-get install nodejs")
	sdk := installTypeScriptClient(t, npm)

	chainURL := fmt.Sprintf("http://127.0.0.1:%d", freePort(t))
	gateURL := fmt.Sprintf("http://127.0.0.1:%d", freePort(t))
	mcpPort := freePort(t)
	server := startProgram(t, "the MCP server on @modelcontextprotocol/sdk", sdk, os.Environ(), node, "mcp-server.mjs", fmt.Sprint(mcpPort))
	server.waitUntil("its /calls", 60*time.Second, answersWith(fmt.Sprintf("http://127.0.0.1:%d/calls", mcpPort), 200))
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

%s {
	bind 127.0.0.1
	route /mcp* {
		x402 {
			pay_to %s
			mcp {
				tool search $0.01
				tool summarize $0.05
				default free
			}
		}
		reverse_proxy 127.0.0.1:%d
	}
}
`, strings.TrimPrefix(chainURL, "http://"), gateURL, seller.Hex(), mcpPort))
	caddy := startProcess(t, "Caddy with the dev chain and an MCP gate", dir, childEnv(t), "run", "--adapter", "caddyfile", "--config", config)
	caddy.waitUntil("the gate's price of a tool call", 60*time.Second, func() error {
		a, err := post(gateURL+"/mcp", `{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"search","arguments":{"q":"x"}}}`)
		if err != nil {
			return err
		}
		if a.status != 200 || !strings.Contains(a.body, "accepts") {
			return fmt.Errorf("answered %d %q", a.status, a.body)
		}
		return nil
	})
	dev := dialChain(t, chainURL)

	key := devchain.PayerKeyN(3)
	who := crypto.PubkeyToAddress(key.PublicKey)
	dev.send(devchain.PayerKey(), who, big.NewInt(1e18), nil)
	dev.send(devchain.PayerKey(), devchain.TokenAddress, nil, callToken(t, "transfer", who, big.NewInt(1_000_000)))
	maxUint256 := new(big.Int).Sub(new(big.Int).Lsh(big.NewInt(1), 256), big.NewInt(1))
	dev.send(key, devchain.TokenAddress, nil, callToken(t, "approve", contracts.Permit2Address, maxUint256))

	serverCalls := func() []map[string]any {
		t.Helper()
		a, err := get(fmt.Sprintf("http://127.0.0.1:%d/calls", mcpPort))
		if err != nil {
			t.Fatal(err)
		}
		var calls []map[string]any
		if err := json.Unmarshal([]byte(a.body), &calls); err != nil {
			t.Fatalf("/calls: %v: %q", err, a.body)
		}
		return calls
	}
	for _, path := range []string{"/mcp", "/mcp-json"} {
		t.Run(strings.TrimPrefix(path, "/"), func(t *testing.T) {
			payerBefore, sellerBefore, from := dev.balance(who), dev.balance(seller), dev.head()+1
			callsBefore := len(serverCalls())
			env := append(os.Environ(), "X402_PAYER_KEY="+hexutil.Encode(crypto.FromECDSA(key)), "X402_RPC_URL="+chainURL,
				"X402_ASSET="+devchain.TokenAddress.Hex(), fmt.Sprintf("X402_NETWORK=eip155:%d", devchain.DefaultChainID))
			r := runCommand(t, 2*time.Minute, sdk, env, node, "mcp-client.mjs", gateURL+path)
			var run mcpRun
			if err := json.Unmarshal([]byte(lastLines(r.stdout, 1)), &run); err != nil || !run.OK {
				t.Fatalf("mcp-client.mjs exited %d (%v)\nstdout:\n%s\nstderr:\n%s", r.code, err, r.stdout, r.stderr)
			}
			if run.SessionID == "" {
				t.Error("the SDK's client holds no Mcp-Session-Id through the gate")
			}
			if run.Prices["search"] != "$0.01" || run.Prices["summarize"] != "$0.05" || run.Prices["echo"] != "" {
				t.Errorf("tools/list prices = %v, want search $0.01, summarize $0.05, echo none", run.Prices)
			}
			if run.Echo.IsError || run.Echo.text() != "echo: hello" {
				t.Errorf("the free tool = %+v", run.Echo)
			}
			u := run.Unpaid
			if !u.IsError || u.StructuredContent == nil || len(u.StructuredContent.Accepts) == 0 || u.StructuredContent.Accepts[0].Amount != "10000" {
				t.Fatalf("the unpaid call = %+v, want isError with the PaymentRequired at 10000", u)
			}
			if b, _ := json.Marshal(u.StructuredContent); !strings.Contains(u.text(), `"accepts"`) || len(u.text()) < len(b)/2 {
				t.Errorf("content[0].text = %q, want the PaymentRequired's JSON", u.text())
			}
			if s := run.Paid.settlement(t); run.Paid.IsError || run.Paid.text() != "results for caddy" || s == nil || !s.Success || s.Transaction == "" {
				t.Fatalf("the paid call = %+v, want its result with a settlement", run.Paid)
			}
			if !run.Again.IsError || run.Again.StructuredContent == nil || !strings.Contains(run.Again.StructuredContent.Error, x402.ReasonPaymentAlreadyUsed) {
				t.Errorf("the same payment again = %+v, want isError naming %s", run.Again, x402.ReasonPaymentAlreadyUsed)
			}
			if !run.Failed.IsError || run.Failed.StructuredContent != nil || run.Failed.settlement(t) != nil || !strings.Contains(run.Failed.text(), "search failed") {
				t.Errorf("a paid call whose tool failed = %+v, want the SDK's isError result, unpaid", run.Failed)
			}
			if len(run.BatchUnpaid) != 2 || run.BatchUnpaid[0].Error == nil || !strings.Contains(run.BatchUnpaid[0].Error.Message, "not run") ||
				!run.BatchUnpaid[1].Result.IsError || run.BatchUnpaid[1].Result.StructuredContent == nil {
				t.Errorf("the batch with an unpaid priced call = %+v, want it refused whole", run.BatchUnpaid)
			}
			if len(run.BatchPaid) != 2 || run.BatchPaid[0].Result.text() != "echo: batch" || run.BatchPaid[1].Result.settlement(t) == nil ||
				run.BatchPaid[1].Result.text() != "results for batch" {
				t.Errorf("the batch with a paid call = %+v, want both run and the settlement on the paid one", run.BatchPaid)
			}

			calls := serverCalls()[callsBefore:]
			var names []string
			for _, c := range calls {
				names = append(names, fmt.Sprint(c["tool"]))
				if meta, _ := json.Marshal(c["meta"]); strings.Contains(string(meta), x402.MCPMetaPayment) {
					t.Errorf("the server saw the payment: %s", meta)
				}
			}
			if got := strings.Join(names, ","); got != "echo,search,search,echo,search" {
				t.Errorf("the server ran %s, want echo,search,search,echo,search (each paid call once, nothing unpaid)", got)
			}
			if d := delta(payerBefore, dev.balance(who)); d.Cmp(big.NewInt(-20_000)) != 0 {
				t.Errorf("the payer's balance moved by %s, want -20000", d)
			}
			if d := delta(sellerBefore, dev.balance(seller)); d.Cmp(big.NewInt(20_000)) != 0 {
				t.Errorf("the seller's balance moved by %s, want +20000", d)
			}
			if n := len(dev.transfers(who, seller, from)); n != 2 {
				t.Errorf("%d Transfers from the payer to the seller, want 2", n)
			}
		})
	}

	t.Run("payer", func(t *testing.T) {
		p, err := payer.New(key, payer.Options{RPC: chainURL, Method: x402.TransferPermit2})
		if err != nil {
			t.Fatal(err)
		}
		tr := &payer.Transport{Payer: p, Limits: []payer.Limit{{PerRequest: big.NewInt(10_000)}}}
		client := &payer.MCPClient{URL: gateURL + "/mcp", Transport: tr}
		ctx := context.Background()
		if err := client.Initialize(ctx); err != nil {
			t.Fatal(err)
		}
		payerBefore, sellerBefore := dev.balance(who), dev.balance(seller)
		res, err := client.CallTool(ctx, "search", map[string]any{"q": "go"})
		if err != nil || res.IsError || res.Settlement == nil || !res.Settlement.Success || !strings.Contains(string(res.Result), "results for go") {
			t.Fatalf("payer.MCPClient's paid call = %+v, %v", res, err)
		}
		var le *payer.LimitError
		if _, err := client.CallTool(ctx, "summarize", map[string]any{"q": "go"}); !errors.As(err, &le) {
			t.Fatalf("a tool over the limit = %v, want a *payer.LimitError", err)
		}
		if d := delta(payerBefore, dev.balance(who)); d.Cmp(big.NewInt(-10_000)) != 0 {
			t.Errorf("the payer's balance moved by %s, want -10000", d)
		}
		if d := delta(sellerBefore, dev.balance(seller)); d.Cmp(big.NewInt(10_000)) != 0 {
			t.Errorf("the seller's balance moved by %s, want +10000", d)
		}
	})
}

// post posts a JSON-RPC body to url as an MCP client does.
func post(url, body string) (answer, error) {
	req, err := http.NewRequest(http.MethodPost, url, strings.NewReader(body))
	if err != nil {
		return answer{}, err
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Accept", "application/json, text/event-stream")
	resp, err := httpClient.Do(req)
	if err != nil {
		return answer{}, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return answer{}, fmt.Errorf("reading the answer of %s: %w", url, err)
	}
	return answer{status: resp.StatusCode, header: resp.Header, body: string(b)}, nil
}
