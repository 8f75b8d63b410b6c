package vmm_test

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/aenv-dev/aenv/internal/vmm"
	"github.com/aenv-dev/aenv/internal/vmm/vmmtest"
)

// The test guest: busybox httpd on guest port 80 (a CGI that stores a mark in guest
// RAM) and a counter printed to the console every 100 ms, so continuity after a restore
// and divergence between forks are visible from outside.
const counterInit = vmmtest.InitHeader + `
httpd -p 80 -h /www
echo GUEST-READY
i=0
while :; do i=$((i+1)); echo $i > /www/count; echo "COUNT $i"; usleep 100000; done
`

var guestFiles = map[string]string{
	"www/cgi-bin/mark": "#!/bin/sh\necho \"$QUERY_STRING\" > /www/mark\nprintf 'Content-Type: text/plain\\r\\n\\r\\n'\ncat /www/mark\n",
}

const guestMiB = 128

type guest struct {
	kernel vmmtest.Kernel
	initrd string
}

func newGuest(t testing.TB) guest {
	t.Helper()
	vmmtest.RequireQEMU(t)
	k := vmmtest.GuestKernel(t)
	img, err := vmmtest.Initramfs(k, counterInit, guestFiles)
	if err != nil {
		t.Fatal(err)
	}
	p := filepath.Join(t.TempDir(), "initrd.cpio")
	if err := os.WriteFile(p, img, 0o644); err != nil {
		t.Fatal(err)
	}
	return guest{kernel: k, initrd: p}
}

// shmDir is a tmpfs directory for RAM files, removed after the test.
func shmDir(t testing.TB) string {
	t.Helper()
	d, err := os.MkdirTemp("/dev/shm", "aenv-vmm-test-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(d) })
	return d
}

func freePort(t testing.TB) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

// config is one VM of the test shape; name separates its files in dir.
func (g guest) config(t testing.TB, dir, name, ram string, share bool) vmm.Config {
	t.Helper()
	port := freePort(t)
	return vmm.Config{
		Accel: vmm.AccelTCG, CPUs: 1,
		Memory:     vmm.Memory{SizeMiB: guestMiB, Path: ram, Share: share},
		Kernel:     g.kernel.Vmlinux(),
		Initrd:     g.initrd,
		Cmdline:    "console=ttyS0 quiet no_timer_check tsc=reliable 8250.nr_uarts=1 random.trust_cpu=on cryptomgr.notests",
		TBSizeMiB:  64,
		ConsoleLog: filepath.Join(dir, name+".console"),
		QMPSocket:  filepath.Join(dir, name+".qmp"),
		PIDFile:    filepath.Join(dir, name+".pid"),
		LogFile:    filepath.Join(dir, name+".log"),
		NICs: []vmm.NIC{{ID: "n0", User: true,
			Forward: []vmm.HostForward{{Host: netip.AddrPortFrom(netip.MustParseAddr("127.0.0.1"), uint16(port)), GuestPort: 80}}}},
	}
}

func hostPort(c vmm.Config) int { return int(c.NICs[0].Forward[0].Host.Port()) }

func start(t testing.TB, cfg vmm.Config) *vmm.Machine {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	m, err := vmm.Start(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(m.Kill)
	return m
}

var countRE = regexp.MustCompile(`(?m)^COUNT (\d+)\r?$`)

// counts returns every counter value on the console so far.
func counts(t testing.TB, console string) []int {
	t.Helper()
	b, err := os.ReadFile(console)
	if err != nil && !os.IsNotExist(err) {
		t.Fatal(err)
	}
	var out []int
	for _, m := range countRE.FindAllSubmatch(b, -1) {
		n, _ := strconv.Atoi(string(m[1]))
		out = append(out, n)
	}
	return out
}

// waitCounts waits until the console shows at least n counter lines.
func waitCounts(t testing.TB, m *vmm.Machine, n int, timeout time.Duration) []int {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		c := counts(t, m.Config().ConsoleLog)
		if len(c) >= n {
			return c
		}
		select {
		case <-m.Exited():
			t.Fatalf("QEMU exited: %v; console:\n%s", m.Wait(context.Background()), tail(m.Config().ConsoleLog))
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("console shows %d counter lines after %v, want %d:\n%s", len(c), timeout, n, tail(m.Config().ConsoleLog))
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func tail(path string) string {
	b, _ := os.ReadFile(path)
	if len(b) > 2000 {
		b = b[len(b)-2000:]
	}
	return string(b)
}

var httpClient = &http.Client{Timeout: 2 * time.Second}

// get fetches a guest URL path through the VM's host forward, retrying until timeout:
// slirp accepts connections even while the guest is not listening yet.
func get(t testing.TB, port int, path string, timeout time.Duration) string {
	t.Helper()
	s, err := tryGet(port, path, timeout)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func tryGet(port int, path string, timeout time.Duration) (string, error) {
	deadline := time.Now().Add(timeout)
	var last error
	for time.Now().Before(deadline) {
		resp, err := httpClient.Get(fmt.Sprintf("http://127.0.0.1:%d%s", port, path))
		if err == nil {
			b, rerr := io.ReadAll(resp.Body)
			resp.Body.Close()
			if rerr == nil && resp.StatusCode == http.StatusOK {
				return strings.TrimSpace(string(b)), nil
			}
			err = fmt.Errorf("status %d, %v", resp.StatusCode, rerr)
		}
		last = err
		time.Sleep(5 * time.Millisecond)
	}
	return "", fmt.Errorf("GET %s on port %d: %w", path, port, last)
}

func processGone(pid int) bool {
	_, err := os.Stat(fmt.Sprintf("/proc/%d", pid))
	return os.IsNotExist(err)
}

// processesMentioning lists processes whose command line contains s.
func processesMentioning(t testing.TB, s string) []int {
	t.Helper()
	ents, err := os.ReadDir("/proc")
	if err != nil {
		t.Fatal(err)
	}
	var pids []int
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		b, err := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		if err == nil && strings.Contains(string(b), s) {
			pids = append(pids, pid)
		}
	}
	return pids
}
