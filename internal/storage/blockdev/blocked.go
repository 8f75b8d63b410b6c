package blockdev

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
)

// Task is a thread in uninterruptible sleep (state D).
type Task struct {
	PID, TID int
	Comm     string
	// WChan is the kernel function it waits in, when the kernel shows it ("" otherwise).
	WChan string
}

func (t Task) String() string {
	return fmt.Sprintf("%d/%d (%s) in %q", t.PID, t.TID, t.Comm, t.WChan)
}

// FUSEWait reports whether the task waits in FUSE code (a request its server has not
// answered): the hang a dead or stuck FUSE server leaves behind.
func (t Task) FUSEWait() bool {
	return strings.Contains(t.WChan, "fuse") || strings.Contains(t.WChan, "request_wait_answer")
}

// BlockedOnFUSE lists the host's threads in state D that wait in FUSE code, or whose wait
// channel the kernel hides (they might). The startup sweep reports them before and after
// it aborts the connections of dead servers: one still listed after is stuck on
// something the sweep does not own.
func BlockedOnFUSE() []Task {
	stats, _ := filepath.Glob("/proc/[0-9]*/task/[0-9]*/stat")
	var out []Task
	for _, p := range stats {
		raw, err := os.ReadFile(p)
		if err != nil {
			continue
		}
		s := string(raw)
		i := strings.LastIndexByte(s, ')')
		if i < 0 || i+2 >= len(s) || s[i+2] != 'D' {
			continue
		}
		t := Task{Comm: s[strings.IndexByte(s, '(')+1 : i]}
		taskDir := filepath.Dir(p)
		fmt.Sscan(filepath.Base(taskDir), &t.TID)
		fmt.Sscan(filepath.Base(filepath.Dir(filepath.Dir(taskDir))), &t.PID)
		if w, err := os.ReadFile(filepath.Join(taskDir, "wchan")); err == nil && string(w) != "0" {
			t.WChan = string(w)
		}
		if t.WChan == "" || t.FUSEWait() {
			out = append(out, t)
		}
	}
	return out
}
