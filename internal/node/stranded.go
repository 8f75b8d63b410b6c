package node

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// A node killed in the middle of a fork leaves the child it was making stranded: a copy
// of the node (one thread, every fd of the node: the catalog and its lock, the API
// socket, loop devices, log pipes) that was to exec a helper but waits forever instead.
// Go makes a child that gets a user namespace wait on a pipe until its parent has written
// the id maps, and when two such forks overlap each child holds the other's pipe open, so
// neither sees the parent die. The next node would find the catalog locked by a pid that
// no longer exists and the port taken.

// stranded lists the processes other than this one that hold the file at path open and
// cannot be a node: a running node is a Go process with several threads, a stranded fork
// has exactly one.
func stranded(path string) []int {
	var want syscall.Stat_t
	if err := syscall.Stat(path, &want); err != nil {
		return nil
	}
	self := os.Getpid()
	var out []int
	procs, _ := os.ReadDir("/proc")
	for _, p := range procs {
		pid, err := strconv.Atoi(p.Name())
		if err != nil || pid == self || threads(pid) != 1 {
			continue
		}
		if holds(pid, want.Dev, want.Ino) {
			out = append(out, pid)
		}
	}
	return out
}

// threads is the number of threads of pid (0 when it cannot be read).
func threads(pid int) int {
	raw, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0
	}
	for _, line := range strings.Split(string(raw), "\n") {
		if v, ok := strings.CutPrefix(line, "Threads:"); ok {
			n, _ := strconv.Atoi(strings.TrimSpace(v))
			return n
		}
	}
	return 0
}

// holds reports whether pid has the file (dev, ino) open.
func holds(pid int, dev, ino uint64) bool {
	dir := fmt.Sprintf("/proc/%d/fd", pid)
	fds, err := os.ReadDir(dir)
	if err != nil {
		return false
	}
	for _, fd := range fds {
		var st syscall.Stat_t
		if syscall.Stat(filepath.Join(dir, fd.Name()), &st) == nil && st.Dev == dev && st.Ino == ino {
			return true
		}
	}
	return false
}

// clearStranded kills the stranded forks of a dead node that hold the catalog at path
// (whose lock names holder, a pid that no longer runs), and waits until the lock is free.
func clearStranded(ctx context.Context, path string, holder int, log *slog.Logger) error {
	pids := stranded(path)
	if len(pids) == 0 {
		return nil
	}
	log.Warn("the catalog is held by processes a killed node forked and left stranded; killing them",
		"dead_node", holder, "pids", pids)
	for _, pid := range pids {
		if err := syscall.Kill(pid, syscall.SIGKILL); err != nil && err != syscall.ESRCH {
			return fmt.Errorf("kill stranded process %d: %w", pid, err)
		}
	}
	deadline := time.Now().Add(5 * time.Second)
	for {
		if p, held := lockHolder(path); !held || p != holder {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("the catalog is still locked for the dead node %d after its stranded forks %v were killed", holder, pids)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
	}
}
