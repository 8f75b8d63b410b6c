package bench

import (
	"os"
	"path/filepath"
	"testing"
)

func TestSandboxPSS(t *testing.T) {
	root := t.TempDir()
	proc := func(pid, cmdline, cgroup, rollup string) {
		d := filepath.Join(root, pid)
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
		for name, body := range map[string]string{"cmdline": cmdline, "cgroup": cgroup, "smaps_rollup": rollup} {
			if body == "" {
				continue
			}
			if err := os.WriteFile(filepath.Join(d, name), []byte(body), 0o644); err != nil {
				t.Fatal(err)
			}
		}
	}
	rollup := func(kb string) string {
		return "55d0-7ffd ---p 00000000 00:00 0 [rollup]\nRss: 99999 kB\nPss: " + kb + " kB\nPss_Anon: 1 kB\n"
	}
	proc("10", "qemu-system-x86_64\x00-pidfile\x00/data/sandboxes/ia1b2c3/qemu.pid\x00", "0::/aenv/other\n", rollup("30000"))
	proc("11", "sleep\x00100\x00", "0::/aenv/ia1b2c3\n", rollup("2000"))
	proc("12", "bash\x00", "0::/aenv/izzz\n", rollup("5000"))
	proc("13", "qemu\x00ia1b2c3\x00", "", "") // ended before its smaps were read
	proc("14", "qemu\x00ia1b2c3\x00", "", "Rss: 1 kB\n")
	if err := os.MkdirAll(filepath.Join(root, "self"), 0o755); err != nil {
		t.Fatal(err)
	}

	for _, tc := range []struct {
		id    string
		pss   int64
		procs int
		err   bool
	}{
		{"ia1b2c3", (30000 + 2000) << 10, 2, false},
		{"izzz", 5000 << 10, 1, false},
		{"inone", 0, 0, false},
		{"", 0, 0, true},
	} {
		t.Run(tc.id, func(t *testing.T) {
			pss, procs, err := SandboxPSS(root, tc.id)
			if (err != nil) != tc.err {
				t.Fatalf("err = %v, want error %v", err, tc.err)
			}
			if pss != tc.pss || procs != tc.procs {
				t.Errorf("SandboxPSS(%q) = %d bytes in %d processes, want %d in %d", tc.id, pss, procs, tc.pss, tc.procs)
			}
		})
	}
}
