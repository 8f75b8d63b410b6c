package vmm

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// ErrNotRunning means Adopt found no live QEMU for the pidfile: none was written, the
// process is gone, or its pid now names another process.
var ErrNotRunning = errors.New("vmm: no QEMU runs for this pidfile")

// Adopt takes over a QEMU an earlier process started (Start, then that process died or
// restarted): the process named by pidFile, verified to be QEMU started with that very
// pidfile and that QMP socket, so a reused pid is never taken for it. It reconnects to
// its monitor (QEMU accepts one client at a time; the dead process's connection is gone)
// and watches its exit through a pidfd, since it is not this process's child.
//
// The Machine's Config has the two paths and the guest RAM (read from the command line,
// so snapshots know whether the RAM is shared); Args gives the whole command line, for
// the caller to check what it expects (its drives). Stop, Kill and the snapshot methods
// work as for a machine this process started.
func Adopt(ctx context.Context, pidFile, qmpSocket string) (*Machine, error) {
	raw, err := os.ReadFile(pidFile)
	if errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("%w: %s missing", ErrNotRunning, pidFile)
	}
	if err != nil {
		return nil, fmt.Errorf("vmm: pidfile: %w", err)
	}
	pid, err := strconv.Atoi(strings.TrimSpace(string(raw)))
	if err != nil || pid <= 1 {
		return nil, fmt.Errorf("vmm: pidfile %s: malformed %q", pidFile, raw)
	}
	// The pidfd first: once open it names this process whatever happens to the pid, so
	// the checks below cannot be fooled by a reuse between them and the watch.
	pfd, err := unix.PidfdOpen(pid, 0)
	if err != nil {
		return nil, fmt.Errorf("%w: pid %d: %v", ErrNotRunning, pid, err)
	}
	args, err := procArgs(pid)
	if err != nil || !hasArgPair(args, "-pidfile", pidFile) || !hasArgPair(args, "-qmp", "unix:"+optValue(qmpSocket)+",server=on,wait=off") {
		unix.Close(pfd)
		return nil, fmt.Errorf("%w: pid %d is not the QEMU of %s", ErrNotRunning, pid, pidFile)
	}
	cfg := Config{PIDFile: pidFile, QMPSocket: qmpSocket}
	if obj, ok := ArgValue(args, "-object", "memory-backend-file,id="+MemoryBackendID+","); ok {
		cfg.Memory = parseMemory(obj)
	}
	m := &Machine{cfg: cfg, pid: pid, exited: make(chan struct{}), args: args}
	go func() {
		defer close(m.exited)
		defer unix.Close(pfd)
		fds := []unix.PollFd{{Fd: int32(pfd), Events: unix.POLLIN}}
		for {
			// Readable once the process has exited (a zombie counts).
			if _, err := unix.Poll(fds, -1); err == nil || !errors.Is(err, unix.EINTR) {
				return
			}
		}
	}()
	q, err := m.dialQMP(ctx)
	if err != nil {
		// Not ours to kill: the caller decides (it may kill by pidfile).
		return nil, fmt.Errorf("vmm: adopt QEMU %d: %w", pid, err)
	}
	m.qmp = q
	return m, nil
}

// Args is QEMU's command line, without the binary, for a machine Adopt found (nil for one
// this process started: Config says how).
func (m *Machine) Args() []string { return m.args }

// procArgs is a process's command line without argv[0].
func procArgs(pid int) ([]string, error) {
	raw, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/cmdline")
	if err != nil {
		return nil, err
	}
	parts := strings.Split(string(bytes.TrimSuffix(raw, []byte{0})), "\x00")
	if len(parts) < 1 {
		return nil, errors.New("vmm: empty command line")
	}
	return parts[1:], nil
}

func hasArgPair(args []string, flag, value string) bool {
	for i := 0; i+1 < len(args); i++ {
		if args[i] == flag && args[i+1] == value {
			return true
		}
	}
	return false
}

// ArgValue returns the value of the first option flag (e.g. "-drive") whose value
// starts with prefix (e.g. "id=root,"), and whether there is one.
func ArgValue(args []string, flag, prefix string) (string, bool) {
	for i := 0; i+1 < len(args); i++ {
		if args[i] == flag && strings.HasPrefix(args[i+1], prefix) {
			return args[i+1], true
		}
	}
	return "", false
}

// parseMemory reads Args' memory-backend-file object back (values without commas: the
// paths this package's callers use have none).
func parseMemory(obj string) Memory {
	var m Memory
	for _, kv := range strings.Split(obj, ",") {
		k, v, _ := strings.Cut(kv, "=")
		switch k {
		case "size":
			m.SizeMiB, _ = strconv.Atoi(strings.TrimSuffix(v, "M"))
		case "mem-path":
			m.Path = v
		case "share":
			m.Share = v == "on"
		}
	}
	return m
}
