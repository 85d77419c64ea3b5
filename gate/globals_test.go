package gate_test

import (
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/x402-gateway/caddy-x402/internal/racepass"
)

// immutableVars are the package-level variables of gate that hold no state: set once when the package loads and
// never written after. Everything a gate shares with others (the ledgers of a journal, the requests at work on
// it, a pause of background settlement) belongs to an owner the server passes in (Config.Ledgers), so that two
// servers in one process, or two tests, cannot see each other's payments.
var immutableVars = map[string]string{
	"outcomeEvents":                 "a constant table, read only",
	"methodOrder":                   "a constant table, read only",
	"gasSponsoringDeclaration":      "a JSON document built once, read only",
	"approvalSponsoringDeclaration": "a JSON document built once, read only",
	"gasSponsoringExtensions":       "the names of the two gas-sponsoring extensions, read only",
	"paymentIdentifierOptional":     "a JSON document built once, read only",
	"paymentIdentifierRequired":     "a JSON document built once, read only",
	"paywallHTML":                   "the embedded page",
	"paywallPage":                   "a parsed template, executed only",
	"paywallScript":                 "the embedded script",
	"paywallColor":                  "a compiled pattern, only matched",
	"paywallDataImage":              "a compiled pattern, only matched",
	"paywallFrameSource":            "a compiled pattern, only matched",
	// A pool of empty buffers: what it holds means nothing (each is Reset before use), and no behaviour depends
	// on what is in it; shared across gates and reloads it saves allocations for all of them.
	"gateBuffers": "a sync.Pool of scratch buffers",
	"readPieces":  "a sync.Pool of scratch pieces a held body is read into, each overwritten before use",
}

// TestGateKeepsNoPackageLevelMutableState lists gate's package-level variables and allows only errors, interface
// guards and the immutable ones named above: a new one must say here why it holds no state, or move to an owner.
func TestGateKeepsNoPackageLevelMutableState(t *testing.T) {
	files, err := filepath.Glob("*.go")
	if err != nil {
		t.Fatal(err)
	}
	fset := token.NewFileSet()
	var found []string
	for _, name := range files {
		if strings.HasSuffix(name, "_test.go") {
			continue
		}
		src, err := os.ReadFile(name)
		if err != nil {
			t.Fatal(err)
		}
		f, err := parser.ParseFile(fset, name, src, 0)
		if err != nil {
			t.Fatal(err)
		}
		for _, d := range f.Decls {
			gd, ok := d.(*ast.GenDecl)
			if !ok || gd.Tok != token.VAR {
				continue
			}
			for _, spec := range gd.Specs {
				vs := spec.(*ast.ValueSpec)
				for i, id := range vs.Names {
					switch {
					case id.Name == "_": // an interface guard
					case strings.HasPrefix(id.Name, "err") && i < len(vs.Values) && isErrorsNew(vs.Values[i]):
					case immutableVars[id.Name] != "":
						found = append(found, id.Name)
					default:
						t.Errorf("%s: package-level variable %s: gate keeps no shared mutable state (give it to an owner, as Config.Ledgers), "+
							"or name it in immutableVars saying why it holds none", fset.Position(id.Pos()), id.Name)
					}
				}
			}
		}
	}
	for name := range immutableVars {
		if !slices.Contains(found, name) {
			t.Errorf("immutableVars names %s, which gate no longer declares: take it out", name)
		}
	}
}

// isErrorsNew reports whether e is errors.New(...) or fmt.Errorf(...): a sentinel error.
func isErrorsNew(e ast.Expr) bool {
	call, ok := e.(*ast.CallExpr)
	if !ok {
		return false
	}
	sel, ok := call.Fun.(*ast.SelectorExpr)
	if !ok {
		return false
	}
	pkg, ok := sel.X.(*ast.Ident)
	return ok && (pkg.Name == "errors" && sel.Sel.Name == "New" || pkg.Name == "fmt" && sel.Sel.Name == "Errorf")
}

// TestGateImportsNeitherTheEngineNorCaddy: gate learns what it needs of the chain through interfaces of x402
// (x402.Facilitator, x402.PermitSigners), which the server that makes a gate fills in, and knows no Caddy
// (ARCHITECTURE.md: caddymodule -> gate -> x402).
func TestGateImportsNeitherTheEngineNorCaddy(t *testing.T) {
	racepass.Once(t, "a go list of the package's imports: no code of ours runs")
	out, err := exec.Command("go", "list", "-deps", "-f", "{{.ImportPath}}", ".").CombinedOutput()
	if err != nil {
		t.Fatalf("go list -deps: %v\n%s", err, out)
	}
	for _, dep := range strings.Fields(string(out)) {
		if dep == "github.com/x402-gateway/caddy-x402/chain" || strings.HasPrefix(dep, "github.com/caddyserver/") {
			t.Errorf("gate depends on %s", dep)
		}
	}
}
