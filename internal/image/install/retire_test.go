package install

import (
	"os"
	"path/filepath"
	"slices"
	"testing"
)

func TestRetireAndSweep(t *testing.T) {
	data := t.TempDir()
	mk := func(id string) string {
		d := filepath.Join(data, TemplatesDir, id, "rootfs")
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
		return d
	}
	old, used, current, base := mk("old"), mk("used"), mk("current"), mk("base")
	build := filepath.Join(data, TemplatesDir, "built", "builds", "b1", "rootfs")
	os.MkdirAll(build, 0o755)
	for _, tc := range []struct {
		dir  string
		want bool
	}{
		{old, true}, {used, true},
		{base, false},  // the node's own base template
		{build, false}, // a build's directory: pruned by the builder
		{filepath.Join(data, "elsewhere"), false}, // not under templates/
		{filepath.Join(data, TemplatesDir, "gone", "rootfs"), false},
		{filepath.Join(data, TemplatesDir, "..", "x", "rootfs"), false},
	} {
		got, err := Retire(data, tc.dir)
		if err != nil || got != tc.want {
			t.Errorf("Retire(%s) = %v, %v; want %v", tc.dir, got, err, tc.want)
		}
	}
	removed, err := SweepRetired(data, func(d string) bool { return d == used })
	if err != nil || !slices.Equal(removed, []string{filepath.Dir(old)}) {
		t.Fatalf("sweep removed %q, %v; want only %s", removed, err, filepath.Dir(old))
	}
	for _, d := range []string{used, current, base, build} {
		if _, err := os.Stat(d); err != nil {
			t.Errorf("%s removed: %v", d, err)
		}
	}
	// Once its last sandbox is gone, the next sweep removes it.
	if removed, err := SweepRetired(data, nil); err != nil || !slices.Equal(removed, []string{filepath.Dir(used)}) {
		t.Errorf("second sweep removed %q, %v", removed, err)
	}
}
