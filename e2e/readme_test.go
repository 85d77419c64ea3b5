package e2e

import (
	"bufio"
	"encoding/json"
	"fmt"
	"math/big"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/ethereum/go-ethereum/common/hexutil"
	"github.com/ethereum/go-ethereum/crypto"

	"github.com/x402-gateway/caddy-x402/chain/devchain"
	"github.com/x402-gateway/caddy-x402/x402"
)

// A README block that cannot run here says so in an HTML comment on a line of its own before it:
//
//	<!-- example: <kind>: <why> -->
//
// with kind one of
//
//	validate  a Caddyfile needing what this machine lacks (a real network's RPC, a PostgreSQL server): adapted
//	          and validated with the built binary, the values it leaves to the reader filled in (readmeFillIn)
//	syntax    a Caddyfile reference of an option's or directive's form, not a config: every option it names
//	          must be one the Caddyfile parser knows
//	ci        a command CI runs in a script of its own (the xcaddy build): checked against that script's input
//	text      not a command: header lines an upstream sends, each read as JSON
//
// Every other block runs: Caddyfiles are adapted, validated and served (their paid routes paid and checked),
// commands run against Caddyfile.example's Caddy on free ports. A block no case handles fails the test.
var exampleMarker = regexp.MustCompile(`^<!-- example: ([a-z]+): (.+) -->$`)

// readmeBlock is a fenced block of a Markdown file.
type readmeBlock struct {
	file string
	line int    // of the opening fence
	lang string // after the fence: caddyfile, sh, go, or ""
	text string
	kind string // of its marker, "" when it has none
	why  string
}

func (b readmeBlock) String() string { return fmt.Sprintf("%s:%d (```%s)", b.file, b.line, b.lang) }

// readmeBlocks reads the fenced blocks of a Markdown file of the repository, with their markers.
func readmeBlocks(t *testing.T, name string) []readmeBlock {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(repoRoot, name))
	if err != nil {
		t.Fatal(err)
	}
	var blocks []readmeBlock
	var cur *readmeBlock
	var body []string
	marker := []string(nil) // the last marker seen, kept across blank lines only
	for i, line := range strings.Split(string(b), "\n") {
		switch {
		case cur == nil && strings.HasPrefix(line, "```"):
			cur = &readmeBlock{file: name, line: i + 1, lang: strings.TrimSpace(strings.TrimPrefix(line, "```"))}
			if marker != nil {
				cur.kind, cur.why = marker[1], marker[2]
			}
			body, marker = nil, nil
		case cur != nil && strings.TrimSpace(line) == "```":
			cur.text = strings.Join(body, "\n") + "\n"
			blocks = append(blocks, *cur)
			cur = nil
		case cur != nil:
			body = append(body, line)
		case exampleMarker.MatchString(line):
			marker = exampleMarker.FindStringSubmatch(line)
		case strings.HasPrefix(line, "<!-- example"):
			t.Fatalf("%s:%d: a marker this test cannot read (want <!-- example: <kind>: <why> -->): %s", name, i+1, line)
		case strings.TrimSpace(line) != "":
			marker = nil
		}
	}
	if cur != nil {
		t.Fatalf("%s: the block opened at line %d is never closed", name, cur.line)
	}
	return blocks
}

// TestEveryREADMEBlockRunsAsTheREADMESays runs every fenced block of README.md, and Caddyfile.example with
// the commands of its comments, against the built binary: each Caddyfile is adapted and validated, and served
// when nothing it needs is missing here, its paid routes checked as the README describes them; each command
// runs against Caddyfile.example's Caddy (on free ports) and its output is checked as the README claims. A
// block marked as one that cannot run is checked as its marker says. A new block no case handles fails.
func TestEveryREADMEBlockRunsAsTheREADMESays(t *testing.T) {
	needBinary(t)
	holdExamplePorts(t) // the README's main job may be running
	q := newQuickstart(t)
	caddy := q.start(t)
	r := &readmeRun{q: q}

	blocks := readmeBlocks(t, "README.md")
	if len(blocks) < 10 {
		t.Fatalf("README.md has %d fenced blocks: the reader lost them", len(blocks))
	}
	for _, b := range blocks {
		t.Run(fmt.Sprintf("README.md:%d", b.line), func(t *testing.T) { r.block(t, b) })
	}

	t.Run("Caddyfile.example", func(t *testing.T) {
		checkConfig(t, repoRoot, childEnv(t), "Caddyfile.example")
		// Its comments' commands: `go run ./cmd/caddy ...` lines, and `caddy x402 ...` in backquotes.
		src, err := os.ReadFile(filepath.Join(repoRoot, "Caddyfile.example"))
		if err != nil {
			t.Fatal(err)
		}
		var n int
		for _, line := range strings.Split(string(src), "\n") {
			c := strings.TrimSpace(strings.TrimPrefix(strings.TrimSpace(line), "#"))
			if strings.HasPrefix(c, "go run ") {
				r.command(t, c, "")
				n++
			}
			for _, m := range regexp.MustCompile("`(caddy x402 [^`]+)`").FindAllStringSubmatch(line, -1) {
				r.command(t, m[1], "")
				n++
			}
		}
		if n < 3 {
			t.Errorf("Caddyfile.example's comments name %d commands, want its run, its pay and its /usdc/ pay", n)
		}

		// What the README says of it in prose: /usdc/ is offered by permit2, eip3009 and erc2612, and the
		// caddy_x402_* metrics are on the admin API's /metrics with no metrics option (caddy_http_* are not).
		a, err := get(q.site + "/usdc/")
		if err != nil {
			t.Fatal(err)
		}
		req, err := x402.DecodePaymentRequired(a.header.Get(x402.HeaderPaymentRequired))
		var methods []string
		for _, o := range req.Accepts {
			methods = append(methods, o.Extra.AssetTransferMethod)
		}
		if err != nil || strings.Join(methods, ",") != "permit2,eip3009,erc2612" {
			t.Errorf("/usdc/ offers %v (%v), the README says permit2, eip3009 and erc2612", methods, err)
		}
		m, err := get("http://" + q.admin + "/metrics")
		if err != nil || !strings.Contains(m.body, "caddy_x402_gate_outcomes_total{status=\"settled\"}") {
			t.Errorf("the admin API's /metrics lacks caddy_x402_gate_outcomes_total after payments (%v):\n%s", err, m.body)
		}
		if strings.Contains(m.body, "caddy_http_requests_total") {
			t.Errorf("caddy_http_* metrics without the metrics option: the README says the option turns them on")
		}
	})
	if !caddy.running() {
		t.Error("Caddyfile.example's Caddy exited while the README's commands ran against it")
	}
	caddy.stop()
}

// readmeRun is what the README's blocks run against.
type readmeRun struct {
	q *quickstart
}

// block checks one block as its language and marker say.
func (r *readmeRun) block(t *testing.T, b readmeBlock) {
	t.Logf("%s: %s", b, firstLine(b.text))
	switch {
	case b.lang == "caddyfile" && b.kind == "syntax":
		checkSyntaxBlock(t, b)
	case b.lang == "caddyfile" && b.kind == "validate":
		config, env := readmeFillIn(t, b)
		checkConfig(t, t.TempDir(), childEnv(t, env...), writeFile(t, t.TempDir(), "Caddyfile", config))
	case b.lang == "caddyfile" && b.kind == "":
		r.runCaddyfile(t, b)
	case b.lang == "sh" && (b.kind == "" || b.kind == "ci"):
		for _, c := range shellCommands(b.text) {
			r.command(t, c, b.kind)
		}
	case b.lang == "" && b.kind == "" && strings.HasPrefix(b.text, "$ "):
		r.transcript(t, b)
	case b.lang == "" && b.kind == "text":
		checkHeaderLines(t, b)
	case b.lang == "go" && b.kind == "":
		compileGoBlock(t, b)
	default:
		t.Fatalf("%s (marker %q) is a block no case of TestEveryREADMEBlockRunsAsTheREADMESays handles: "+
			"run it there, or mark it as readme_test.go's doc says", b, b.kind)
	}
}

// shellCommands splits a sh block into its commands: comments dropped, continuation lines joined (after a
// backslash, and a synopsis's indented lines).
func shellCommands(text string) []string {
	var cmds []string
	var cur string
	for _, line := range strings.Split(text, "\n") {
		if i := strings.Index(line, " #"); i >= 0 {
			line = line[:i]
		}
		indented := strings.HasPrefix(line, " ") || strings.HasPrefix(line, "\t")
		line = strings.TrimSpace(line)
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		if indented && cur == "" && len(cmds) > 0 {
			cur, cmds = cmds[len(cmds)-1]+" ", cmds[:len(cmds)-1]
		}
		if strings.HasSuffix(line, "\\") {
			cur += strings.TrimSuffix(line, "\\") + " "
			continue
		}
		cmds = append(cmds, strings.Join(strings.Fields(cur+line), " "))
		cur = ""
	}
	return cmds
}

// caddyCommand is how the README runs the binary: go run ./cmd/caddy, ./caddy or caddy, all of them the
// binary TestMain built from ./cmd/caddy.
var caddyCommand = regexp.MustCompile(`^(go run \./cmd/caddy|\./caddy|caddy) `)

// command runs one command of the README (kind "" ) or checks one CI runs (kind "ci").
func (r *readmeRun) command(t *testing.T, c, kind string) {
	t.Helper()
	c = r.q.rewrite(c)
	if kind == "ci" {
		checkXcaddyCommand(t, c)
		return
	}
	switch {
	case c == "go test -timeout 30m ./...":
		t.Logf("%q: the command this test is part of", c)
		return
	case c == "go build -o caddy ./cmd/caddy":
		// TestMain builds the binary every test runs with this very command (into a temporary folder), unless
		// X402_E2E_CADDY names one.
		if _, err := os.Stat(caddyBin); err != nil {
			t.Errorf("%q: the binary TestMain built is not there: %v", c, err)
		}
		return
	}
	if !caddyCommand.MatchString(c) {
		t.Fatalf("%q: a command no case of readme_test.go runs: add one", c)
	}
	args := strings.Fields(caddyCommand.ReplaceAllString(c, ""))
	switch {
	case len(args) >= 3 && args[0] == "run" && args[1] == "--config" && args[2] == "Caddyfile.example":
		// The Caddy every command here runs against was started this way (on free ports).
		if a, err := get(r.q.site + "/paid/index.html"); err != nil || a.status != http.StatusPaymentRequired {
			t.Errorf("%q: the running Caddyfile.example does not answer /paid/index.html 402: %v %v", c, a.status, err)
		}
	case strings.ContainsAny(c, "[<|") || strings.Join(args, " ") == "x402 keygen":
		checkSynopsis(t, c, args, r.q.site+"/paid/index.html")
	case len(args) >= 2 && args[0] == "x402" && args[1] == "pay":
		r.pay(t, c, args)
	case len(args) >= 2 && args[0] == "x402" && args[1] == "bench":
		r.bench(t, c, args, "")
	default:
		t.Fatalf("%q: a caddy command no case of readme_test.go runs: add one", c)
	}
}

// pay runs `caddy x402 pay`: it exits 0 and prints HTTP/1.1 200 OK, the body and a settled PAYMENT-RESPONSE
// naming a transaction, as the README says; with --method, it paid by that method.
func (r *readmeRun) pay(t *testing.T, c string, args []string) {
	t.Helper()
	res := runCommand(t, 2*time.Minute, repoRoot, childEnv(t), caddyBin, args...)
	if res.code != 0 || !strings.HasPrefix(res.stdout, "HTTP/1.1 200 OK\n") {
		t.Fatalf("%q: exit %d, want 0 and HTTP/1.1 200 OK first\nstdout:\n%s\nstderr:\n%s", c, res.code, res.stdout, res.stderr)
	}
	s := printedSettlement(t, res.stdout)
	if !s.Success || !txHashPattern.MatchString(s.Transaction) {
		t.Errorf("%q: PAYMENT-RESPONSE %+v, want a success naming its transaction", c, s)
	}
	for i, a := range args {
		if a == "--method" && i+1 < len(args) && !strings.Contains(res.stderr, " by "+args[i+1]+" as ") {
			t.Errorf("%q: did not say it paid by %s:\n%s", c, args[i+1], res.stderr)
		}
	}
}

// bench runs `caddy x402 bench`; want, when not "", is the README's transcript of its output, whose lines
// (timings aside) the output must repeat.
func (r *readmeRun) bench(t *testing.T, c string, args []string, want string) {
	t.Helper()
	res := runCommand(t, 5*time.Minute, repoRoot, childEnv(t), caddyBin, args...)
	if res.code != 0 {
		t.Fatalf("%q: exit %d\nstdout:\n%s\nstderr:\n%s", c, res.code, res.stdout, res.stderr)
	}
	got := strings.Split(res.stdout, "\n")
	for i, w := range strings.Split(strings.TrimSpace(want), "\n") {
		if w == "" {
			continue
		}
		label, _, _ := strings.Cut(w, ":")
		var line string
		for _, g := range got {
			if strings.HasPrefix(g, label+":") {
				line = g
				break
			}
		}
		// The first line names the offer, the last ones what the run should show; the rest are timings, whose
		// shape alone is compared.
		switch {
		case i == 0 || strings.HasPrefix(w, "failures:") || strings.HasPrefix(w, "seller:"):
			if line != w {
				t.Errorf("%q printed %q, the README shows %q", c, line, w)
			}
		case line == "":
			t.Errorf("%q printed no %q line; the README shows %q\n%s", c, label, w, res.stdout)
		}
	}
}

// transcript runs a block that shows a command after "$ " and then its output.
func (r *readmeRun) transcript(t *testing.T, b readmeBlock) {
	first, output, _ := strings.Cut(b.text, "\n")
	c := r.q.rewrite(strings.TrimPrefix(first, "$ "))
	args := strings.Fields(caddyCommand.ReplaceAllString(c, ""))
	if !caddyCommand.MatchString(c) || len(args) < 2 || args[1] != "bench" {
		t.Fatalf("%s: a transcript of %q, which no case of readme_test.go runs: add one", b, c)
	}
	// The output names the site as the README's command did: move it as the command was.
	r.bench(t, c, args, r.q.rewrite(output))
}

// checkSynopsis checks a command's synopsis against its --help: every flag it names is one the command has.
// keygen and decode run as shown, decode on the PAYMENT-REQUIRED header of paid, a URL answering 402.
func checkSynopsis(t *testing.T, c string, args []string, paid string) {
	t.Helper()
	if len(args) < 2 || args[0] != "x402" {
		t.Fatalf("%q: a synopsis of no x402 command", c)
	}
	help := runCommand(t, time.Minute, repoRoot, childEnv(t), caddyBin, "x402", args[1], "--help")
	if help.code != 0 {
		t.Fatalf("caddy x402 %s --help: exit %d\n%s%s", args[1], help.code, help.stdout, help.stderr)
	}
	text := help.stdout + help.stderr
	for _, f := range regexp.MustCompile(`(^|[\s\[|])(--?[a-z][a-z-]*)`).FindAllStringSubmatch(c, -1) {
		if !regexp.MustCompile(`(^|[\s,])` + regexp.QuoteMeta(f[2]) + `[\s,=]`).MatchString(text) {
			t.Errorf("%q names %s, which `caddy x402 %s --help` does not list:\n%s", c, f[2], args[1], text)
		}
	}
	// keygen and decode take no chain: run them as the synopsis shows.
	switch args[1] {
	case "keygen":
		res := runCommand(t, time.Minute, repoRoot, childEnv(t), caddyBin, "x402", "keygen")
		if res.code != 0 || !regexp.MustCompile(`0x[0-9a-fA-F]{40}`).MatchString(res.stdout+res.stderr) {
			t.Errorf("caddy x402 keygen: exit %d, want 0 and an address:\n%s%s", res.code, res.stdout, res.stderr)
		}
	case "decode":
		a, err := get(paid)
		if err != nil {
			t.Fatal(err)
		}
		value := a.header.Get(x402.HeaderPaymentRequired)
		res := runCommand(t, time.Minute, repoRoot, childEnv(t), caddyBin, "x402", "decode", value)
		if res.code != 0 || !strings.Contains(res.stdout, `"x402Version": 2`) || !strings.Contains(res.stdout, `"amount": "10000"`) {
			t.Errorf("caddy x402 decode %s: exit %d, want 0 and the decoded JSON:\n%s%s", value, res.code, res.stdout, res.stderr)
		}
	}
}

// checkXcaddyCommand checks a command of the xcaddy section against xcaddy.json, which
// scripts/xcaddy-check.sh (run by .ci/run) builds from: a build of minutes, not repeated here.
func checkXcaddyCommand(t *testing.T, c string) {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(repoRoot, "xcaddy.json"))
	if err != nil {
		t.Fatal(err)
	}
	var spec struct {
		Caddy  string            `json:"caddy_version"`
		Output string            `json:"output"`
		Env    map[string]string `json:"env"`
	}
	if err := json.Unmarshal(b, &spec); err != nil {
		t.Fatalf("xcaddy.json: %v", err)
	}
	switch {
	case strings.Contains(c, "xcaddy build"):
		for k, v := range spec.Env {
			if k != "CGO_ENABLED" && !strings.Contains(c, k+"="+v) {
				t.Errorf("%q lacks %s=%s of xcaddy.json", c, k, v)
			}
		}
		if !strings.Contains(c, "xcaddy build "+spec.Caddy+" ") || !strings.Contains(c, "--output "+spec.Output) {
			t.Errorf("%q does not build Caddy %s into %s as xcaddy.json says", c, spec.Caddy, spec.Output)
		}
	case strings.HasPrefix(c, spec.Output+" list-modules"):
	default:
		t.Fatalf("%q: a command of the xcaddy section no case of readme_test.go checks: add one", c)
	}
	ci, err := os.ReadFile(filepath.Join(repoRoot, ".ci", "run"))
	if err != nil || !strings.Contains(string(ci), "scripts/xcaddy-check.sh") {
		t.Errorf(".ci/run does not run scripts/xcaddy-check.sh (%v)", err)
	}
}

// checkHeaderLines reads each `Name: value  # comment` line of a text block, the value as JSON.
func checkHeaderLines(t *testing.T, b readmeBlock) {
	for _, line := range strings.Split(strings.TrimSpace(b.text), "\n") {
		if i := strings.Index(line, "  #"); i >= 0 {
			line = line[:i]
		}
		name, value, ok := strings.Cut(line, ":")
		var v any
		if !ok || strings.ContainsAny(name, " \t") || json.Unmarshal([]byte(strings.TrimSpace(value)), &v) != nil {
			t.Errorf("%s: %q is not a header line with a JSON value", b, line)
		}
	}
}

// checkSyntaxBlock checks a reference of the Caddyfile's form: the first word of every line is a name the
// Caddyfile parsers of this module know (a quoted string in their source), or one of Caddy's own directives.
func checkSyntaxBlock(t *testing.T, b readmeBlock) {
	var src strings.Builder
	files, _ := filepath.Glob(filepath.Join(repoRoot, "caddymodule", "*.go"))
	for _, f := range files {
		if strings.HasSuffix(f, "_test.go") {
			continue
		}
		data, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		src.Write(data)
	}
	caddys := map[string]bool{"handle_path": true}
	n := 0
	for _, line := range strings.Split(b.text, "\n") {
		fields := strings.Fields(line)
		if len(fields) == 0 || strings.HasPrefix(fields[0], "#") || strings.HasPrefix(fields[0], "}") || strings.HasPrefix(fields[0], "<") {
			continue
		}
		word := fields[0]
		n++
		if !caddys[word] && !strings.Contains(src.String(), `"`+word+`"`) {
			t.Errorf("%s names %q, which no Caddyfile parser of caddymodule knows: %s", b, word, strings.TrimSpace(line))
		}
	}
	if n < 3 {
		t.Errorf("%s: a reference naming %d options", b, n)
	}
}

// readmeFillIn makes a Caddyfile of a block marked validate: the values it leaves to the reader (a token,
// an address, wallet keys, a password) are filled in with the dev chain's, a line of "..." becomes the asset it
// elides, a block
// of global options alone is wrapped in braces. It returns the config and the environment it reads.
func readmeFillIn(t *testing.T, b readmeBlock) (string, []string) {
	t.Helper()
	var keys []string
	for _, k := range devchain.WalletKeys(devchain.DefaultWallets) {
		keys = append(keys, hexutil.Encode(crypto.FromECDSA(k))[2:])
	}
	keyFile := writeFile(t, t.TempDir(), "x402-wallets", strings.Join(keys, "\n")+"\n")
	config := strings.NewReplacer(
		"0xYourTokenAddress", devchain.TokenAddress.Hex(),
		"0xYourReceivingAddress", seller.Hex(),
		"0xYourAddress", seller.Hex(),
		"/etc/caddy/x402-wallets", keyFile,
	).Replace(b.text)
	// "..." stands for the rest of a network block, as the block above shows it: its asset.
	config = regexp.MustCompile(`(?m)^(\s*)\.\.\.\s*$`).ReplaceAllString(config, "${1}asset "+devchain.TokenAddress.Hex())
	config = regexp.MustCompile(`(?m)0x\.\.\.$`).ReplaceAllString(config, seller.Hex())
	if strings.HasPrefix(config, "x402 {") {
		config = "{\n" + config + "}\n"
	}
	return config, []string{
		"X402_WALLET_KEYS=" + strings.Join(keys, ","),
		"X402_DB_PASSWORD=not-a-real-password",
		"BASE_RPC=http://127.0.0.1:1",
	}
}

// runCaddyfile serves a runnable Caddyfile block on free ports with a dev chain and checks what the README
// says of it.
func (r *readmeRun) runCaddyfile(t *testing.T, b readmeBlock) {
	t.Helper()
	dir := t.TempDir()
	site := fmt.Sprintf("localhost:%d", freePort(t))
	rpc := fmt.Sprintf("127.0.0.1:%d", freePort(t))
	globals := fmt.Sprintf("{\n\tadmin off\n\tx402 {\n\t\tdev_chain {\n\t\t\tlisten %s\n\t\t}\n\t}\n}\n", rpc)
	pay := func(path string, extra ...string) result {
		args := append([]string{"x402", "pay", "--dev", "--rpc", "http://" + rpc}, extra...)
		res := runCommand(t, 2*time.Minute, dir, childEnv(t), caddyBin, append(args, "http://"+site+path)...)
		if res.code != 0 || !strings.HasPrefix(res.stdout, "HTTP/1.1 200 OK\n") {
			t.Fatalf("paying %s: exit %d\nstdout:\n%s\nstderr:\n%s", path, res.code, res.stdout, res.stderr)
		}
		return res
	}
	start := func(config, ready string) {
		file := writeFile(t, dir, "Caddyfile", config)
		checkConfig(t, dir, childEnv(t), file)
		p := startProcess(t, "caddy run ("+b.String()+")", dir, childEnv(t), "run", "--config", file)
		p.waitUntil("a 402 on "+ready, quickstartReady, answersWith(ready, http.StatusPaymentRequired))
	}
	text := b.text
	switch {
	case strings.Contains(text, "on payment_settled x402_exec ./notify-sale.sh"):
		// The events example, in Caddyfile.example's global options; the script records its arguments.
		sales := filepath.Join(dir, "sales")
		script := writeFile(t, dir, "notify-sale.sh", "#!/bin/sh\necho \"$@\" >> "+sales+"\n")
		if err := os.Chmod(script, 0o755); err != nil {
			t.Fatal(err)
		}
		body := strings.TrimSuffix(strings.TrimPrefix(strings.TrimSpace(text), "{"), "}")
		body = strings.Replace(body, "./notify-sale.sh", script, 1)
		example, err := os.ReadFile(r.q.config)
		if err != nil {
			t.Fatal(err)
		}
		q := newQuickstart(t) // a second Caddyfile.example, on ports of its own
		config := strings.Replace(string(example), "\n{\n", "\n{\n"+body+"\n", 1)
		config = strings.NewReplacer(
			r.q.site[len("http://"):], q.site[len("http://"):], r.q.rpc[len("http://"):], q.rpc[len("http://"):], r.q.admin, q.admin,
			fmt.Sprintf(":%d {", r.q.ports[8080]), fmt.Sprintf(":%d {", q.ports[8080]),
			fmt.Sprintf(":%d {", r.q.ports[8081]), fmt.Sprintf(":%d {", q.ports[8081]),
			fmt.Sprintf("localhost:%d", r.q.ports[8081]), fmt.Sprintf("localhost:%d", q.ports[8081]),
		).Replace(config)
		if !strings.Contains(config, script) {
			t.Fatalf("the events block did not go into Caddyfile.example's global options")
		}
		file := writeFile(t, dir, "Caddyfile.example", config)
		checkConfig(t, repoRoot, childEnv(t), file)
		p := startProcess(t, "Caddyfile.example with the events block", repoRoot, childEnv(t), "run", "--config", file)
		p.waitUntil("a 402", quickstartReady, answersWith(q.site+"/paid/index.html", http.StatusPaymentRequired))
		res := runCommand(t, 2*time.Minute, repoRoot, childEnv(t), caddyBin, "x402", "pay", "--dev", "--rpc", q.rpc, q.site+"/paid/index.html")
		if res.code != 0 {
			t.Fatalf("pay: exit %d\n%s%s", res.code, res.stdout, res.stderr)
		}
		s := printedSettlement(t, res.stdout)
		want := fmt.Sprintf("%s 10000 %s\n", s.Payer, s.Transaction)
		var got []byte
		for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
			if got, _ = os.ReadFile(sales); len(got) > 0 {
				break
			}
		}
		if !strings.EqualFold(string(got), want) {
			t.Errorf("./notify-sale.sh was run with %q, want %q (payer, amount, transaction)", got, want)
		}

	case strings.Contains(text, "scheme upto") && strings.Contains(text, "reverse_proxy 127.0.0.1:8000"):
		// The upto example: its upstream names the charge the comment says.
		upstream := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
			w.Header().Set("Settlement-Overrides", `{"amount":"$0.0123"}`)
			fmt.Fprintln(w, "the answer")
		}))
		t.Cleanup(upstream.Close)
		config := strings.NewReplacer("llm.example.com", "http://"+site, "127.0.0.1:8000", upstream.Listener.Addr().String(),
			"0xYourAddress", seller.Hex()).Replace(text)
		start(globals+config, "http://"+site+"/v1/chat")
		res := pay("/v1/chat")
		if s := printedSettlement(t, res.stdout); !s.Success || s.Amount != "12300" {
			t.Errorf("the upto route charged %+v, want a success of 12300 ($0.0123 of a 6-decimal token)", s)
		}

	case strings.Contains(text, "map {path} {price}"):
		// Prices set per request: each path's 402 offers its price, and a payment of it buys the answer.
		config := globals + "http://" + site + " {\n" + strings.Replace(text, "pay_to 0x...", "pay_to "+seller.Hex(), 1) +
			"\trespond \"priced by path\"\n}\n"
		start(config, "http://"+site+"/other")
		for path, amount := range map[string]int64{"/cheap/a": 1000, "/dear/a": 50000, "/other": 10000} {
			a, err := get("http://" + site + path)
			if err != nil {
				t.Fatal(err)
			}
			req, err := x402.DecodePaymentRequired(a.header.Get(x402.HeaderPaymentRequired))
			if a.status != http.StatusPaymentRequired || err != nil || len(req.Accepts) == 0 || req.Accepts[0].Amount != big.NewInt(amount).String() {
				t.Errorf("GET %s: %d, offers %+v (%v), want 402 offering %d", path, a.status, req, err, amount)
			}
		}
		pay("/dear/a")

	default:
		if strings.HasPrefix(strings.TrimSpace(text), "{") {
			checkConfig(t, dir, childEnv(t), writeFile(t, dir, "Caddyfile", text))
		} else {
			checkConfig(t, dir, childEnv(t), writeFile(t, dir, "Caddyfile", globals+text))
		}
		t.Fatalf("%s is a Caddyfile this test does not know how to run: add a case to readmeRun.runCaddyfile that "+
			"serves it and checks what the README says of it, or mark it validate with the reason it cannot run here", b)
	}
}

// compileGoBlock compiles a Go block as the body of a function given the names it uses but does not declare.
func compileGoBlock(t *testing.T, b readmeBlock) {
	t.Helper()
	dir, err := os.MkdirTemp(repoRoot, "_readme-go-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	var body strings.Builder
	sc := bufio.NewScanner(strings.NewReader(b.text))
	for sc.Scan() {
		body.WriteString("\t" + sc.Text() + "\n")
	}
	src := `package main

import (
	"crypto/ecdsa"
	"math/big"
	"net/http"

	"github.com/x402-gateway/caddy-x402/payer"
)

// example holds the README's block, given the key and RPC URL it names.
func example(key *ecdsa.PrivateKey, rpcURL string) (*http.Client, error) {
` + body.String() + `	return client, err
}

var _ = big.NewInt
var _ = payer.New

func main() { _, _ = example(nil, "") }
`
	writeFile(t, dir, "main.go", src)
	cmd := exec.Command("go", "vet", "./"+filepath.Base(dir))
	cmd.Dir = repoRoot
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Errorf("%s does not compile as the body of a function given key and rpcURL: %v\n%s\n%s", b, err, out, src)
	}
}

// firstLine is a block's first line, for the log.
func firstLine(s string) string {
	line, _, _ := strings.Cut(s, "\n")
	return line
}
