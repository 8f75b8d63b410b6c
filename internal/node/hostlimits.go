package node

import (
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"strings"
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
		raw, err := os.ReadFile(path)
		if err != nil {
			log.Warn("host limit unreadable", "key", sysctlName(l.key), "err", err)
			continue
		}
		cur, err := strconv.ParseInt(strings.TrimSpace(string(raw)), 10, 64)
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

// sysctlName spells a /proc/sys path as sysctl does (kernel.pid_max).
func sysctlName(key string) string { return strings.ReplaceAll(key, "/", ".") }
