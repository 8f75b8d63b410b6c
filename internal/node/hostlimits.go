package node

import (
	"context"
	"errors"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
)

// hostLimit is a kernel setting that caps how many sandboxes a node holds, and the value
// the node raises it to when it is lower (never lowers it).
type hostLimit struct {
	key string // under /proc/sys, with slashes
	min int64
	why string
}

// hostLimits are raised at start (docs/operations.md, "Density and host limits"). Every
// idle OCI sandbox holds about 7 tasks (envd and its Go runtime threads), and
// kernel.pid_max counts tasks, not processes: Linux's default of 32768 stops a node near
// 4 000 sandboxes with EAGAIN from clone. 4194304 is the largest value and systemd's own
// default on 64-bit hosts.
var hostLimits = []hostLimit{
	{key: "kernel/pid_max", min: 4194304, why: "each sandbox holds ~8 tasks; the default 32768 caps a node near 4000 sandboxes"},
}

// raiseHostLimits raises each limit below its minimum under procSys ("/proc/sys"),
// logging what it changed. A limit it cannot read or write is logged, not fatal: the
// node runs, with the lower ceiling.
func raiseHostLimits(procSys string, limits []hostLimit, log *slog.Logger) {
	for _, l := range limits {
		path := filepath.Join(procSys, l.key)
		cur, err := readSysctl(path)
		if garbled := new(*strconv.NumError); err != nil && !errors.As(err, garbled) {
			log.Warn("host limit unreadable", "key", sysctlName(l.key), "err", err)
			continue
		}
		if err != nil || cur >= l.min {
			continue
		}
		if err := os.WriteFile(path, []byte(strconv.FormatInt(l.min, 10)), 0o644); err != nil {
			log.Warn("could not raise a host limit", "key", sysctlName(l.key), "from", cur, "to", l.min, "why", l.why, "err", err)
			continue
		}
		log.Info("raised a host limit", "key", sysctlName(l.key), "from", cur, "to", l.min, "why", l.why)
	}
}

// readSysctl reads the integer a /proc/sys file holds.
func readSysctl(path string) (int64, error) {
	raw, err := os.ReadFile(path)
	if err != nil {
		return 0, err
	}
	return strconv.ParseInt(strings.TrimSpace(string(raw)), 10, 64)
}

// sysctlName spells a /proc/sys path as sysctl does (kernel.pid_max).
func sysctlName(key string) string { return strings.ReplaceAll(key, "/", ".") }

// openFilesWant is the open-file limit the node raises its own to; the data plane and the
// runtimes it starts inherit it. Each held sandbox keeps ~2 descriptors open in the node
// (its user namespace, its loop device) and ~3 in the data plane (/dev/fuse, its upper
// data and index): 5 000 sandboxes need ~15 000 there, more than many hosts give a
// service or a login shell (1 024 to 20 000).
const openFilesWant = 1 << 20

// openFilesFloor is the limit below which failing to raise it is worth a warning: it
// holds ~5 000 sandboxes.
const openFilesFloor = 16384

// raiseOpenFiles raises this process's RLIMIT_NOFILE, soft and hard, to want, or to the
// kernel's fs.nr_open under procSys when that is lower. Never lowered; a failure (no
// CAP_SYS_RESOURCE) is logged and the node runs with the lower ceiling.
func raiseOpenFiles(procSys string, want uint64, log *slog.Logger) {
	if n, err := readSysctl(filepath.Join(procSys, "fs", "nr_open")); err == nil && n >= 0 && uint64(n) < want {
		want = uint64(n)
	}
	var cur syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &cur); err != nil {
		log.Warn("host limit unreadable", "key", "RLIMIT_NOFILE", "err", err)
		return
	}
	if cur.Cur >= want {
		return
	}
	// syscall.Setrlimit, not x/sys/unix's: it also tells os/exec not to hand children
	// the limit the process started with.
	lim := syscall.Rlimit{Cur: want, Max: max(want, cur.Max)}
	if err := syscall.Setrlimit(syscall.RLIMIT_NOFILE, &lim); err != nil {
		// A soft limit still below the hard one is raised to it (no privilege needed).
		if cur.Cur < cur.Max {
			lim = syscall.Rlimit{Cur: cur.Max, Max: cur.Max}
			if syscall.Setrlimit(syscall.RLIMIT_NOFILE, &lim) == nil {
				cur.Cur = cur.Max
			}
		}
		level := slog.LevelInfo
		if cur.Cur < openFilesFloor {
			level = slog.LevelWarn
		}
		log.Log(context.Background(), level, "could not raise a host limit", "key", "RLIMIT_NOFILE", "from", cur.Cur, "to", want,
			"why", "each sandbox holds ~3 open files in the data plane", "err", err)
		return
	}
	log.Info("raised a host limit", "key", "RLIMIT_NOFILE", "from", cur.Cur, "to", want,
		"why", "each sandbox holds ~3 open files in the data plane")
}
