package gate

import (
	"fmt"
	"net/url"
	"regexp"
	"strings"
)

// PaywallStyle is how the paywall page looks: its title, a logo and an accent colour. The zero value is the
// plain page.
type PaywallStyle struct {
	// Title heads the page and names its tab. Default "Payment required".
	Title string
	// Logo is the URL of an image shown above the title: a path on this site, an https URL, or a data: image.
	Logo string
	// Color is the accent colour of the page's buttons and heading, a CSS hex colour (#rgb or #rrggbb).
	Color string
}

var paywallColor = regexp.MustCompile(`^#([0-9a-fA-F]{3}|[0-9a-fA-F]{6})$`)

// Check says what is wrong with the style, naming the option.
func (s PaywallStyle) Check() error {
	if s.Color != "" && !paywallColor.MatchString(s.Color) {
		return fmt.Errorf("paywall color %q: want a CSS hex colour such as #2a5db0", s.Color)
	}
	if s.Logo != "" {
		u, err := url.Parse(s.Logo)
		ok := err == nil && (u.Scheme == "https" && u.Host != "" ||
			u.Scheme == "" && u.Host == "" && strings.HasPrefix(u.Path, "/") ||
			u.Scheme == "data" && strings.HasPrefix(u.Opaque, "image/"))
		if !ok {
			return fmt.Errorf("paywall logo %q: want a path on this site (/logo.png), an https URL or a data:image/ URL", s.Logo)
		}
	}
	if strings.ContainsAny(s.Title, "\r\n") {
		return fmt.Errorf("paywall title %q: want one line", s.Title)
	}
	return nil
}
