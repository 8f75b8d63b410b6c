package secret

import (
	"strings"
	"testing"
)

// FuzzExpand: expansion never panics, replaces every known placeholder and never returns
// a partial result with an error.
func FuzzExpand(f *testing.F) {
	s, err := Open(f.TempDir())
	if err != nil {
		f.Fatal(err)
	}
	if _, err := s.Create("o", "k", "VALUE", nil); err != nil {
		f.Fatal(err)
	}
	for _, v := range []string{"", "${e2b.secrets.k}", "a${e2b.secrets.k}b${e2b.secrets.k}", "${e2b.secrets.}", "${e2b.secrets.x}", "${e2b.secrets.k", "$${e2b.secrets.k}}"} {
		f.Add(v)
	}
	f.Fuzz(func(t *testing.T, v string) {
		out, err := s.Expand("o", v)
		if err != nil {
			if out != "" {
				t.Fatalf("error with output %q", out)
			}
			return
		}
		// The value has no braces, so no placeholder can survive or be formed.
		if strings.Contains(out, "${e2b.secrets.k}") {
			t.Fatalf("Expand(%q) = %q kept a placeholder", v, out)
		}
	})
}
