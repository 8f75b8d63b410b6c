package oci

import (
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/aenv-dev/aenv/internal/sandbox"
)

func TestMaskBinds(t *testing.T) {
	masked := []string{"/proc/acpi", "/proc/kcore", "/sys/firmware", "/sys/devices/virtual/powercap"}
	for _, tc := range []struct {
		name          string
		sysDirs       []string
		empty         string
		wantMasked    []string
		wantBindDests []string
	}{
		{"binds", []string{"/sys/firmware"}, "/data/empty", []string{"/proc/acpi", "/proc/kcore", "/sys/devices/virtual/powercap"}, []string{"/sys/firmware"}},
		{"both sys dirs", []string{"/sys/firmware", "/sys/devices/virtual/powercap"}, "/data/empty", []string{"/proc/acpi", "/proc/kcore"}, []string{"/sys/firmware", "/sys/devices/virtual/powercap"}},
		{"no empty dir", []string{"/sys/firmware"}, "", masked, nil},
		{"no sys dir on the host", nil, "/data/empty", masked, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rest, binds := maskBinds(masked, tc.sysDirs, tc.empty)
			if !slices.Equal(rest, tc.wantMasked) {
				t.Errorf("masked %v, want %v", rest, tc.wantMasked)
			}
			var dests []string
			for _, m := range binds {
				dests = append(dests, m.Destination)
				if m.Source != tc.empty || !slices.Contains(m.Options, "ro") || !slices.Contains(m.Options, "bind") {
					t.Errorf("bind %+v: want a read-only bind of %s", m, tc.empty)
				}
			}
			if !slices.Equal(dests, tc.wantBindDests) {
				t.Errorf("binds over %v, want %v", dests, tc.wantBindDests)
			}
		})
	}
}

func TestMakeEmptyDir(t *testing.T) {
	data := t.TempDir()
	dir, err := makeEmptyDir(data)
	if err != nil || dir != filepath.Join(data, emptyDirName) {
		t.Fatalf("makeEmptyDir: %q, %v", dir, err)
	}
	if fi, err := os.Stat(dir); err != nil || fi.Mode().Perm() != 0o555 {
		t.Fatalf("empty dir mode: %v, %v", fi, err)
	}
	if _, err := makeEmptyDir(data); err != nil {
		t.Fatalf("again: %v", err)
	}
	if err := os.Chmod(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "x"), nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := makeEmptyDir(data); err == nil {
		t.Fatal("a directory holding a file was taken for empty")
	}
}

// TestSandboxMaskedSysDirs checks that a masked directory under /sys is empty and
// read-only in a sandbox without a tmpfs (a superblock) of its own.
func TestSandboxMaskedSysDirs(t *testing.T) {
	if len(hostSysDirs()) == 0 {
		t.Skip("no masked directory under /sys on this host")
	}
	e := newTestBackend(t, nil)
	i := e.launch(t, "mask1", sandbox.Resources{CPUCount: 1, MemoryMB: 64})
	for _, d := range hostSysDirs() {
		out, _ := e.sh(t, i, "ls -A "+d+"; touch "+d+"/x 2>/dev/null && echo writable; grep ' "+d+" ' /proc/self/mountinfo")
		lines := strings.Split(strings.TrimSpace(out), "\n")
		if len(lines) != 1 || strings.Contains(lines[0], " - tmpfs ") || !strings.Contains(lines[0], " "+d+" ") {
			t.Errorf("%s in the sandbox: want one mount line, not a tmpfs, and nothing listed or written:\n%s", d, out)
		}
	}
}
