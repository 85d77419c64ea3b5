package gate

import (
	"strings"
	"testing"
)

func TestTheResourceAPaymentBuysIsItsMethodHostAndRequestURIWithoutSchemeOrPort(t *testing.T) {
	long := "/files/" + strings.Repeat("a", 4000)
	for _, tc := range []struct {
		name, method, host, uri, want string
	}{
		{"a host and a path", "GET", "example.com", "/report.pdf", "GET example.com/report.pdf"},
		{"the port left out", "GET", "example.com:8443", "/report.pdf?v=2", "GET example.com/report.pdf?v=2"},
		{"the host in lower case, without a final dot", "GET", "Example.COM.:80", "/a", "GET example.com/a"},
		{"an IPv6 host keeps its brackets", "HEAD", "[::1]:8080", "/a", "HEAD [::1]/a"},
		{"an IPv6 host without a port", "GET", "[::1]", "/a", "GET [::1]/a"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := resourceKey(tc.method, tc.host, tc.uri); got != tc.want {
				t.Errorf("resourceKey(%q, %q, %q) = %q, want %q", tc.method, tc.host, tc.uri, got, tc.want)
			}
		})
	}
	a, b := resourceKey("GET", "example.com", long+"x"), resourceKey("GET", "example.com", long+"y")
	if len(a) > maxResourceLen || a == b || !strings.HasPrefix(a, "GET example.com/files/aaa") {
		t.Errorf("two long URIs that differ at the end: %d bytes, equal %t; want at most %d, different, readable", len(a), a == b, maxResourceLen)
	}
	if a != resourceKey("GET", "example.com", long+"x") {
		t.Error("the same long URI gives two resources")
	}
	if shown := shownResource(a); len(shown) > shownResourceLen+3 {
		t.Errorf("an answer names a resource of %d bytes", len(shown))
	}
}
