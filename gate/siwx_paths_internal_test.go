package gate

import "testing"

// TestAGrantOfPathsJudgesThePathAsTheServerBehindReadsIt: "/reports/../admin" is "/admin" to Caddy's matchers and
// file server, so a grant of /reports/* does not cover it; an escaped dot segment left in the path covers nothing.
func TestAGrantOfPathsJudgesThePathAsTheServerBehindReadsIt(t *testing.T) {
	a := &Access{Paths: []string{"/reports/*", "/exact"}}
	for _, p := range []string{"/reports/../admin/keys", "/reports/./../admin", "/reports/%2e%2e/admin", "/reports/%2E%2E%2Fadmin", "/exact/../other"} {
		if a.covers(p) {
			t.Errorf("a grant of %v covers %q", a.Paths, p)
		}
	}
	for _, p := range []string{"/reports/q1", "/reports/", "/reports/a/./b", "/exact", "/reports//a"} {
		if !a.covers(p) {
			t.Errorf("a grant of %v does not cover %q", a.Paths, p)
		}
	}
}
