package x402

import (
	"go/ast"
	"go/parser"
	"go/token"
	"slices"
	"strconv"
	"strings"
	"testing"
)

// TestReasonsNamesEveryReasonCode: Reasons lists every Reason constant of reasons.go, once each, and nothing
// else: a reason code added without it would count as "other" in the metrics, where each known reason has its
// own series.
func TestReasonsNamesEveryReasonCode(t *testing.T) {
	f, err := parser.ParseFile(token.NewFileSet(), "reasons.go", nil, 0)
	if err != nil {
		t.Fatal(err)
	}
	var declared []string
	for _, d := range f.Decls {
		g, ok := d.(*ast.GenDecl)
		if !ok || g.Tok != token.CONST {
			continue
		}
		for _, spec := range g.Specs {
			vs := spec.(*ast.ValueSpec)
			for i, name := range vs.Names {
				if !strings.HasPrefix(name.Name, "Reason") || i >= len(vs.Values) {
					continue
				}
				lit, ok := vs.Values[i].(*ast.BasicLit)
				if !ok || lit.Kind != token.STRING {
					t.Fatalf("%s is not a string literal", name.Name)
				}
				v, err := strconv.Unquote(lit.Value)
				if err != nil {
					t.Fatal(err)
				}
				declared = append(declared, v)
			}
		}
	}
	listed := Reasons()
	for _, r := range declared {
		if !slices.Contains(listed, r) {
			t.Errorf("reason code %q is declared in reasons.go and missing from Reasons()", r)
		}
	}
	seen := map[string]bool{}
	for _, r := range listed {
		if !slices.Contains(declared, r) {
			t.Errorf("Reasons() lists %q, which reasons.go does not declare", r)
		}
		if seen[r] {
			t.Errorf("Reasons() lists %q twice", r)
		}
		seen[r] = true
	}
	if len(declared) < 100 {
		t.Fatalf("read %d reason codes from reasons.go; the parse missed some", len(declared))
	}
}
