package dataplane

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"runtime"
	"runtime/debug"
	"strconv"
	"syscall"
	"time"

	"github.com/aenv-dev/aenv/internal/storage/blockdev"
	"golang.org/x/sys/unix"
)

// Files in the data plane's directory (the node's DataDir/dataplane).
const (
	socketName = "dp.sock"
	lockName   = "dp.lock"
	logName    = "dataplane.log"
	fuseName   = "fuse"
)

// SocketPath is the socket of the data plane whose directory is dir.
func SocketPath(dir string) string { return filepath.Join(dir, socketName) }

// FUSEDir is where the data plane whose directory is dir serves its disks' device files.
func FUSEDir(dir string) string { return filepath.Join(dir, fuseName) }

// ErrRunning means another data plane already serves dir.
var ErrRunning = errors.New("dataplane: another data plane serves this directory")

// dataPlaneGCPercent is the data plane's GOGC unless its environment sets one (see Run).
const dataPlaneGCPercent = 50

// Run is the data-plane daemon (`aenv dataplane`): it serves disks on SocketPath(dir)
// until ctx ends with no disk open, or a shutdown request is granted. SIGTERM and SIGINT
// end it only while it serves no disk: with disks open they are logged and ignored,
// since exiting would fail every sandbox root it serves (SIGKILL still does that; see
// docs/operations.md).
func Run(ctx context.Context, dir, build string, log *slog.Logger) error {
	if log == nil {
		log = slog.Default()
	}
	tuneRuntime(os.Getenv)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return fmt.Errorf("dataplane: %w", err)
	}
	lf, err := os.OpenFile(filepath.Join(dir, lockName), os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		return fmt.Errorf("dataplane: %w", err)
	}
	defer lf.Close()
	if err := unix.Flock(int(lf.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
		if errors.Is(err, unix.EWOULDBLOCK) {
			return ErrRunning
		}
		return fmt.Errorf("dataplane: lock: %w", err)
	}
	sock := SocketPath(dir)
	// Only a data plane holding the lock listens, so a socket file here is a dead one's.
	if err := os.Remove(sock); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("dataplane: %w", err)
	}
	ln, err := net.Listen("unix", sock)
	if err != nil {
		return fmt.Errorf("dataplane: listen: %w", err)
	}
	_ = os.Chmod(sock, 0o600)
	srv := NewServer(build, log)
	srv.FUSEDir = FUSEDir(dir)
	// Mounted now, not at the first disk: a dead predecessor's mount there is detached at
	// once, not left in the mount table until a disk is opened.
	if _, err := srv.sharedFiles(ctx); err != nil {
		ln.Close()
		os.Remove(sock)
		return err
	}
	sctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	sigs := make(chan os.Signal, 4)
	signal.Notify(sigs, syscall.SIGTERM, syscall.SIGINT, syscall.SIGHUP)
	defer signal.Stop(sigs)
	go func() {
		for {
			select {
			case <-srv.Stopped():
				return
			case <-ctx.Done():
			case sig := <-sigs:
				if sig == syscall.SIGHUP {
					continue
				}
			}
			if n := srv.NumDisks(); n > 0 {
				log.Warn("dataplane: asked to exit while serving disks; staying (kill -9 would fail every one of them)", "disks", n)
				if ctx.Err() != nil {
					ctx = context.Background()
				}
				continue
			}
			cancel()
			return
		}
	}()
	log.Info("dataplane: serving", "socket", sock, "pid", os.Getpid(), "api", APIVersion, "build", build, "procs", runtime.GOMAXPROCS(0))
	err = srv.Serve(sctx, ln)
	os.Remove(sock)
	return errors.Join(err, srv.Close())
}

// StartOptions tell Ensure how to start a data plane.
type StartOptions struct {
	// Dir is the data plane's directory (socket, lock, log).
	Dir string
	// Command is the data plane's command line (e.g. the aenv binary, "dataplane",
	// "--dir", Dir).
	Command []string
	// Cgroup, when set, names the cgroup (under the unified and systemd hierarchies) the
	// data plane is moved into, out of the node's: a service manager that kills the
	// node's cgroup then leaves it alone.
	Cgroup string
	Log    *slog.Logger
}

// Ensure returns a client of the data plane of o.Dir, starting one (in a session and a
// cgroup of its own, so it outlives the caller) when none answers. started says whether
// it started one. A data plane of another API version is an ErrVersion error: it still
// serves disks this node cannot drive.
func Ensure(ctx context.Context, o StartOptions) (c *Client, started bool, err error) {
	c = NewClient(SocketPath(o.Dir))
	if err := c.Ping(ctx); err == nil || errors.Is(err, ErrVersion) {
		return c, false, err
	}
	if err := os.MkdirAll(o.Dir, 0o700); err != nil {
		return nil, false, fmt.Errorf("dataplane: %w", err)
	}
	logf, err := os.OpenFile(filepath.Join(o.Dir, logName), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return nil, false, fmt.Errorf("dataplane: %w", err)
	}
	defer logf.Close()
	cmd := exec.Command(o.Command[0], o.Command[1:]...)
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	cmd.Dir = "/"
	if err := cmd.Start(); err != nil {
		return nil, false, fmt.Errorf("dataplane: start: %w", err)
	}
	exited := make(chan struct{})
	go func() { _ = cmd.Wait(); close(exited) }() // reaps it if it exits while we run
	if o.Cgroup != "" {
		if err := moveToCgroup(cmd.Process.Pid, o.Cgroup); err != nil && o.Log != nil {
			o.Log.Warn("dataplane: could not move the data plane into its own cgroup", "err", err)
		}
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		perr := c.Ping(ctx)
		if perr == nil {
			return c, true, nil
		}
		select {
		case <-exited:
			// A data plane that lost the race for the lock exits: ask the winner.
			if c.Ping(ctx) == nil {
				return c, false, nil
			}
			return nil, false, fmt.Errorf("dataplane: the data plane exited at start (%v); see %s", cmd.ProcessState, logf.Name())
		case <-ctx.Done():
			return nil, false, ctx.Err()
		case <-time.After(20 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			_ = cmd.Process.Kill()
			return nil, false, fmt.Errorf("dataplane: no answer within 10 s: %w", perr)
		}
	}
}

// CgroupName is the cgroup Ensure's callers give the data plane of the data directory
// dataDir: one per node, so test nodes on one host do not share it.
func CgroupName(dataDir string) string {
	h := sha256.Sum256([]byte(dataDir))
	return "aenv.dataplane/" + hex.EncodeToString(h[:6])
}

// cgroupRoots are the hierarchies a service manager tracks processes in: the unified
// tree (mounted at /sys/fs/cgroup itself on a pure v2 host) and systemd's named v1
// hierarchy on a hybrid one.
var cgroupRoots = []string{"/sys/fs/cgroup", "/sys/fs/cgroup/unified", "/sys/fs/cgroup/systemd"}

const (
	cgroup2Magic = 0x63677270
	cgroup1Magic = 0x27e0eb
)

// CgroupDirs lists the directories of cgroup name in the tracked hierarchies present.
func CgroupDirs(name string) []string {
	var out []string
	for _, r := range cgroupRoots {
		var st unix.Statfs_t
		if unix.Statfs(r, &st) != nil || (st.Type != cgroup2Magic && st.Type != cgroup1Magic) {
			continue
		}
		out = append(out, filepath.Join(r, name))
	}
	return out
}

func moveToCgroup(pid int, name string) error {
	var errs []error
	for _, d := range CgroupDirs(name) {
		if err := os.MkdirAll(d, 0o755); err != nil {
			errs = append(errs, err)
			continue
		}
		if err := os.WriteFile(filepath.Join(d, "cgroup.procs"), []byte(strconv.Itoa(pid)), 0o644); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// RemoveCgroup removes the data plane's cgroup directories once it has exited (an empty
// cgroup; one still holding a process is left).
func RemoveCgroup(name string) {
	for _, d := range CgroupDirs(name) {
		if !cgroupEmpty(d) {
			continue
		}
		_ = os.Remove(d)
		_ = os.Remove(filepath.Dir(d)) // the shared parent, once no node's is left
	}
}

// RemoveCgroupWhenEmpty waits up to wait for the data plane's processes to leave its
// cgroup, then removes it as RemoveCgroup does. A data plane told to shut down stops
// answering before it has exited, and on a loaded host its exit can take far longer
// than any fixed pause, so the node waits on the cgroup itself.
func RemoveCgroupWhenEmpty(ctx context.Context, name string, wait time.Duration) {
	deadline := time.Now().Add(wait)
	for _, d := range CgroupDirs(name) {
		for cgroupBusy(d) && time.Now().Before(deadline) && ctx.Err() == nil {
			time.Sleep(10 * time.Millisecond)
		}
	}
	RemoveCgroup(name)
}

// cgroupEmpty reports whether the cgroup directory d exists and holds no process.
func cgroupEmpty(d string) bool {
	raw, err := os.ReadFile(filepath.Join(d, "cgroup.procs"))
	return err == nil && len(bytes.TrimSpace(raw)) == 0
}

// cgroupBusy reports whether the cgroup directory d still holds a process (false when it
// is gone).
func cgroupBusy(d string) bool {
	raw, err := os.ReadFile(filepath.Join(d, "cgroup.procs"))
	return err == nil && len(bytes.TrimSpace(raw)) > 0
}

// tuneRuntime sets the data plane's Go runtime where its environment (getenv) leaves
// GOMAXPROCS or GOGC unset.
func tuneRuntime(getenv func(string) string) {
	// The FUSE readers of the disks served hold Ps while they wait for requests; with
	// fewer Ps than blockdev.ServingProcs (a 2-CPU host has 2), a single busy disk's
	// readers hold them all and the runtime churns threads on every request (see
	// blockdev.IdleReaders). Extra Ps cost nothing while their threads sleep.
	if getenv("GOMAXPROCS") == "" && runtime.GOMAXPROCS(0) < blockdev.ServingProcs() {
		runtime.GOMAXPROCS(blockdev.ServingProcs())
	}
	// Most of the heap is live and long-lived: each served disk's waiting FUSE readers'
	// request buffers (blockdev.IdleReaders of 132 KiB) and its stack's indexes, ~0.5
	// MiB per disk (0.73 with the 260 KiB buffers of 256 KiB requests). With Go's default GOGC of 100 the heap grows to twice that between
	// collections and the slack stays resident; at 50 the data plane held 0.84 instead
	// of 1.06 MiB per idle disk (200 held), its collector still at 0 % of its CPU.
	if getenv("GOGC") == "" {
		debug.SetGCPercent(dataPlaneGCPercent)
	}
	debug.SetMaxThreads(MaxThreads)
}

// MaxThreads is the cap on OS threads of a process serving disks (the data plane, or the
// node without one). Every disk served keeps
// blockdev.IdleReaders threads blocked in read(2) on its FUSE connection, so Go's
// default cap of 10 000, which the runtime enforces by killing the process, would end
// the data plane, and every sandbox root with it, near 5 000 disks (4 024 threads at
// 2 000 disks measured). The kernel's own limits (threads-max, pid_max) still apply.
const MaxThreads = 200_000
