package node

import (
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
)

// TestRaiseHostLimits: a limit below its minimum is raised to it, one at or above is
// left alone (never lowered), and an unreadable or garbled one changes nothing.
func TestRaiseHostLimits(t *testing.T) {
	tests := []struct {
		name, cur, want string
	}{
		{"below", "32768\n", "4194304"},
		{"above", "5000000\n", "5000000\n"},
		{"equal", "4194304\n", "4194304\n"},
		{"garbled", "lots\n", "lots\n"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			dir := t.TempDir()
			path := filepath.Join(dir, "kernel", "pid_max")
			if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(path, []byte(tt.cur), 0o644); err != nil {
				t.Fatal(err)
			}
			raiseHostLimits(dir, hostLimits, slog.New(slog.NewTextHandler(io.Discard, nil)))
			got, err := os.ReadFile(path)
			if err != nil || string(got) != tt.want {
				t.Errorf("pid_max = %q (%v), want %q", got, err, tt.want)
			}
		})
	}
	// Missing: logged, nothing created.
	dir := t.TempDir()
	var log strings.Builder
	raiseHostLimits(dir, hostLimits, slog.New(slog.NewTextHandler(&log, nil)))
	if _, err := os.Stat(filepath.Join(dir, "kernel", "pid_max")); err == nil || !strings.Contains(log.String(), "kernel.pid_max") {
		t.Errorf("missing limit: created it, or log %q does not name it", log.String())
	}
}

// TestRaiseOpenFiles: the soft limit is raised (to fs.nr_open when that is below the
// wanted value), the hard one too where the process may (CAP_SYS_RESOURCE), children
// started afterwards inherit both, and a lower nr_open lowers nothing.
func TestRaiseOpenFiles(t *testing.T) {
	var start syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &start); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = syscall.Setrlimit(syscall.RLIMIT_NOFILE, &start) })
	procSys := func(nrOpen uint64) string {
		dir := t.TempDir()
		if err := os.MkdirAll(filepath.Join(dir, "fs"), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, "fs", "nr_open"), []byte(strconv.FormatUint(nrOpen, 10)+"\n"), 0o644); err != nil {
			t.Fatal(err)
		}
		return dir
	}
	discard := slog.New(slog.NewTextHandler(io.Discard, nil))
	check := func(want syscall.Rlimit) {
		t.Helper()
		var got syscall.Rlimit
		if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &got); err != nil || got != want {
			t.Fatalf("limit %+v (%v), want %+v", got, err, want)
		}
		out, err := exec.Command("sh", "-c", "ulimit -Sn; ulimit -Hn").Output()
		if w := fmt.Sprintf("%d\n%d\n", want.Cur, want.Max); err != nil || string(out) != w {
			t.Errorf("a child sees %q (%v), want %q", out, err, w)
		}
	}

	// A soft limit below the hard one: raised to the hard one (no capability needed).
	low := syscall.Rlimit{Cur: start.Max / 2, Max: start.Max}
	if err := syscall.Setrlimit(syscall.RLIMIT_NOFILE, &low); err != nil {
		t.Fatal(err)
	}
	raiseOpenFiles(procSys(start.Max/4), 1<<40, discard)
	check(low)
	raiseOpenFiles(procSys(start.Max), 1<<40, discard)
	check(start)

	// Past the hard limit: raised where the process holds CAP_SYS_RESOURCE, else left.
	var log strings.Builder
	raiseOpenFiles(procSys(start.Max+7), 1<<40, slog.New(slog.NewTextHandler(&log, nil)))
	if strings.Contains(log.String(), "could not raise") {
		if start.Max >= openFilesFloor && strings.Contains(log.String(), "level=WARN") {
			t.Errorf("warned with a limit above the floor: %s", log.String())
		}
		t.Logf("no CAP_SYS_RESOURCE here: %s", strings.TrimSpace(log.String()))
		check(start)
		return
	}
	check(syscall.Rlimit{Cur: start.Max + 7, Max: start.Max + 7})
}
