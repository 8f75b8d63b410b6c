package blockdev

import (
	"fmt"
	"os"
	"strconv"
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
//
// It walks /proc by hand: a glob of /proc/*/task/*/stat lists every thread's directory to
// match "stat" in it, which made this scan most of a node restart on a busy host.
func BlockedOnFUSE() []Task { return blockedOnFUSE("/proc") }

func blockedOnFUSE(proc string) []Task {
	var out []Task
	for _, pid := range numericEntries(proc) {
		for _, tid := range numericEntries(fmt.Sprintf("%s/%d/task", proc, pid)) {
			taskDir := fmt.Sprintf("%s/%d/task/%d", proc, pid, tid)
			raw, err := os.ReadFile(taskDir + "/stat")
			if err != nil {
				continue
			}
			s := string(raw)
			i := strings.LastIndexByte(s, ')')
			if i < 0 || i+2 >= len(s) || s[i+2] != 'D' {
				continue
			}
			t := Task{PID: pid, TID: tid, Comm: s[strings.IndexByte(s, '(')+1 : i]}
			if w, err := os.ReadFile(taskDir + "/wchan"); err == nil && string(w) != "0" {
				t.WChan = string(w)
			}
			if t.WChan == "" || t.FUSEWait() {
				out = append(out, t)
			}
		}
	}
	return out
}

// numericEntries lists the names of dir that are numbers (pids, tids).
func numericEntries(dir string) []int {
	f, err := os.Open(dir)
	if err != nil {
		return nil
	}
	defer f.Close()
	names, _ := f.Readdirnames(-1)
	ids := make([]int, 0, len(names))
	for _, n := range names {
		if id, err := strconv.Atoi(n); err == nil {
			ids = append(ids, id)
		}
	}
	return ids
}
