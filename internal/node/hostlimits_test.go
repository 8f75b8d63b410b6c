package node

import (
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
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
