package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/signal"
	"strings"
	"sync/atomic"
	"syscall"
	"time"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"
	"golang.org/x/sys/unix"

	"github.com/aenv-dev/aenv/internal/envd/gen/process"
	"github.com/aenv-dev/aenv/internal/envd/gen/process/processconnect"
	"github.com/aenv-dev/aenv/internal/envdclient"
	"github.com/aenv-dev/aenv/internal/server/api"
)

const envdPort = "49983"

// envdClient reaches one sandbox's envd through the node's proxy, the way the SDKs do in
// single-server mode: the sandbox is named by headers, not by the path.
type envdClient struct {
	c    *client
	id   string
	envd *envdclient.Client
	proc processconnect.ProcessClient
}

func (c *client) envd(id, token string) *envdClient {
	e := &envdClient{c: c, id: id}
	e.envd = envdclient.New(c.http, c.base, envdclient.WithSandbox(id, envdPort), envdclient.WithAccessToken(token))
	e.proc = e.envd.Proc
	return e
}

// setHeaders adds the routing and auth headers of envd traffic.
func (e *envdClient) setHeaders(h http.Header) { e.envd.SetHeaders(h) }

// envdFor connects to a sandbox by ID: its token comes from the API (GET /sandboxes/{id}).
func (c *client) envdFor(ctx context.Context, id string) (*envdClient, error) {
	info, err := c.sandboxInfo(ctx, id)
	if err != nil {
		return nil, err
	}
	if info.State == api.Paused {
		return nil, fmt.Errorf("sandbox %s is paused: `aenv resume %[1]s` first (or use `aenv connect %[1]s`)", id)
	}
	token := ""
	if info.EnvdAccessToken != nil {
		token = *info.EnvdAccessToken
	}
	return c.envd(id, token), nil
}

// shellQuote joins args into one /bin/bash -c command line, quoting each argument.
func shellQuote(args []string) string {
	if len(args) == 1 {
		return args[0] // a single argument is already a command line (aenv exec ID -- 'ls | wc -l')
	}
	out := make([]string, len(args))
	for i, a := range args {
		if a != "" && strings.IndexFunc(a, func(r rune) bool {
			return !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || strings.ContainsRune("-_./=:,+@%", r))
		}) < 0 {
			out[i] = a
			continue
		}
		out[i] = "'" + strings.ReplaceAll(a, "'", `'\''`) + "'"
	}
	return strings.Join(out, " ")
}

// run starts cmdline with /bin/bash -l -c (as the SDKs do), streams its output and
// returns its exit status as a shell reports it: the exit code, or 128+N when signal N
// ended the command. stdin, when not nil, is forwarded to the command and closed at its
// EOF. An interrupt sends SIGTERM to the remote process.
func (e *envdClient) run(ctx context.Context, cmdline string, envs map[string]string, cwd, user string, stdin io.Reader, stdout, stderr io.Writer) (int, error) {
	streamCtx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	defer cancel()
	var pid atomic.Uint32
	go func() {
		<-streamCtx.Done()
		if ctx.Err() == nil {
			return // the command ended on its own
		}
		if pid := pid.Load(); pid != 0 {
			sig := connect.NewRequest(&process.SendSignalRequest{
				Process: &process.ProcessSelector{Selector: &process.ProcessSelector_Pid{Pid: pid}},
				Signal:  process.Signal_SIGNAL_SIGTERM,
			})
			sctx, scancel := context.WithTimeout(context.Background(), 5*time.Second)
			_, _ = e.proc.SendSignal(sctx, sig)
			scancel()
		}
		// A command that ignores SIGTERM must not hold the CLI forever.
		time.AfterFunc(10*time.Second, cancel)
	}()
	p, err := e.envd.Start(streamCtx, envdclient.Command{
		Cmd: "/bin/bash", Args: []string{"-l", "-c", cmdline}, Env: envs, Cwd: cwd, User: user, Stdin: stdin != nil,
	})
	if errors.Is(err, envdclient.ErrNoStart) {
		return 0, errNoExitStatus
	}
	if err != nil {
		return 0, e.rpcErr(err)
	}
	defer p.Close()
	pid.Store(p.Pid)
	if stdin != nil {
		go e.forwardStdin(streamCtx, p.Pid, stdin)
	}
	end, err := p.Wait(stdout, stderr)
	if errors.Is(err, envdclient.ErrNoEnd) {
		return 0, errNoExitStatus
	}
	if err != nil {
		return 0, e.rpcErr(err)
	}
	if !end.GetExited() {
		if n, ok := signalNumber(end.GetStatus()); ok {
			return 128 + n, nil
		}
		if end.GetError() != "" {
			return -1, fmt.Errorf("command failed: %s", end.GetError())
		}
	}
	return int(end.GetExitCode()), nil
}

// forwardStdin copies r to the process's stdin, then closes it (the command sees EOF).
func (e *envdClient) forwardStdin(ctx context.Context, pid uint32, r io.Reader) {
	sel := &process.ProcessSelector{Selector: &process.ProcessSelector_Pid{Pid: pid}}
	buf := make([]byte, 64<<10)
	for {
		n, err := r.Read(buf)
		if n > 0 {
			data := append([]byte(nil), buf[:n]...)
			if _, serr := e.proc.SendInput(ctx, connect.NewRequest(&process.SendInputRequest{Process: sel,
				Input: &process.ProcessInput{Input: &process.ProcessInput_Stdin{Stdin: data}}})); serr != nil {
				return // the process ended (or stopped reading): the rest has nowhere to go
			}
		}
		if err != nil {
			_, _ = e.proc.CloseStdin(ctx, connect.NewRequest(&process.CloseStdinRequest{Process: sel}))
			return
		}
	}
}

// signalNumber reads the signal out of an end event's status ("signal: killed", Go's
// ProcessState.String(), which E2B's envd sends too).
func signalNumber(status string) (int, bool) {
	name, ok := strings.CutPrefix(status, "signal: ")
	if !ok {
		return 0, false
	}
	name = strings.TrimSuffix(name, " (core dumped)")
	for n := 1; n < 65; n++ {
		if unix.Signal(n).String() == name {
			return n, true
		}
	}
	return 0, false
}

var errNoExitStatus = errors.New("the command's output stream ended without an exit status (the sandbox may have stopped)")

// rpcErr explains envd failures seen through the proxy.
func (e *envdClient) rpcErr(err error) error {
	switch connect.CodeOf(err) {
	case connect.CodeUnavailable:
		return fmt.Errorf("sandbox %s is not reachable (is it running? `aenv ls`): %w", e.id, err)
	case connect.CodeUnauthenticated:
		return fmt.Errorf("envd of sandbox %s refused the request: %w", e.id, err)
	}
	return fmt.Errorf("sandbox %s: %w", e.id, err)
}

func newExecCmd(g *globals) *cobra.Command {
	var (
		envs      []string
		cwd, user string
		noStdin   bool
	)
	cmd := &cobra.Command{
		Use:   "exec SANDBOX -- COMMAND [ARGS...]",
		Short: "Run a command in a sandbox, stream its output and exit with its status",
		Long: "Run a command in a sandbox, stream its output and exit with its status (128+N when\n" +
			"signal N ended it, as a shell reports). Stdin is forwarded unless it is a terminal\n" +
			"or -n is given.",
		Example: "  aenv exec sbx123 -- uname -a\n" +
			"  aenv exec sbx123 -- 'ls /etc | wc -l'\n" +
			"  echo hello | aenv exec sbx123 -- cat",
		Args: cobra.MinimumNArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			envMap, err := parseKV("--env", envs)
			if err != nil {
				return err
			}
			c, err := g.client()
			if err != nil {
				return err
			}
			e, err := c.envdFor(cmd.Context(), args[0])
			if err != nil {
				return err
			}
			var stdin io.Reader
			if in := cmd.InOrStdin(); !noStdin {
				// A terminal is not forwarded: a command would wait for typing that `aenv
				// exec` has no PTY to echo (use `aenv connect` for a shell).
				if f, ok := in.(*os.File); !ok || !isTerminal(f) {
					stdin = in
				}
			}
			code, err := e.run(cmd.Context(), shellQuote(args[1:]), envMap, cwd, user, stdin, cmd.OutOrStdout(), cmd.ErrOrStderr())
			if err != nil {
				return err
			}
			if code != 0 {
				if code < 0 {
					code = 1 // ended without an exit status or a signal
				}
				return exitCodeError{code: code}
			}
			return nil
		},
	}
	cmd.Flags().StringArrayVar(&envs, "env", nil, "environment variable KEY=VALUE for the command (repeatable)")
	cmd.Flags().StringVar(&cwd, "cwd", "", "working directory (default: the user's home)")
	cmd.Flags().StringVar(&user, "user", "", "run as this user (default: the sandbox's default user)")
	cmd.Flags().BoolVarP(&noStdin, "no-stdin", "n", false, "do not forward stdin (the command reads EOF)")
	return cmd
}

func newConnectCmd(g *globals) *cobra.Command {
	var timeout time.Duration
	cmd := &cobra.Command{
		Use:   "connect SANDBOX",
		Short: "Attach a shell to a sandbox, resuming it if it is paused",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := g.client()
			if err != nil {
				return err
			}
			sb, err := c.connectSandbox(cmd, args[0], timeout)
			if err != nil {
				return err
			}
			token := ""
			if sb.EnvdAccessToken != nil {
				token = *sb.EnvdAccessToken
			} else if info, err := c.sandboxInfo(cmd.Context(), args[0]); err == nil && info.EnvdAccessToken != nil {
				token = *info.EnvdAccessToken
			}
			// Keep the sandbox alive while the shell is attached.
			ctx, cancel := context.WithCancel(cmd.Context())
			defer cancel()
			go c.keepAlive(ctx, args[0], timeout)
			return c.envd(args[0], token).shell(ctx, os.Stdin, cmd.OutOrStdout(), cmd.ErrOrStderr())
		},
	}
	cmd.Flags().DurationVar(&timeout, "timeout", 5*time.Minute, "expiry extension while attached")
	return cmd
}

// keepAlive extends the sandbox's expiry every minute until ctx ends.
func (c *client) keepAlive(ctx context.Context, id string, d time.Duration) {
	secs := int(d / time.Second)
	t := time.NewTicker(time.Minute)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			_, _ = c.api.RefreshSandboxWithResponse(ctx, id, api.SandboxRefreshRequest{Duration: &secs})
		}
	}
}

// shell runs an interactive login shell on a PTY and bridges it to this terminal. Without
// a terminal on stdin (a script, a pipe, /dev/null) there is no one to type at a PTY: the
// shell reads its commands from stdin instead (as `docker exec -i`), ends at its EOF and
// its status is the command's.
func (e *envdClient) shell(ctx context.Context, in *os.File, stdout, stderr io.Writer) error {
	if !isTerminal(in) {
		code, err := e.run(ctx, "exec /bin/bash -s", nil, "", "", in, stdout, stderr)
		if err != nil {
			return err
		}
		if code != 0 {
			return exitCodeError{code: max(code, 1)}
		}
		return nil
	}
	fd := int(in.Fd())
	cols, rows := uint32(80), uint32(24)
	if ws, err := unix.IoctlGetWinsize(fd, unix.TIOCGWINSZ); err == nil && ws.Col > 0 {
		cols, rows = uint32(ws.Col), uint32(ws.Row)
	}
	term := firstNonEmpty(os.Getenv("TERM"), "xterm-256color")
	streamCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	p, err := e.envd.Start(streamCtx, envdclient.Command{
		Cmd: "/bin/bash", Args: []string{"-i", "-l"}, Env: map[string]string{"TERM": term}, Stdin: true,
		PTY: &process.PTY{Size: &process.PTY_Size{Cols: cols, Rows: rows}},
	})
	if errors.Is(err, envdclient.ErrNoStart) {
		return errors.New("the shell ended before it started")
	}
	if err != nil {
		return e.rpcErr(err)
	}
	defer p.Close()
	pid := p.Pid
	sel := &process.ProcessSelector{Selector: &process.ProcessSelector_Pid{Pid: pid}}

	restore, err := makeRaw(fd)
	if err != nil {
		return fmt.Errorf("put the terminal in raw mode: %w", err)
	}
	defer restore()
	winch := make(chan os.Signal, 1)
	signal.Notify(winch, syscall.SIGWINCH)
	defer signal.Stop(winch)
	go func() {
		for {
			select {
			case <-streamCtx.Done():
				return
			case <-winch:
				ws, err := unix.IoctlGetWinsize(fd, unix.TIOCGWINSZ)
				if err != nil {
					continue
				}
				_, _ = e.proc.Update(streamCtx, connect.NewRequest(&process.UpdateRequest{Process: sel,
					Pty: &process.PTY{Size: &process.PTY_Size{Cols: uint32(ws.Col), Rows: uint32(ws.Row)}}}))
			}
		}
	}()
	go func() {
		buf := make([]byte, 32*1024)
		for {
			n, err := in.Read(buf)
			if n > 0 {
				data := append([]byte(nil), buf[:n]...)
				_, serr := e.proc.SendInput(streamCtx, connect.NewRequest(&process.SendInputRequest{Process: sel,
					Input: &process.ProcessInput{Input: &process.ProcessInput_Pty{Pty: data}}}))
				if serr != nil {
					return
				}
			}
			if err != nil {
				// The terminal went away: end the shell's input as ^D would.
				_, _ = e.proc.SendInput(streamCtx, connect.NewRequest(&process.SendInputRequest{Process: sel,
					Input: &process.ProcessInput{Input: &process.ProcessInput_Pty{Pty: []byte{4}}}}))
				return
			}
		}
	}()
	end, err := p.Wait(stdout, stdout) // a PTY has one output
	if err == nil {
		if code := end.GetExitCode(); code != 0 {
			return exitCodeError{code: int(code)}
		}
		return nil
	}
	if !errors.Is(err, envdclient.ErrNoEnd) && ctx.Err() == nil {
		return e.rpcErr(err)
	}
	return nil
}

// makeRaw puts the terminal in raw mode (as x/term's MakeRaw does) and returns the undo.
func makeRaw(fd int) (func(), error) {
	t, err := unix.IoctlGetTermios(fd, unix.TCGETS)
	if err != nil {
		return nil, err
	}
	old := *t
	t.Iflag &^= unix.IGNBRK | unix.BRKINT | unix.PARMRK | unix.ISTRIP | unix.INLCR | unix.IGNCR | unix.ICRNL | unix.IXON
	t.Oflag &^= unix.OPOST
	t.Lflag &^= unix.ECHO | unix.ECHONL | unix.ICANON | unix.ISIG | unix.IEXTEN
	t.Cflag &^= unix.CSIZE | unix.PARENB
	t.Cflag |= unix.CS8
	t.Cc[unix.VMIN] = 1
	t.Cc[unix.VTIME] = 0
	if err := unix.IoctlSetTermios(fd, unix.TCSETS, t); err != nil {
		return nil, err
	}
	return func() { _ = unix.IoctlSetTermios(fd, unix.TCSETS, &old) }, nil
}
