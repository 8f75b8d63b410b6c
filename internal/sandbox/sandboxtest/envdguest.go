package sandboxtest

import (
	"bytes"
	"context"
	"fmt"
	"net/http"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/aenv-dev/aenv/internal/envdclient"
	"github.com/aenv-dev/aenv/internal/sandbox"
)

// EnvdGuest is the Guest of backends that run the real envd: everything is a /bin/sh
// script started through envd's process service, as root (the template needs a POSIX
// shell and coreutils or busybox).
type EnvdGuest struct {
	// Token is envd's access token, when the backend's sandboxes were initialised with one.
	Token string
}

var _ Guest = EnvdGuest{}

// Sh runs script in inst and returns its stdout; a non-zero exit is an error carrying
// stderr.
func (g EnvdGuest) Sh(ctx context.Context, inst sandbox.Instance, script string) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, 60*time.Second)
	defer cancel()
	c := envdclient.New(http.DefaultClient, "http://"+endpointAddr(inst.Endpoint()), envdclient.WithAccessToken(g.Token))
	p, err := c.Start(ctx, envdclient.Command{Cmd: "/bin/sh", Args: []string{"-c", script}, User: "root"})
	if err != nil {
		return "", fmt.Errorf("start %q in %s: %w", script, inst.ID(), err)
	}
	defer p.Close()
	var stdout, stderr bytes.Buffer
	end, err := p.Wait(&stdout, &stderr)
	if err != nil {
		return "", fmt.Errorf("wait for %q in %s: %w", script, inst.ID(), err)
	}
	if !end.GetExited() || end.GetExitCode() != 0 {
		return stdout.String(), fmt.Errorf("%q in %s: exit %d (%s): %s", script, inst.ID(), end.GetExitCode(), end.GetStatus(), stderr.String())
	}
	return stdout.String(), nil
}

// quote makes s one single-quoted shell word.
func quote(s string) string { return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'" }

// WriteFile implements Guest.
func (g EnvdGuest) WriteFile(ctx context.Context, inst sandbox.Instance, path, data string) error {
	_, err := g.Sh(ctx, inst, fmt.Sprintf("mkdir -p \"$(dirname %[1]s)\" && printf %%s %[2]s > %[1]s && sync", quote(path), quote(data)))
	return err
}

// ReadFile implements Guest.
func (g EnvdGuest) ReadFile(ctx context.Context, inst sandbox.Instance, path string) (string, error) {
	out, err := g.Sh(ctx, inst, fmt.Sprintf("if [ -e %[1]s ]; then echo y; cat %[1]s; else echo n; fi", quote(path)))
	if err != nil {
		return "", err
	}
	exists, data, _ := strings.Cut(out, "\n")
	if exists != "y" {
		return "", fmt.Errorf("%s in %s: %w", path, inst.ID(), os.ErrNotExist)
	}
	return data, nil
}

// procLoop is the background process: a shell whose $0 is the name, found again by its
// command line.
const procLoop = "while :; do sleep 1; done"

// StartProcess implements Guest: a detached shell loop in its own session, so it
// outlives the envd process that started it.
func (g EnvdGuest) StartProcess(ctx context.Context, inst sandbox.Instance, name string) error {
	_, err := g.Sh(ctx, inst, fmt.Sprintf("setsid sh -c %s %s </dev/null >/dev/null 2>&1 &", quote(procLoop), quote(name)))
	if err != nil {
		return err
	}
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		ok, err := g.Running(ctx, inst, name)
		if err != nil || ok {
			return err
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("process %s did not start in %s", name, inst.ID())
		}
	}
}

// Running implements Guest: some process's command line is exactly the loop's.
func (g EnvdGuest) Running(ctx context.Context, inst sandbox.Instance, name string) (bool, error) {
	want := strings.Join([]string{"sh", "-c", procLoop, name}, "\x00") + "\x00"
	out, err := g.Sh(ctx, inst, "for f in /proc/[0-9]*/cmdline; do cat \"$f\" 2>/dev/null; echo; done")
	if err != nil {
		return false, err
	}
	for _, line := range strings.Split(out, "\n") {
		if line == want {
			return true, nil
		}
	}
	return false, nil
}

// limitsScript prints the CPU quota (or online CPUs) and the memory limit (or MemTotal)
// in bytes, as cgroup v2, cgroup v1 or a VM shows them.
const limitsScript = `
cpu=""
if [ -r /sys/fs/cgroup/cpu.max ]; then
  set -- $(cat /sys/fs/cgroup/cpu.max); [ "$1" != max ] && cpu=$(( $1 / $2 ))
elif [ -r /sys/fs/cgroup/cpu/cpu.cfs_quota_us ]; then
  q=$(cat /sys/fs/cgroup/cpu/cpu.cfs_quota_us); p=$(cat /sys/fs/cgroup/cpu/cpu.cfs_period_us)
  [ "$q" -gt 0 ] && cpu=$(( q / p ))
fi
[ -n "$cpu" ] || cpu=$(grep -c ^processor /proc/cpuinfo)
mem=""
if [ -r /sys/fs/cgroup/memory.max ]; then
  m=$(cat /sys/fs/cgroup/memory.max); [ "$m" != max ] && mem=$m
elif [ -r /sys/fs/cgroup/memory/memory.limit_in_bytes ]; then
  mem=$(cat /sys/fs/cgroup/memory/memory.limit_in_bytes)
  [ "$mem" -gt 1099511627776 ] && mem=""
fi
[ -n "$mem" ] || mem=$(( $(awk '/^MemTotal:/ {print $2}' /proc/meminfo) * 1024 ))
echo "$cpu $mem"
`

// Limits implements Guest.
func (g EnvdGuest) Limits(ctx context.Context, inst sandbox.Instance) (sandbox.Resources, error) {
	out, err := g.Sh(ctx, inst, limitsScript)
	if err != nil {
		return sandbox.Resources{}, err
	}
	f := strings.Fields(out)
	if len(f) != 2 {
		return sandbox.Resources{}, fmt.Errorf("limits of %s: unexpected output %q", inst.ID(), out)
	}
	cpu, err1 := strconv.Atoi(f[0])
	mem, err2 := strconv.ParseInt(f[1], 10, 64)
	if err1 != nil || err2 != nil {
		return sandbox.Resources{}, fmt.Errorf("limits of %s: unexpected output %q", inst.ID(), out)
	}
	return sandbox.Resources{CPUCount: cpu, MemoryMB: int(mem >> 20)}, nil
}
