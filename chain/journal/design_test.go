package journal

import (
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
)

// designDoc is the document of a payment's life, from this package's folder.
const designDoc = "../../docs/DESIGN.md"

// designStructs are the types whose every field the design document names: where a payment stands is read from
// them. Every field, not a chosen few: whether a new field marks where a payment stands is a judgement the test
// cannot make, so the one who adds it makes it, in a line of the document.
var designStructs = []string{"Record", "Handoff", "Hold"}

// designNames is what this package's source says a payment can be: its states, the fields of designStructs, the
// methods of those types (which the document may name, and need not), the tables of the PostgreSQL store and the
// buckets of the bbolt store; each with where it is declared.
type designNames struct {
	states, fields, tables, buckets map[string]string
	methods                         map[string]bool
}

// readDesignNames parses the package's non-test Go files in dir.
func readDesignNames(t *testing.T, dir string) designNames {
	t.Helper()
	fset := token.NewFileSet()
	pkgs, err := parser.ParseDir(fset, dir, func(fi fs.FileInfo) bool { return !strings.HasSuffix(fi.Name(), "_test.go") }, parser.SkipObjectResolution)
	if err != nil {
		t.Fatalf("parsing the journal's source: %v", err)
	}
	n := designNames{states: map[string]string{}, fields: map[string]string{}, tables: map[string]string{},
		buckets: map[string]string{}, methods: map[string]bool{}}
	at := func(p token.Pos) string {
		pos := fset.Position(p)
		return fmt.Sprintf("%s:%d", filepath.Base(pos.Filename), pos.Line)
	}
	table := regexp.MustCompile(`(?i)CREATE TABLE (?:IF NOT EXISTS )?(\w+)`)
	for _, pkg := range pkgs {
		for _, f := range pkg.Files {
			ast.Inspect(f, func(node ast.Node) bool {
				switch d := node.(type) {
				case *ast.FuncDecl:
					if d.Recv != nil && len(d.Recv.List) == 1 {
						if recv := typeName(d.Recv.List[0].Type); slices.Contains(designStructs, recv) {
							n.methods[recv+"."+d.Name.Name] = true
						}
					}
				case *ast.ValueSpec:
					for i, name := range d.Names {
						switch {
						case isStateSpec(d, i):
							n.states[name.Name] = at(name.Pos())
						case strings.HasPrefix(name.Name, "bucket"):
							n.buckets[name.Name] = at(name.Pos())
						}
					}
				case *ast.TypeSpec:
					st, ok := d.Type.(*ast.StructType)
					if !ok || !slices.Contains(designStructs, d.Name.Name) {
						return true
					}
					for _, fl := range st.Fields.List {
						for _, name := range fl.Names {
							n.fields[d.Name.Name+"."+name.Name] = at(name.Pos())
						}
						if len(fl.Names) == 0 { // an embedded field is named by its type
							n.fields[d.Name.Name+"."+typeName(fl.Type)] = at(fl.Pos())
						}
					}
				case *ast.BasicLit:
					if d.Kind != token.STRING {
						return true
					}
					s, err := strconv.Unquote(d.Value)
					if err != nil {
						return true
					}
					for _, m := range table.FindAllStringSubmatch(s, -1) {
						n.tables[m[1]] = at(d.Pos())
					}
				}
				return true
			})
		}
	}
	return n
}

// isStateSpec reports whether the i-th name of a const or var spec is a State: declared with type State, or
// valued State(...).
func isStateSpec(d *ast.ValueSpec, i int) bool {
	if id, ok := d.Type.(*ast.Ident); ok {
		return id.Name == "State"
	}
	if i < len(d.Values) {
		if call, ok := d.Values[i].(*ast.CallExpr); ok {
			if id, ok := call.Fun.(*ast.Ident); ok {
				return id.Name == "State"
			}
		}
	}
	return false
}

// typeName is the name of a type expression T or *T; "" for any other.
func typeName(e ast.Expr) string {
	if star, ok := e.(*ast.StarExpr); ok {
		e = star.X
	}
	if id, ok := e.(*ast.Ident); ok {
		return id.Name
	}
	return ""
}

// namedIn returns the spans of doc written as code (between backticks).
func namedIn(doc string) map[string]bool {
	spans := map[string]bool{}
	for _, m := range regexp.MustCompile("`([^`\n]+)`").FindAllStringSubmatch(doc, -1) {
		spans[m[1]] = true
	}
	return spans
}

// TestTheDesignDocumentNamesEveryStateAndMarkOfAPayment keeps docs/DESIGN.md true to the journal: every State, every
// field of Record, Handoff and Hold, every table of the PostgreSQL store and every bucket of the bbolt store is named
// in it as code (`StateClaimed`, `Record.Served`, `x402_busy`, `bucketServed`), and it names no state or field the
// journal does not have. A new state or mark of a payment fails here until the document says who moves it and what
// a crash does to it.
func TestTheDesignDocumentNamesEveryStateAndMarkOfAPayment(t *testing.T) {
	raw, err := os.ReadFile(designDoc)
	if err != nil {
		t.Fatalf("reading the design document: %v", err)
	}
	named := namedIn(string(raw))
	n := readDesignNames(t, ".")

	// The parse must see what is known to be there, or every check below would pass on nothing.
	for _, want := range []struct {
		in   map[string]string
		name string
	}{
		{n.states, "StateClaimed"}, {n.states, "StateBroadcast"}, {n.states, "StateFinal"},
		{n.fields, "Record.Served"}, {n.fields, "Record.Async"}, {n.fields, "Record.Handoff"}, {n.fields, "Handoff.Taker"},
		{n.fields, "Hold.Served"}, {n.tables, "x402_records"}, {n.tables, "x402_busy"}, {n.tables, "x402_holds"},
		{n.buckets, "bucketServed"},
	} {
		if _, ok := want.in[want.name]; !ok {
			t.Fatalf("the journal's source, as this test reads it, has no %s: the test no longer sees what it guards; fix readDesignNames", want.name)
		}
	}

	for _, kind := range []struct {
		what  string
		names map[string]string
	}{
		{"the state", n.states}, {"the field", n.fields}, {"the PostgreSQL table", n.tables}, {"the bbolt bucket", n.buckets},
	} {
		for _, name := range slices.Sorted(func(yield func(string) bool) {
			for k := range kind.names {
				if !yield(k) {
					return
				}
			}
		}) {
			if !named[name] {
				t.Errorf("%s %s (%s) is not named in docs/DESIGN.md: write `%s` there, saying what it marks, who moves it, and what a crash, a reload, a takeover and a fault do to it",
					kind.what, name, kind.names[name], name)
			}
		}
	}

	state := regexp.MustCompile(`^State[A-Z]\w*$`)
	member := regexp.MustCompile(`^(` + strings.Join(designStructs, "|") + `)\.(\w+)$`)
	for span := range named {
		switch {
		case state.MatchString(span):
			if _, ok := n.states[span]; !ok {
				t.Errorf("docs/DESIGN.md names the state `%s`, which the journal does not have", span)
			}
		case member.MatchString(span):
			if _, ok := n.fields[span]; !ok && !n.methods[span] {
				t.Errorf("docs/DESIGN.md names `%s`, which is no field or method of the journal's types", span)
			}
		}
	}
}

// TestEveryTestTheDesignDocumentNamesExists keeps the document's "which test shows it" true: every test function it
// names (`TestSomething`) is declared in a _test.go file of the repository.
func TestEveryTestTheDesignDocumentNamesExists(t *testing.T) {
	raw, err := os.ReadFile(designDoc)
	if err != nil {
		t.Fatalf("reading the design document: %v", err)
	}
	declared := map[string]bool{}
	fn := regexp.MustCompile(`(?m)^func (Test\w+)\(`)
	err = filepath.WalkDir("../..", func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && (d.Name() == "node_modules" || d.Name() == "testdata" || strings.HasPrefix(d.Name(), ".") && path != "../..") {
			return filepath.SkipDir
		}
		if d.IsDir() || !strings.HasSuffix(path, "_test.go") {
			return nil
		}
		src, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		for _, m := range fn.FindAllSubmatch(src, -1) {
			declared[string(m[1])] = true
		}
		return nil
	})
	if err != nil {
		t.Fatalf("reading the repository's tests: %v", err)
	}
	if !declared["TestEveryTestTheDesignDocumentNamesExists"] {
		t.Fatal("the walk of the repository's tests did not find this test: it reads the wrong folder")
	}
	test := regexp.MustCompile(`^Test[A-Z]\w*$`)
	count := 0
	for span := range namedIn(string(raw)) {
		if !test.MatchString(span) {
			continue
		}
		count++
		if !declared[span] {
			t.Errorf("docs/DESIGN.md names the test %s, which no _test.go file declares: renamed or removed, the document must say which test shows it now, or that none does", span)
		}
	}
	if count == 0 {
		t.Error("docs/DESIGN.md names no test: it must say which test shows each state's fate")
	}
}
