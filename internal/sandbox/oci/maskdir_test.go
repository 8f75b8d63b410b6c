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
		dirs          []string
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
			rest, binds := maskBinds(masked, tc.dirs, tc.empty)
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

func TestMakeCgroupViewDir(t *testing.T) {
	data := t.TempDir()
	dir, err := makeCgroupViewDir(data, []string{"/sys/fs/cgroup/cpu", "/sys/fs/cgroup/memory"})
	if err != nil || dir != filepath.Join(data, cgroupViewDirName) {
		t.Fatalf("makeCgroupViewDir: %q, %v", dir, err)
	}
	// A later start with other hierarchies adds theirs and keeps the old ones (mount
	// points, maybe, in sandboxes that outlived the node).
	if _, err := makeCgroupViewDir(data, []string{"/sys/fs/cgroup/cpu,cpuacct"}); err != nil {
		t.Fatal(err)
	}
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, e := range ents {
		names = append(names, e.Name())
		if fi, err := e.Info(); err != nil || !fi.IsDir() || fi.Mode().Perm() != 0o555 {
			t.Errorf("%s: %v, %v; want a directory, mode 555", e.Name(), fi, err)
		}
	}
	if want := []string{"cpu", "cpu,cpuacct", "memory"}; !slices.Equal(names, want) {
		t.Errorf("cgroup view holds %v, want %v", names, want)
	}
}

// TestSandboxMaskedDirs checks that a masked directory is empty and read-only in a
// sandbox without a tmpfs (a superblock) of its own: under /sys with either runtime,
// under /proc with crun.
func TestSandboxMaskedDirs(t *testing.T) { eachRuntime(t, testSandboxMaskedDirs) }

func testSandboxMaskedDirs(t *testing.T, runtime string) {
	e := newTestBackend(t, func(c *Config) { c.Runtime = runtime })
	dirs := bindMaskedDirs(e.b.rt)
	if len(dirs) == 0 {
		t.Skip("no masked directory on this host the runtime lets a bind mask")
	}
	if runtime == "crun" && !slices.Contains(dirs, "/proc/acpi") && slices.Contains(hostMaskedDirs(), "/proc/acpi") {
		t.Errorf("crun: /proc/acpi is masked by a tmpfs (dirs bound over: %v)", dirs)
	}
	i := e.launch(t, "mask1", sandbox.Resources{CPUCount: 1, MemoryMB: 64})
	for _, d := range dirs {
		out, _ := e.sh(t, i, "ls -A "+d+"; touch "+d+"/x 2>/dev/null && echo writable; grep ' "+d+" ' /proc/self/mountinfo")
		lines := strings.Split(strings.TrimSpace(out), "\n")
		if len(lines) != 1 || strings.Contains(lines[0], " - tmpfs ") || !strings.Contains(lines[0], " "+d+" ") {
			t.Errorf("%s in the sandbox: want one mount line, not a tmpfs, and nothing listed or written:\n%s", d, out)
		}
	}
}
