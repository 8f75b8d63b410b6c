package oci

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// killTimeout bounds how long killInit waits for a killed init to exit before the caller
// falls back to the runtime's own forced delete.
const killTimeout = 2 * time.Second

// errNoInit means the container has no live init to kill (never started, or already gone).
var errNoInit = errors.New("oci: no live init")

// killInit ends every process of a container by SIGKILLing its init and waits until the
// init has exited. The init is its pid namespace's reaper, so the kernel kills every other
// process of the sandbox and waits for them before the init exits: once this returns nil
// nothing of the sandbox runs any more.
//
// `runc delete --force` does the same but polls for the exit every 100 ms, which put
// 100 ms on every kill and pause to disk; a pidfd tells us at once. The init is found
// from its pid file and checked to be in the container's cgroup (relCgroup), so a reused
// pid is never signalled. The cgroup is thawed first: a frozen process does not die.
// errNoInit means there was nothing to kill. lastLook, when not nil, is called with the
// init's pid and pidfd once it is known to be the container's, just before the signal.
func killInit(pidFile, relCgroup string, v2 bool, lastLook func(pid, pidfd int)) error {
	raw, err := os.ReadFile(pidFile)
	if errors.Is(err, os.ErrNotExist) {
		return errNoInit
	}
	if err != nil {
		return fmt.Errorf("oci: init pid: %w", err)
	}
	pid, err := strconv.Atoi(strings.TrimSpace(string(raw)))
	if err != nil || pid <= 1 {
		return fmt.Errorf("oci: init pid %q: bad pid", raw)
	}
	fd, err := unix.PidfdOpen(pid, 0)
	if errors.Is(err, unix.ESRCH) {
		return errNoInit
	}
	if err != nil {
		return fmt.Errorf("oci: pidfd of init %d: %w", pid, err)
	}
	defer unix.Close(fd)
	// The pidfd pins the process: if it is in our cgroup now, the signal goes to it.
	in, err := inCgroup(pid, relCgroup)
	if err != nil || !in {
		return errNoInit
	}
	if lastLook != nil {
		lastLook(pid, fd)
	}
	for _, d := range cgroupDirs(relCgroup, v2) {
		thaw(d)
	}
	if err := unix.PidfdSendSignal(fd, unix.SIGKILL, nil, 0); err != nil {
		if errors.Is(err, unix.ESRCH) {
			return nil // exited meanwhile
		}
		return fmt.Errorf("oci: kill init %d: %w", pid, err)
	}
	deadline := time.Now().Add(killTimeout)
	for {
		left := time.Until(deadline)
		if left <= 0 {
			return fmt.Errorf("oci: init %d still alive %s after SIGKILL", pid, killTimeout)
		}
		fds := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}
		n, err := unix.Poll(fds, int(left.Milliseconds())+1)
		if errors.Is(err, unix.EINTR) {
			continue
		}
		if err != nil {
			return fmt.Errorf("oci: wait for init %d: %w", pid, err)
		}
		if n > 0 {
			return nil
		}
	}
}

// inCgroup reports whether pid is in the cgroup rel (in any hierarchy).
func inCgroup(pid int, rel string) (bool, error) {
	raw, err := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", pid))
	if err != nil {
		return false, err
	}
	for _, l := range strings.Split(string(raw), "\n") {
		// hierarchy-id:controllers:path
		parts := strings.SplitN(l, ":", 3)
		if len(parts) == 3 && (parts[2] == rel || strings.HasPrefix(parts[2], rel+"/")) {
			return true, nil
		}
	}
	return false, nil
}

// thaw unfreezes the cgroup directory dir (v1 freezer or v2), ignoring hierarchies
// without a freezer.
func thaw(dir string) {
	if _, err := os.Stat(filepath.Join(dir, "freezer.state")); err == nil {
		_ = os.WriteFile(filepath.Join(dir, "freezer.state"), []byte("THAWED"), 0o644)
	}
	if _, err := os.Stat(filepath.Join(dir, "cgroup.freeze")); err == nil {
		_ = os.WriteFile(filepath.Join(dir, "cgroup.freeze"), []byte("0"), 0o644)
	}
}

// removeContainer kills the container's processes and deletes it: killInit and a plain
// delete when that works, else the runtime's forced delete. A missing container is fine.
func (b *Backend) removeContainer(ctx context.Context, cid string, l layout, m *idMap) error {
	err := killInit(l.pid(), b.cgroupsPath(cid), b.v2, b.usernsFDs.keeper(m))
	if err == nil || errors.Is(err, errNoInit) {
		derr := b.deleteDead(ctx, cid)
		if derr == nil {
			return nil
		}
		b.log.Debug("oci: delete after kill failed; forcing", "cid", cid, "err", derr)
	} else {
		b.log.Warn("oci: kill through pidfd failed; forcing", "cid", cid, "err", err)
	}
	return b.rt.remove(ctx, cid)
}

// deleteDead deletes a container none of whose processes runs any more. For runc and
// crun, whose state under our own --root is a directory per container, it removes the
// cgroups and that directory itself, which is all `runc delete` and `crun delete` of a
// stopped container do (no hooks are configured, crun's keyring is off): one runtime
// exec less per stop. Other runtimes are asked.
func (b *Backend) deleteDead(ctx context.Context, cid string) error {
	if b.rt.name != "runc" && b.rt.name != "crun" || !idRE.MatchString(strings.ReplaceAll(cid, ".", "-")) {
		return b.rt.deleteStopped(ctx, cid)
	}
	if err := removeCgroups(b.cgroupsPath(cid), b.v2); err != nil {
		return err
	}
	if err := os.RemoveAll(filepath.Join(b.rt.root, cid)); err != nil {
		return fmt.Errorf("oci: remove runtime state of %s: %w", cid, err)
	}
	return nil
}
