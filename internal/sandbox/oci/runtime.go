package oci

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strings"

	"golang.org/x/sys/unix"
)

// errNoContainer means the runtime has no container of that id.
var errNoContainer = errors.New("oci: no such container")

// runtimeCLI drives an OCI runtime binary (runc, crun, runsc) with its own state root, so
// our containers never mix with anything else on the host.
type runtimeCLI struct {
	name string    // runc | crun | runsc
	bin  string    // resolved path, or /proc/self/fd/N of exe
	root string    // --root: the runtime's state directory
	exe  *os.File  // a sealed in-memory copy of the binary (runc, crun), or nil
	ns   *launchNS // where create commands run; nil: the node's mount namespace
}

// containerState is the subset of `state`/`list -f json` output we use.
type containerState struct {
	ID     string `json:"id"`
	Pid    int    `json:"pid"`
	Status string `json:"status"` // created | running | paused | stopped
	Bundle string `json:"bundle"`
}

func (r runtimeCLI) command(ctx context.Context, args ...string) *exec.Cmd {
	full := append([]string{"--root", r.root}, args...)
	cmd := exec.CommandContext(ctx, r.bin, full...)
	// Run from a sealed copy, its path is /proc/self/fd/N: the host's process list shows
	// the runtime's name instead.
	cmd.Args[0] = r.name
	cmd.WaitDelay = 0
	return cmd
}

func (r runtimeCLI) output(ctx context.Context, args ...string) ([]byte, error) {
	cmd := r.command(ctx, args...)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := runPolled(cmd); err != nil {
		msg := strings.TrimSpace(stderr.String())
		if noContainer(msg, r.root) {
			return nil, fmt.Errorf("%w: %s %s: %s", errNoContainer, r.name, args[0], msg)
		}
		return nil, fmt.Errorf("oci: %s %s: %w: %s", r.name, strings.Join(args, " "), err, msg)
	}
	return stdout.Bytes(), nil
}

// noContainer says whether a runtime's error message msg means it has no container of
// the id asked for in state directory root: runc's "container does not exist", runsc's
// "not found", crun's failed open of the container's state files below root.
func noContainer(msg, root string) bool {
	return strings.Contains(msg, "does not exist") || strings.Contains(msg, "not found") ||
		strings.Contains(msg, filepath.Clean(root)+"/") && strings.Contains(msg, "No such file or directory")
}

// create creates the container without starting its init (the warm pool); start runs it.
func (r runtimeCLI) create(ctx context.Context, id, bundle, netns, pidFile, logPath string) error {
	logf, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return fmt.Errorf("oci: init log: %w", err)
	}
	defer logf.Close()
	cmd := r.command(ctx, "create", "--no-new-keyring", "--pid-file", pidFile, "--bundle", bundle, id)
	cmd.Stdout, cmd.Stderr = logf, logf
	if err := r.ns.run(cmd, bundle, netns); err != nil {
		tail, _ := os.ReadFile(logPath)
		if len(tail) > 2000 {
			tail = tail[len(tail)-2000:]
		}
		return fmt.Errorf("oci: %s create %s: %w: %s", r.name, id, err, strings.TrimSpace(string(tail)))
	}
	return nil
}

// start starts a created container's init: for runc and crun without running them
// (startRunc, startCrun).
func (r runtimeCLI) start(ctx context.Context, id string) error {
	if idRE.MatchString(strings.ReplaceAll(id, ".", "-")) {
		switch r.name {
		case "runc":
			return startRunc(ctx, filepath.Join(r.root, id), "/proc")
		case "crun":
			return startCrun(filepath.Join(r.root, id))
		}
	}
	_, err := r.output(ctx, "start", id)
	return err
}

// cgroupView says whether the runtime must see only the cgroup hierarchies sandboxes
// need in a cgroup root of their own (showCgroupMounts) rather than the host's with the
// others detached (hideCgroupMounts): crun, which on this project's hybrid hosts cannot
// start a container otherwise (the probe sees the same).
func (r runtimeCLI) cgroupView() bool { return r.name == "crun" }

// bindsUnderProc says whether the runtime takes bind mounts below /proc (crun; runc
// refuses all but lxcfs's files there, runsc has a /proc of its own).
func (r runtimeCLI) bindsUnderProc() bool { return r.name == "crun" }

// runForeground runs a container to completion (used by the probe), seeing only the
// cgroup hierarchies at cgroups (nil: all), as crun's launches do.
func (r runtimeCLI) runForeground(ctx context.Context, id, bundle string, cgroups []string) ([]byte, error) {
	cmd := r.command(ctx, "run", "--no-new-keyring", "--bundle", bundle, id)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	err := startInCgroupView(cmd, cgroups)
	if err == nil {
		err = cmd.Wait()
	}
	if err != nil {
		return out.Bytes(), fmt.Errorf("oci: %s run: %w: %s", r.name, err, strings.TrimSpace(out.String()))
	}
	return out.Bytes(), nil
}

func (r runtimeCLI) state(ctx context.Context, id string) (containerState, error) {
	out, err := r.output(ctx, "state", id)
	if err != nil {
		return containerState{}, err
	}
	var st containerState
	if err := json.Unmarshal(out, &st); err != nil {
		return containerState{}, fmt.Errorf("oci: %s state %s: %w", r.name, id, err)
	}
	return st, nil
}

func (r runtimeCLI) list(ctx context.Context) ([]containerState, error) {
	if _, err := os.Stat(r.root); errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	out, err := r.output(ctx, "list", "--format", "json")
	if err != nil {
		return nil, err
	}
	var sts []containerState
	if s := strings.TrimSpace(string(out)); s == "" || s == "null" {
		return nil, nil
	}
	if err := json.Unmarshal(out, &sts); err != nil {
		return nil, fmt.Errorf("oci: %s list: %w", r.name, err)
	}
	return sts, nil
}

func (r runtimeCLI) pause(ctx context.Context, id string) error {
	_, err := r.output(ctx, "pause", id)
	return err
}

func (r runtimeCLI) resume(ctx context.Context, id string) error {
	_, err := r.output(ctx, "resume", id)
	return err
}

// deleteStopped deletes a container whose processes are gone (its state and cgroups); a
// missing container is fine, a live one an error.
func (r runtimeCLI) deleteStopped(ctx context.Context, id string) error {
	if _, err := r.output(ctx, "delete", id); err != nil && !errors.Is(err, errNoContainer) {
		return err
	}
	return nil
}

// remove kills every process of the container and deletes it; a missing container is fine.
func (r runtimeCLI) remove(ctx context.Context, id string) error {
	if _, err := r.output(ctx, "delete", "--force", id); err != nil && !errors.Is(err, errNoContainer) {
		return err
	}
	return nil
}

// runcMemfdSeals are the seals runc checks for on /proc/self/exe (RUNC_MEMFD_SEALS in its
// nsenter/cloned_binary.c) to accept it as a safe copy of itself; crun, whose
// cloned_binary.c comes from runc's, checks the same.
const runcMemfdSeals = unix.F_SEAL_SEAL | unix.F_SEAL_SHRINK | unix.F_SEAL_GROW | unix.F_SEAL_WRITE

// sealedCopy copies the runtime binary into a sealed memfd. runc (1.1) protects the host
// binary from containers (CVE-2019-5736) by copying itself into such a memfd and
// re-executing from it at every container start: 9 MB copied and one more exec per
// launch. crun (1.8) re-executes itself at every command, containers or not, from a
// read-only bind mount of its binary made and removed for the purpose: a second start
// with its ten shared libraries loaded anew, two mounts and an unmount, ~10 ms of CPU
// per command on this project's VMs (`crun --version`: 15–17 ms from its file, 6–7 ms
// from a sealed copy, `perf stat -r 40`). Started from a sealed copy, either finds
// itself already safe and skips all that. The returned file must stay open as long as
// the runtime is run through /proc/self/fd.
func sealedCopy(name, bin string) (*os.File, error) {
	src, err := os.Open(bin)
	if err != nil {
		return nil, fmt.Errorf("oci: sealed runtime copy: %w", err)
	}
	defer src.Close()
	fd, err := unix.MemfdCreate(name, unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		return nil, fmt.Errorf("oci: sealed runtime copy: %w", err)
	}
	f := os.NewFile(uintptr(fd), name+"-memfd")
	if _, err := io.Copy(f, src); err != nil {
		f.Close()
		return nil, fmt.Errorf("oci: sealed runtime copy: %w", err)
	}
	if _, err := unix.FcntlInt(f.Fd(), unix.F_ADD_SEALS, runcMemfdSeals); err != nil {
		f.Close()
		return nil, fmt.Errorf("oci: seal runtime copy: %w", err)
	}
	return f, nil
}

// sealed returns r running from a sealed in-memory copy of its binary (see sealedCopy),
// or r itself when that is neither runc nor crun or the copy fails.
func (r runtimeCLI) sealed(log *slog.Logger) runtimeCLI {
	if r.name != "runc" && r.name != "crun" {
		return r
	}
	f, err := sealedCopy(r.name, r.bin)
	if err != nil {
		log.Warn("oci: the runtime runs from its file (slower starts)", "runtime", r.name, "err", err)
		return r
	}
	r.exe, r.bin = f, fmt.Sprintf("/proc/self/fd/%d", f.Fd())
	return r
}

// startInCgroupView starts cmd in a mount namespace of its own whose cgroup root shows only
// the hierarchies at paths (showCgroupMounts); with no paths, in the node's.
func startInCgroupView(cmd *exec.Cmd, paths []string) error {
	if len(paths) == 0 {
		return cmd.Start()
	}
	return onDiscardedThread(func() error {
		if err := unshareMountNS(); err != nil {
			return fmt.Errorf("oci: %w", err)
		}
		if err := showCgroupMounts(cgroupRoot, paths); err != nil {
			return fmt.Errorf("oci: %w", err)
		}
		// os/exec forks on this (locked) thread: the child inherits its namespace.
		return cmd.Start()
	})
}
