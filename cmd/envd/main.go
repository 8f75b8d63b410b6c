// Command envd is the in-sandbox daemon the E2B SDKs talk to: Connect-RPC process and filesystem
// services plus /files, /health, /init, /envs and /metrics on port 49983. It is static, runs as PID 1
// in containers (reaping orphans and forwarding signals) or as an ordinary process.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"strconv"
	"sync"
	"syscall"
	"time"

	"github.com/aenv-dev/aenv/internal/envd"
	"github.com/aenv-dev/aenv/internal/envd/identity"
	"github.com/aenv-dev/aenv/internal/envd/reaper"
	"github.com/aenv-dev/aenv/internal/envd/state"
	"github.com/aenv-dev/aenv/internal/lazygc"
)

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "envd:", err)
		os.Exit(1)
	}
}

func run() error {
	var (
		port        = flag.Int("port", 49983, "TCP port to listen on")
		host        = flag.String("host", "", "address to listen on (default: all interfaces)")
		socket      = flag.String("socket", "", "also listen on this Unix socket path")
		defaultUser = flag.String("user", "", "default user until /init sets one (default: root, or the current user when not root)")
		passwd      = flag.String("passwd", "/etc/passwd", "passwd file users are resolved from")
		group       = flag.String("group", "/etc/group", "group file supplementary groups are read from")
		forward     = flag.Bool("forward-signals", true, "forward SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1 and SIGUSR2 to running processes, and shut down on SIGTERM/SIGINT after -shutdown-grace (false: those signals end envd at once; for containers their runtime ends with SIGKILL, as Go's signal delivery keeps three threads in every idle envd)")
		grace       = flag.Duration("shutdown-grace", 5*time.Second, "on SIGTERM/SIGINT, how long processes get before SIGKILL")
		subreaper   = flag.Bool("subreaper", true, "when not PID 1, adopt and reap orphaned descendants (PR_SET_CHILD_SUBREAPER)")
		setClock    = flag.Bool("set-clock", false, "let POST /init set the system clock forward from its timestamp (VM guests)")
		setHostname = flag.Bool("set-hostname", false, "let POST /init set the host name to the sandbox's id (E2B_SANDBOX_ID) (VM guests, whose restored memory holds the captured sandbox's name)")
		idleTrim    = flag.Duration("idle-trim", 10*time.Second, "after a burst of requests, return freed memory to the OS once this long passes without one (0: never; VM guests, where the OS keeps it anyway)")
		trimMin     = flag.Int("idle-trim-min-kb", 0, "with -idle-trim: trim only when the heap grew by at least this many KiB since the last trim (a trim is a collection, whose first one leaves ~1.1 MiB of the collector's memory resident)")
		gcLimit     = flag.Int("gc-limit-mb", 0, "collect only when the Go runtime's memory reaches this many MiB, switching to Go's default collector while the live heap is above a quarter of it (0: Go's default collector; containers, where an idle envd that never collects keeps ~1.1 MiB less)")
		verbose     = flag.Bool("v", false, "log every request")
		version     = flag.Bool("version", false, "print the envd protocol version and exit")
	)
	flag.Parse()
	if *version {
		fmt.Println(envd.Version)
		return nil
	}
	lazygc.New(int64(*gcLimit) << 20)
	level := slog.LevelInfo
	if *verbose {
		level = slog.LevelDebug
	}
	log := slog.New(slog.NewTextHandler(logOutput(), &slog.HandlerOptions{Level: level}))
	pid1 := os.Getpid() == 1

	// Signals first, so that none is lost to the default action (which PID 1 would ignore anyway).
	sigs := make(chan os.Signal, 8)
	if *forward {
		signal.Notify(sigs, syscall.SIGTERM, syscall.SIGINT, syscall.SIGHUP, syscall.SIGQUIT, syscall.SIGUSR1, syscall.SIGUSR2)
	}

	r, err := reaper.New(*subreaper)
	if err != nil {
		log.Warn("reaper: subreaper unavailable; waiting per child", "err", err)
	}
	var waiter reaper.Waiter = reaper.Direct{}
	if r != nil {
		waiter = r
	}
	users := identity.NewDB(*passwd, *group)
	if *defaultUser == "" {
		*defaultUser = "root"
		if uid := os.Geteuid(); uid != 0 {
			*defaultUser = users.Names().User(uint32(uid))
		}
	}
	runDir, hostsFile := "", ""
	if pid1 {
		runDir, hostsFile = "/run/e2b", "/etc/hosts"
	}
	srv := envd.New(envd.Config{
		Users:       users,
		Defaults:    state.New(*defaultUser),
		Waiter:      waiter,
		Logger:      log,
		RunDir:      runDir,
		SetClock:    *setClock,
		SetHostname: *setHostname,
		HostsFile:   hostsFile,
	})
	if runDir != "" {
		// Made at start rather than by the first /init: a warm container's envd starts
		// before the sandbox it becomes is asked for, so this is off the create's path.
		_ = os.MkdirAll(runDir, 0o755)
	}
	var handler http.Handler = srv
	if *verbose {
		handler = logRequests(log, srv)
	}
	protocols := new(http.Protocols)
	protocols.SetHTTP1(true)
	protocols.SetUnencryptedHTTP2(true) // gRPC clients over h2c
	hs := &http.Server{Handler: handler, Protocols: protocols, ReadHeaderTimeout: 30 * time.Second, IdleTimeout: 10 * time.Minute}

	var listeners []net.Listener
	ln, err := net.Listen("tcp", net.JoinHostPort(*host, strconv.Itoa(*port)))
	if err != nil {
		return err
	}
	listeners = append(listeners, ln)
	if *socket != "" {
		_ = os.Remove(*socket)
		uln, err := net.Listen("unix", *socket)
		if err != nil {
			return err
		}
		listeners = append(listeners, uln)
	}
	log.Info("envd listening", "addr", ln.Addr().String(), "socket", *socket, "version", envd.Version, "pid1", pid1)

	if *idleTrim > 0 {
		srv.TrimWhenIdle(*idleTrim, int64(*trimMin)<<10)
	}
	// A warm container's envd waits here to be claimed: what the first command would
	// initialise lazily is done now, beside the node's readiness check.
	go envd.Warm()

	errc := make(chan error, len(listeners))
	for _, l := range listeners {
		go func(l net.Listener) { errc <- hs.Serve(l) }(l)
	}

	for {
		select {
		case err := <-errc:
			if errors.Is(err, http.ErrServerClosed) {
				return nil
			}
			return err
		case sig := <-sigs:
			s := sig.(syscall.Signal)
			n := srv.Process.SignalAll(s)
			log.Info("signal", "signal", s.String(), "forwarded_to", n)
			if s != syscall.SIGTERM && s != syscall.SIGINT {
				continue
			}
			shutdown(log, hs, srv, *grace)
			if *socket != "" {
				_ = os.Remove(*socket)
			}
			return nil
		}
	}
}

// shutdown stops accepting requests, gives processes the grace period to exit after the forwarded
// signal, then kills what is left.
func shutdown(log *slog.Logger, hs *http.Server, srv *envd.Server, grace time.Duration) {
	deadline := time.Now().Add(grace)
	for srv.Process.Running() > 0 && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
	}
	if n := srv.Process.SignalAll(syscall.SIGKILL); n > 0 {
		log.Info("killed processes left after the grace period", "count", n)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	var wg sync.WaitGroup
	wg.Add(1)
	go func() { defer wg.Done(); _ = hs.Shutdown(ctx) }()
	wg.Wait()
	_ = hs.Close()
	srv.Close()
}

// logOutput is where envd logs: a duplicate of its standard error, so that a write to one
// whose reader is gone fails instead of ending envd (Go ends a program whose write to fd 1
// or 2 meets a closed pipe). envd does not ignore SIGPIPE for the same end: an ignored
// signal is inherited across exec, and every command would get EPIPE in place of the
// SIGPIPE a pipeline's writer expects (`yes | head -1` printing "Broken pipe").
func logOutput() io.Writer {
	fd, err := syscall.Dup(2)
	if err != nil {
		return os.Stderr
	}
	syscall.CloseOnExec(fd)
	return os.NewFile(uintptr(fd), "stderr")
}

func logRequests(log *slog.Logger, next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		start := time.Now()
		next.ServeHTTP(w, r)
		log.Debug("request", "method", r.Method, "path", r.URL.Path, "dur", time.Since(start))
	})
}
