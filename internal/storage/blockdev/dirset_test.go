package blockdev

import "testing"

func TestDirSet(t *testing.T) {
	keep := []string{"/data/dp/a", "/data/dp/b/", "/srv/x"}
	for _, tc := range []struct {
		path string
		want bool
	}{
		{"/data/dp/a", true},
		{"/data/dp/a/disk", true},
		{"/data/dp/a/x/y/z", true},
		{"/data/dp/b", true}, // kept as given with a trailing slash
		{"/data/dp/b/disk", true},
		{"/data/dp/ab", false},
		{"/data/dp/ab/disk", false},
		{"/data/dp", false},
		{"/data", false},
		{"/", false},
		{"", false},
		{"disk", false},
		{"/srv/x", true},
		{"/srv/xy", false},
	} {
		if got := newDirSet(keep).holds(tc.path); got != tc.want {
			t.Errorf("holds(%q) = %v, want %v", tc.path, got, tc.want)
		}
		// Agrees with under for every clean kept directory.
		clean := false
		for _, k := range []string{"/data/dp/a", "/data/dp/b", "/srv/x"} {
			clean = clean || under(tc.path, k)
		}
		if clean != tc.want {
			t.Errorf("under(%q, keep) = %v, want %v", tc.path, clean, tc.want)
		}
	}
	if newDirSet(nil).holds("/data") {
		t.Error("an empty set holds /data")
	}
	if !newDirSet([]string{"/"}).holds("/data/x") {
		t.Error(`a set holding "/" does not hold /data/x`)
	}
}

func TestUnder(t *testing.T) {
	for _, tc := range []struct {
		p, root string
		want    bool
	}{
		{"/a/b", "/a/b", true},
		{"/a/b/c", "/a/b", true},
		{"/a/bc", "/a/b", false},
		{"/a", "/a/b", false},
		{"", "/a", false},
	} {
		if got := under(tc.p, tc.root); got != tc.want {
			t.Errorf("under(%q, %q) = %v, want %v", tc.p, tc.root, got, tc.want)
		}
	}
}
