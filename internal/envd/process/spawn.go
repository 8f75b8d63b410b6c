package process

import (
	"errors"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"time"

	"connectrpc.com/connect"

	pb "github.com/aenv-dev/aenv/internal/envd/gen/process"
	"github.com/aenv-dev/aenv/internal/envd/identity"
	"github.com/aenv-dev/aenv/internal/envd/state"
)

const defaultPath = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

// spec is everything needed to fork one process.
type spec struct {
	user    *identity.User
	config  *pb.ProcessConfig
	pty     *pb.PTY // nil: pipes
	stdin   bool    // pipe (true) or /dev/null
	tag     *string
	env     []string
	dir     string
	exe     string
	argv    []string
	cred    *syscall.Credential
	snap    state.Snapshot
	envPath string
	timeout time.Duration // > 0: SIGKILL the process group when it runs out
}

// prepare validates a StartRequest and resolves user, directory, environment and executable.
func (s *Service) prepare(u *identity.User, req *pb.StartRequest, snap state.Snapshot) (*spec, error) {
	cfg := req.GetProcess()
	if cfg == nil || cfg.GetCmd() == "" {
		return nil, connect.NewError(connect.CodeInvalidArgument, errors.New("process.cmd is required"))
	}
	sp := &spec{user: u, config: cfg, pty: req.Pty, stdin: req.Stdin == nil || req.GetStdin(), tag: req.Tag, snap: snap}

	// Working directory.
	if cfg.Cwd != nil && cfg.GetCwd() != "" {
		sp.dir = identity.Resolve(cfg.GetCwd(), u, snap.Workdir)
		if fi, err := os.Stat(sp.dir); err != nil || !fi.IsDir() {
			return nil, connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("cwd '%s' does not exist", sp.dir))
		}
	} else {
		sp.dir = identity.Resolve("", u, snap.Workdir)
		if fi, err := os.Stat(sp.dir); err != nil || !fi.IsDir() {
			sp.dir = "/"
		}
	}

	// Environment: envd's PATH < the user's HOME/USER/LOGNAME < sandbox env < request env.
	env := map[string]string{}
	env["PATH"] = os.Getenv("PATH")
	if env["PATH"] == "" {
		env["PATH"] = defaultPath
	}
	env["HOME"] = u.Home
	env["USER"] = u.Name
	env["LOGNAME"] = u.Name
	maps.Copy(env, snap.EnvVars)
	maps.Copy(env, cfg.GetEnvs())
	sp.envPath = env["PATH"]
	sp.env = make([]string, 0, len(env))
	for k, v := range env {
		if k == "" || strings.ContainsRune(k, '=') || strings.ContainsRune(k, 0) || strings.ContainsRune(v, 0) {
			return nil, connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("invalid environment variable %q", k))
		}
		sp.env = append(sp.env, k+"="+v)
	}

	// Executable.
	exe, err := lookPath(cfg.GetCmd(), sp.envPath, sp.dir)
	if err != nil {
		return nil, connect.NewError(connect.CodeInvalidArgument, err)
	}
	sp.exe = exe
	sp.argv = append([]string{cfg.GetCmd()}, cfg.GetArgs()...)
	for _, a := range sp.argv {
		if strings.ContainsRune(a, 0) {
			return nil, connect.NewError(connect.CodeInvalidArgument, errors.New("arguments must not contain NUL bytes"))
		}
	}

	// Credentials.
	euid := uint32(os.Geteuid())
	switch {
	case euid == 0 && (u.UID != 0 || u.GID != 0):
		sp.cred = &syscall.Credential{Uid: u.UID, Gid: u.GID, Groups: u.Groups}
	case euid != 0 && u.UID != euid:
		return nil, connect.NewError(connect.CodePermissionDenied,
			fmt.Errorf("cannot run as user '%s': envd is not running as root", u.Name))
	}
	return sp, nil
}

// lookPath finds cmd like a shell would, using the child's PATH.
func lookPath(cmd, path, dir string) (string, error) {
	if strings.Contains(cmd, "/") {
		p := cmd
		if !filepath.IsAbs(p) {
			p = filepath.Join(dir, p)
		}
		if err := executable(p); err != nil {
			return "", fmt.Errorf("error starting process: %s: %w", cmd, err)
		}
		return p, nil
	}
	for _, d := range filepath.SplitList(path) {
		if d == "" {
			d = "."
		}
		p := filepath.Join(d, cmd)
		if !filepath.IsAbs(p) {
			p = filepath.Join(dir, p)
		}
		if executable(p) == nil {
			return p, nil
		}
	}
	return "", fmt.Errorf("error starting process: %s: executable file not found in $PATH", cmd)
}

func executable(p string) error {
	fi, err := os.Stat(p)
	if err != nil {
		return err
	}
	if fi.IsDir() {
		return errors.New("is a directory")
	}
	if fi.Mode()&0o111 == 0 {
		return os.ErrPermission
	}
	return nil
}

// start forks the process described by sp and begins draining its output. With attach, the
// returned subscriber is attached before the first byte is read.
func (s *Service) start(sp *spec, attach bool) (_ *proc, sub *subscriber, err error) {
	p := &proc{tag: sp.tag, config: sp.config, done: make(chan struct{})}
	if attach {
		sub, _ = p.hub.subscribe()
	}

	var childFiles []*os.File // closed in the parent after the fork
	defer func() {
		for _, f := range childFiles {
			f.Close()
		}
		if err != nil {
			for _, f := range p.outputs {
				f.Close()
			}
			if p.stdin != nil {
				p.stdin.Close()
			}
		}
	}()

	sys := &syscall.SysProcAttr{Credential: sp.cred}
	var fds []uintptr
	if sp.pty != nil {
		cols, rows := uint16(80), uint16(24)
		if sz := sp.pty.GetSize(); sz != nil && sz.GetCols() > 0 && sz.GetRows() > 0 {
			cols, rows = clampU16(sz.GetCols()), clampU16(sz.GetRows())
		}
		master, slave, err := openPTY(cols, rows)
		if err != nil {
			return nil, nil, connect.NewError(connect.CodeInternal, fmt.Errorf("error creating pty: %w", err))
		}
		childFiles = append(childFiles, slave)
		p.pty = master
		p.outputs = []*os.File{master}
		if sp.cred != nil {
			_ = os.Chown(slave.Name(), int(sp.cred.Uid), int(sp.cred.Gid))
		}
		fd := slave.Fd()
		fds = []uintptr{fd, fd, fd}
		sys.Setsid = true
		sys.Setctty = true
		sys.Ctty = 0
	} else {
		var stdin *os.File
		if sp.stdin {
			r, w, err := os.Pipe()
			if err != nil {
				return nil, nil, connect.NewError(connect.CodeInternal, err)
			}
			childFiles = append(childFiles, r)
			p.stdin = w
			stdin = r
		} else {
			stdin, err = os.Open(os.DevNull)
			if err != nil {
				return nil, nil, connect.NewError(connect.CodeInternal, err)
			}
			childFiles = append(childFiles, stdin)
		}
		outR, outW, err := os.Pipe()
		if err != nil {
			return nil, nil, connect.NewError(connect.CodeInternal, err)
		}
		childFiles = append(childFiles, outW)
		p.outputs = append(p.outputs, outR)
		errR, errW, err := os.Pipe()
		if err != nil {
			return nil, nil, connect.NewError(connect.CodeInternal, err)
		}
		childFiles = append(childFiles, errW)
		p.outputs = append(p.outputs, errR)
		if sp.cred != nil {
			// Pipes belong to envd (root); hand them to the user so that opening /dev/stdout,
			// /dev/stderr or /proc/self/fd/N by path works, as with a login shell.
			for _, f := range []*os.File{stdin, outW, errW} {
				_ = f.Chown(int(sp.cred.Uid), int(sp.cred.Gid))
			}
		}
		fds = []uintptr{stdin.Fd(), outW.Fd(), errW.Fd()}
		sys.Setpgid = true
	}

	attr := &syscall.ProcAttr{Dir: sp.dir, Env: sp.env, Files: fds, Sys: sys}
	pid, wait, err := s.waiter.Start(func() (int, error) {
		return syscall.ForkExec(sp.exe, sp.argv, attr)
	})
	runtime.KeepAlive(childFiles)
	if err != nil {
		return nil, nil, connect.NewError(startErrorCode(err), fmt.Errorf("error starting process: %w", err))
	}
	p.pid = uint32(pid)
	// Like E2B's envd: user commands are preferred victims of the OOM killer, envd is not.
	_ = os.WriteFile("/proc/"+itoa(pid)+"/oom_score_adj", []byte(itoa(childOOMScoreAdj(ownOOMScoreAdj()))), 0)

	if p.pty != nil {
		p.readers.Add(1)
		go p.read(p.pty, ptyChunk, func(b []byte) *pb.ProcessEvent_DataEvent {
			return &pb.ProcessEvent_DataEvent{Output: &pb.ProcessEvent_DataEvent_Pty{Pty: b}}
		})
	} else {
		p.readers.Add(2)
		go p.read(p.outputs[0], pipeChunk, func(b []byte) *pb.ProcessEvent_DataEvent {
			return &pb.ProcessEvent_DataEvent{Output: &pb.ProcessEvent_DataEvent_Stdout{Stdout: b}}
		})
		go p.read(p.outputs[1], pipeChunk, func(b []byte) *pb.ProcessEvent_DataEvent {
			return &pb.ProcessEvent_DataEvent{Output: &pb.ProcessEvent_DataEvent_Stderr{Stderr: b}}
		})
	}
	if sp.timeout > 0 {
		p.killTime = time.AfterFunc(sp.timeout, func() { _ = p.signal(syscall.SIGKILL) })
	}
	s.register(p)
	go func() {
		p.finish(wait())
		s.retire(p)
	}()
	return p, sub, nil
}

func clampU16(v uint32) uint16 {
	if v > 0xffff {
		return 0xffff
	}
	return uint16(v)
}

// startErrorCode classifies a fork/exec failure: a command that cannot be executed is the
// caller's mistake, a fork refused for lack of processes or memory (the sandbox's pids limit
// reached) is resource_exhausted, and anything else is internal.
func startErrorCode(err error) connect.Code {
	switch {
	case errors.Is(err, syscall.EAGAIN), errors.Is(err, syscall.ENOMEM):
		return connect.CodeResourceExhausted
	case errors.Is(err, syscall.ENOENT), errors.Is(err, syscall.EACCES), errors.Is(err, syscall.ENOEXEC),
		errors.Is(err, syscall.ENOTDIR), errors.Is(err, syscall.E2BIG), errors.Is(err, syscall.ELOOP):
		return connect.CodeInvalidArgument
	}
	return connect.CodeInternal
}

// childOOMScoreAdj is a command's OOM score adjustment: 100 above envd's own, so that a
// command goes first. Relative, because a container's runtime may have raised envd's
// (the OCI backend sets 500 so that the host's OOM killer takes sandboxes before the
// node's data plane), and lowering a score needs a privilege envd does not hold there.
func childOOMScoreAdj(own int) int { return min(own+100, 1000) }

// ownOOMScoreAdj reads envd's own adjustment (0 when it cannot).
func ownOOMScoreAdj() int {
	b, err := os.ReadFile("/proc/self/oom_score_adj")
	if err != nil {
		return 0
	}
	n, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil {
		return 0
	}
	return n
}
