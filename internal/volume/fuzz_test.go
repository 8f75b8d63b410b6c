package volume

import (
	"path"
	"strings"
	"testing"
)

// FuzzRel: whatever path a client sends, the name handed to os.Root is relative, clean
// and never climbs out with "..".
func FuzzRel(f *testing.F) {
	for _, s := range []string{"", "/", "a/b", "/../../etc/passwd", "a/../../b", "./x", "//x//y/", "a\x00b", ".."} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, p string) {
		r, err := rel(p)
		if err != nil {
			return
		}
		if r == "" || strings.HasPrefix(r, "/") || r == ".." || strings.HasPrefix(r, "../") || path.Clean(r) != r {
			t.Fatalf("rel(%q) = %q", p, r)
		}
	})
}
