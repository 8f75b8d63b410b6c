package build

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"maps"
	"os"
	"path"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"connectrpc.com/connect"
)

// stepError is a failure attributed to one E2B step name ("base", "1".."N", "finalize").
type stepError struct {
	step string
	err  error
}

func (e *stepError) Error() string { return e.err.Error() }
func (e *stepError) Unwrap() error { return e.err }

func failStep(step string, err error) error { return &stepError{step: step, err: err} }

// Files opens uploaded file sets by hash.
type Files interface {
	Open(hash string) (io.ReadCloser, error)
}

// state is what steps change and later steps and the template inherit.
type state struct {
	user    string
	workdir string
	env     map[string]string
	// expose and labels are EXPOSE and LABEL, on top of the base's.
	expose []string
	labels map[string]string
}

// executor runs a spec's steps in one build sandbox.
type executor struct {
	s            *Session
	files        Files
	logf         func(level, msg string)
	stepTimeout  time.Duration
	readyTimeout time.Duration
	st           state
	copies       int
	// startUser is the user the build started as (DEFAULT_USER returns to it).
	startUser string
	// missingUser is a USER step's user the image does not have, and the step's number:
	// commands run as it fail as E2B's do, and a template may not keep it.
	missingUser     string
	missingUserStep int
}

// lineWriter turns a process's output into log lines.
type lineWriter struct {
	mu    sync.Mutex
	level string
	logf  func(level, msg string)
	buf   bytes.Buffer
}

func (w *lineWriter) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.buf.Write(p)
	for {
		i := bytes.IndexByte(w.buf.Bytes(), '\n')
		if i < 0 {
			if w.buf.Len() > maxLogLine {
				w.logf(w.level, w.buf.String())
				w.buf.Reset()
			}
			return len(p), nil
		}
		w.logf(w.level, strings.TrimRight(string(w.buf.Next(i+1)), "\r\n"))
	}
}

func (w *lineWriter) flush() {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.buf.Len() > 0 {
		w.logf(w.level, w.buf.String())
		w.buf.Reset()
	}
}

// run runs a shell script as the given user, logging its output, bounded by the step timeout.
func (x *executor) run(ctx context.Context, script, user string) error {
	ctx, cancel := context.WithTimeout(ctx, x.stepTimeout)
	defer cancel()
	out := &lineWriter{level: "info", logf: x.logf}
	// The last lines of stderr usually say why a command failed ("No space left on
	// device", before any summary the command prints): they go into the reason too.
	var lastErr []string
	errw := &lineWriter{level: "info", logf: func(level, msg string) {
		if line := strings.TrimSpace(msg); line != "" {
			lastErr = append(lastErr[max(0, len(lastErr)-2):], line)
		}
		x.logf(level, msg)
	}}
	err := x.s.Run(ctx, Command{Script: script, User: user, Dir: x.st.workdir, Env: x.st.env, Stdout: out, Stderr: errw})
	out.flush()
	errw.flush()
	if ctx.Err() != nil && !errors.Is(err, ErrExit) {
		return fmt.Errorf("%w after %s", errStepTimeout, x.stepTimeout)
	}
	if tail := strings.Join(lastErr, " | "); errors.Is(err, ErrExit) && tail != "" {
		if len(tail) > 500 {
			tail = "..." + tail[len(tail)-500:]
		}
		err = fmt.Errorf("%w: %s", err, tail)
	}
	return err
}

// errStepTimeout is a step that ran out of time.
var errStepTimeout = errors.New("timed out")

// quiet runs a script as root without logging its output, returning it on failure.
func (x *executor) quiet(ctx context.Context, script string) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, x.stepTimeout)
	defer cancel()
	var out bytes.Buffer
	lb := &limitedBuffer{b: &out, n: 16 << 10}
	err := x.s.Run(ctx, Command{Script: script, User: "root", Dir: "/", Stdout: lb, Stderr: lb})
	return strings.TrimSpace(out.String()), err
}

// steps runs every step in order; a failure names the step (1-based, E2B's numbering).
func (x *executor) steps(ctx context.Context, steps []Step) error {
	for i, st := range steps {
		name := strconv.Itoa(i + 1)
		x.logf("info", fmt.Sprintf("[%d/%d] %s", i+1, len(steps), x.describeStep(st)))
		start := time.Now()
		if err := x.step(ctx, st); err != nil {
			return failStep(name, fmt.Errorf("step %d (%s) failed: %w", i+1, x.describeStep(st), err))
		}
		if st.Type == StepUser && x.missingUser != "" && x.missingUserStep == 0 {
			x.missingUserStep = i + 1
		}
		x.logf("debug", fmt.Sprintf("[%d/%d] done in %s", i+1, len(steps), time.Since(start).Round(time.Millisecond)))
	}
	// A template cannot default to a user its image lacks.
	if u, _, _ := strings.Cut(x.st.user, ":"); x.missingUser != "" && u == x.missingUser {
		if out, err := x.quiet(ctx, "id "+shellQuote(u)); err != nil {
			return failStep(strconv.Itoa(x.missingUserStep), fmt.Errorf("user %q does not exist in the image (create it in a RUN step first): %s", u, out))
		}
	}
	return nil
}

// describeStep is a step as the build log shows it; no value is ever left blank.
func (x *executor) describeStep(st Step) string {
	switch st.Type {
	case StepDefaultUser:
		return "USER " + x.startUser + " (the template's default user)"
	case StepUser, StepWorkdir:
		if len(st.Args) > 0 {
			return st.Type + " " + shellQuote(st.Args[0])
		}
	}
	return describeStep(st)
}

func describeStep(st Step) string {
	switch st.Type {
	case StepRun:
		s := "RUN " + st.Args[0]
		if len(st.Args) > 1 && st.Args[1] != "" {
			s += " (as " + st.Args[1] + ")"
		}
		return s
	case StepCopy:
		return "COPY " + st.Args[0] + " " + st.Args[1]
	case StepEnv:
		keys := make([]string, 0, len(st.Args)/2)
		for i := 0; i < len(st.Args); i += 2 {
			keys = append(keys, st.Args[i])
		}
		return "ENV " + strings.Join(keys, " ")
	}
	return st.Type + " " + strings.Join(st.Args, " ")
}

func (x *executor) step(ctx context.Context, st Step) error {
	switch st.Type {
	case StepRun:
		user := x.st.user
		if len(st.Args) > 1 && st.Args[1] != "" {
			user = st.Args[1]
		}
		err := x.run(ctx, st.Args[0], user)
		if ce := new(connect.Error); errors.As(err, &ce) && !errors.Is(err, ErrExit) && !errors.Is(err, errStepTimeout) {
			// envd refused to run it (an unknown user): E2B's wording.
			return fmt.Errorf("failed to run command '%s': command failed: %w", st.Args[0], ce)
		}
		return err
	case StepEnv:
		env := maps.Clone(x.st.env)
		if env == nil {
			env = map[string]string{}
		}
		for i := 0; i < len(st.Args); i += 2 {
			env[st.Args[i]] = st.Args[i+1]
		}
		x.st.env = env
	case StepWorkdir:
		dir := st.Args[0]
		if !path.IsAbs(dir) {
			dir = path.Join(x.st.workdir, dir)
		}
		// Docker creates the directory; owning it by the current user lets later steps
		// that run as that user write there.
		q := shellQuote(dir)
		if out, err := x.quiet(ctx, fmt.Sprintf("[ -d %[1]s ] || { mkdir -p %[1]s && chown %[2]s %[1]s; }", q, shellQuote(x.st.user))); err != nil {
			return fmt.Errorf("create %s: %w: %s", dir, err, out)
		}
		x.st.workdir = dir
	case StepUser:
		// As in E2B, an unknown user fails the commands run as it, not this step.
		u, _, _ := strings.Cut(st.Args[0], ":")
		if _, err := x.quiet(ctx, "id "+shellQuote(u)); err != nil {
			x.missingUser, x.missingUserStep = u, 0
		}
		x.st.user = st.Args[0]
	case StepCopy:
		return x.copy(ctx, st)
	case StepDefaultUser:
		x.st.user = x.startUser
	case StepExpose:
		for _, p := range st.Args {
			if !slices.Contains(x.st.expose, p) {
				x.st.expose = append(slices.Clip(x.st.expose), p)
			}
		}
	case StepLabel:
		labels := maps.Clone(x.st.labels)
		if labels == nil {
			labels = map[string]string{}
		}
		for i := 0; i < len(st.Args); i += 2 {
			labels[st.Args[i]] = st.Args[i+1]
		}
		x.st.labels = labels
	default:
		return fmt.Errorf("unsupported step type %q", st.Type)
	}
	return nil
}

func (x *executor) copy(ctx context.Context, st Step) error {
	if x.files == nil {
		return errors.New("this node does not accept file uploads")
	}
	owner := x.st.user
	if len(st.Args) > 2 && st.Args[2] != "" {
		owner = st.Args[2]
	}
	dest := st.Args[1]
	if !path.IsAbs(dest) {
		dest = path.Join(x.st.workdir, dest) + map[bool]string{true: "/"}[strings.HasSuffix(dest, "/")]
	}
	p := copyPlan{src: st.Args[0], dest: path.Clean(dest)}
	p.destDir = strings.HasSuffix(dest, "/") || hasGlob(st.Args[0])
	if !p.destDir {
		if _, err := x.quiet(ctx, "[ -d "+shellQuote(p.dest)+" ]"); err == nil {
			p.destDir = true
		}
	}
	if len(st.Args) > 3 && st.Args[3] != "" {
		m, err := strconv.ParseInt(st.Args[3], 8, 32)
		if err != nil {
			return fmt.Errorf("mode %q: %w", st.Args[3], err)
		}
		p.mode = m
	}
	passwd, err := x.s.Download(ctx, "/etc/passwd")
	if err != nil {
		return fmt.Errorf("read /etc/passwd: %w", err)
	}
	group, _ := x.s.Download(ctx, "/etc/group")
	if p.uid, p.gid, err = lookupOwner(owner, passwd, group); err != nil {
		return err
	}
	up, err := x.files.Open(st.FilesHash)
	if err != nil {
		return err
	}
	defer up.Close()
	tmp, err := os.CreateTemp("", "aenv-copy-*.tar")
	if err != nil {
		return err
	}
	defer os.Remove(tmp.Name())
	defer tmp.Close()
	n, err := rewriteCopy(up, p, tmp)
	if err != nil {
		return err
	}
	if _, err := tmp.Seek(0, io.SeekStart); err != nil {
		return err
	}
	x.copies++
	remote := fmt.Sprintf("/tmp/.aenv-copy-%d.tar", x.copies)
	if err := x.s.Upload(ctx, remote, "root", tmp); err != nil {
		return err
	}
	out, err := x.quiet(ctx, fmt.Sprintf("tar -x -p -f %[1]s -C / ; rc=$?; rm -f %[1]s; exit $rc", remote))
	if err != nil {
		var exit *ExitError
		if errors.As(err, &exit) && exit.Code == 127 {
			return fmt.Errorf("the image has no tar, which COPY needs: %s", out)
		}
		return fmt.Errorf("unpack in the sandbox: %w: %s", err, out)
	}
	x.logf("info", fmt.Sprintf("copied %d entries to %s", n, p.dest))
	return nil
}

// ensureUser makes sure the E2B default user exists with home /home/user, as the SDKs
// assume. Images pulled by the node already have it; a RUN step may have removed it.
func (x *executor) ensureUser(ctx context.Context) error {
	script := `id user >/dev/null 2>&1 || { useradd -m -d /home/user -s /bin/bash user 2>/dev/null || adduser -D -h /home/user -s /bin/sh user; } && mkdir -p /home/user && { [ "$(stat -c %U /home/user)" = user ] || chown user: /home/user; }`
	if out, err := x.quiet(ctx, script); err != nil {
		return fmt.Errorf("make sure user `user` with home /home/user exists: %w: %s", err, out)
	}
	return nil
}

// imageUser resolves an image's USER (a name or uid, optionally with ":group") to the
// account name envd runs processes as. A USER the image has no account for falls back to
// `user`, with a warning: Docker would run as the bare uid, which envd cannot.
func (x *executor) imageUser(ctx context.Context, u string) string {
	name, _, _ := strings.Cut(u, ":")
	// Only entries envd can use (seven fields, numeric ids), as image.AccountName.
	out, err := x.quiet(ctx, fmt.Sprintf(`awk -F: -v u=%s 'NF>=7 && $1!="" && $3~/^[0-9]+$/ && $4~/^[0-9]+$/ && ($1==u||$3==u){print $1; exit}' /etc/passwd`, shellQuote(name)))
	if err == nil && out != "" && !strings.ContainsAny(out, " \n") {
		return out
	}
	x.logf("warn", fmt.Sprintf("the image's USER %q has no account in /etc/passwd; the default user is `user`", u))
	return "user"
}

// startAndWait starts the start command in the background and polls the ready
// command until it succeeds, the start command exits, or the ready timeout passes.
func (x *executor) startAndWait(ctx context.Context, startCmd, readyCmd string) error {
	if startCmd == "" && readyCmd == "" {
		return nil
	}
	startCtx, stopStart := context.WithCancel(ctx)
	defer stopStart()
	exited := make(chan error, 1)
	if startCmd != "" {
		x.logf("info", "start command: "+startCmd)
		out := &lineWriter{level: "info", logf: x.logf}
		go func() {
			err := x.s.Run(startCtx, Command{Script: startCmd, User: x.st.user, Dir: x.st.workdir, Env: x.st.env, Stdout: out, Stderr: out})
			out.flush()
			exited <- err
		}()
	}
	if readyCmd == "" {
		return nil // started: E2B treats a start command without a ready check as ready
	}
	x.logf("info", "waiting for the ready command: "+readyCmd)
	deadline := time.NewTimer(x.readyTimeout)
	defer deadline.Stop()
	var last string
	for {
		rctx, cancel := context.WithTimeout(ctx, min(x.readyTimeout, 30*time.Second))
		var out bytes.Buffer
		lb := &limitedBuffer{b: &out, n: 4 << 10}
		err := x.s.Run(rctx, Command{Script: readyCmd, User: x.st.user, Dir: x.st.workdir, Env: x.st.env, Stdout: lb, Stderr: lb})
		cancel()
		if err == nil {
			x.logf("info", "ready")
			return nil
		}
		last = strings.TrimSpace(err.Error() + ": " + out.String())
		select {
		case err := <-exited:
			return fmt.Errorf("the start command exited before the ready command succeeded (%v); last ready check: %s", err, last)
		case <-deadline.C:
			return fmt.Errorf("the ready command %q did not succeed within %s; last result: %s", readyCmd, x.readyTimeout, last)
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(500 * time.Millisecond):
		}
	}
}

// shellQuote quotes one word for sh.
func shellQuote(s string) string { return "'" + strings.ReplaceAll(s, "'", `'"'"'`) + "'" }
