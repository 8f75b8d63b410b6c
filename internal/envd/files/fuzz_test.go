package files

import (
	"mime"
	"strings"
	"testing"
)

func FuzzPartNames(f *testing.F) {
	for _, s := range []string{
		`form-data; name="file"; filename="/home/user/a.txt"`,
		`form-data; name="file"; filename="rel/dir/b.txt"`,
		`form-data; name=file; filename=ünï code.txt`,
		`form-data; name="file"; filename="quo\"te.txt"`,
		`form-data; name="file"; filename*=UTF-8''%e2%82%ac%20x.txt`,
		`form-data; name="file"; filename="a;b.txt"`,
		`form-data`,
		`;;;=`,
	} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, d string) {
		name, filename := partNames(d)
		_, _ = name, filename
		// A well-formed header built from the parsed name must parse back to the same name.
		if filename != "" && !strings.ContainsAny(filename, "\x00\r\n") {
			re := mime.FormatMediaType("form-data", map[string]string{"name": "file", "filename": filename})
			if re != "" {
				if n2, f2 := partNames(re); n2 != "file" || f2 != filename {
					t.Fatalf("round trip %q -> %q -> %q %q", filename, re, n2, f2)
				}
			}
		}
	})
}

func TestPartNamesKeepsDirectories(t *testing.T) {
	for d, want := range map[string]string{
		`form-data; name="file"; filename="/home/user/a.txt"`: "/home/user/a.txt",
		`form-data; name="file"; filename="rel/dir/b.txt"`:    "rel/dir/b.txt",
		`form-data; name=file; filename=ünï.txt`:              "ünï.txt",
		`form-data; name="file"; filename="a;b.txt"`:          "a;b.txt",
	} {
		if n, f := partNames(d); n != "file" || f != want {
			t.Errorf("%s: %q %q", d, n, f)
		}
	}
}

func TestNegotiateGzip(t *testing.T) {
	for h, want := range map[string][2]bool{
		"":                     {false, true},
		"gzip":                 {true, true},
		"gzip, deflate":        {false, true},
		"gzip, deflate, br":    {false, true},
		"identity":             {false, true},
		"gzip;q=0":             {false, true},
		"*":                    {false, true},
		"br, identity;q=0":     {false, false},
		"gzip, identity;q=0":   {true, true},
		"*;q=0":                {false, false},
		"deflate, *;q=0, gzip": {true, true},
		"x-gzip":               {true, true},
		"GZIP ; q=1":           {true, true},
	} {
		g, ok := negotiateGzip(h)
		if g != want[0] || ok != want[1] {
			t.Errorf("%q: gzip=%v ok=%v, want %v", h, g, ok, want)
		}
	}
}
