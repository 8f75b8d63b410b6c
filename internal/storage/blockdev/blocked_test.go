package blockdev

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"testing"
)

func TestBlockedOnFUSE(t *testing.T) {
	proc := t.TempDir()
	task := func(pid, tid int, comm, state, wchan string) {
		dir := filepath.Join(proc, fmt.Sprint(pid), "task", fmt.Sprint(tid))
		if err := os.MkdirAll(dir, 0o755); err != nil {
			t.Fatal(err)
		}
		stat := fmt.Sprintf("%d (%s) %s 1 1 1 0 -1 4194560 0 0 0 0 0 0 0 0 20 0 1 0", tid, comm, state)
		if err := os.WriteFile(filepath.Join(dir, "stat"), []byte(stat), 0o644); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, "wchan"), []byte(wchan), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	task(10, 10, "sleeper", "S", "do_sys_poll")
	task(10, 11, "reader) D (x", "D", "request_wait_answer") // a comm with ") D (" in it
	task(20, 20, "disk", "D", "io_schedule")
	task(30, 30, "hidden", "D", "0")
	task(30, 31, "fuse", "D", "fuse_wait_on_page_writeback")
	if err := os.MkdirAll(filepath.Join(proc, "self"), 0o755); err != nil { // not a pid
		t.Fatal(err)
	}
	var got []string
	for _, tk := range blockedOnFUSE(proc) {
		got = append(got, tk.String())
	}
	slices.Sort(got)
	want := []string{
		`10/11 (reader) D (x) in "request_wait_answer"`,
		`30/30 (hidden) in ""`,
		`30/31 (fuse) in "fuse_wait_on_page_writeback"`,
	}
	if !slices.Equal(got, want) {
		t.Errorf("blocked = %q, want %q", got, want)
	}
}

// BenchmarkBlockedOnFUSE scans this host's real /proc, as the startup sweep does.
func BenchmarkBlockedOnFUSE(b *testing.B) {
	for b.Loop() {
		BlockedOnFUSE()
	}
}
