package reaper

import (
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

func fork(argv ...string) func() (int, error) {
	return func() (int, error) {
		return syscall.ForkExec(argv[0], argv, &syscall.ProcAttr{Files: []uintptr{0, 1, 2}})
	}
}

func TestDirect(t *testing.T) {
	_, wait, err := Direct{}.Start(fork("/bin/sh", "-c", "exit 5"))
	if err != nil {
		t.Fatal(err)
	}
	if ws := wait(); !ws.Exited() || ws.ExitStatus() != 5 {
		t.Fatalf("status %v", ws)
	}
	if _, _, err := (Direct{}).Start(fork("/no/such")); err == nil {
		t.Fatal("want error")
	}
}

// zombies lists this process's children in state Z.
func zombies() []int {
	var out []int
	self := os.Getpid()
	des, _ := os.ReadDir("/proc")
	for _, d := range des {
		pid, err := strconv.Atoi(d.Name())
		if err != nil {
			continue
		}
		b, err := os.ReadFile("/proc/" + d.Name() + "/stat")
		if err != nil {
			continue
		}
		s := string(b)
		f := strings.Fields(s[strings.LastIndexByte(s, ')')+2:])
		if len(f) > 1 && f[0] == "Z" && f[1] == strconv.Itoa(self) {
			out = append(out, pid)
		}
	}
	return out
}

// The reaping loop takes over wait4(-1) for the whole process, so it runs in a child: the test
// binary re-executed as a subreaper.
func TestMain(m *testing.M) {
	if os.Getenv("REAPER_HELPER") == "1" {
		os.Exit(helper())
	}
	os.Exit(m.Run())
}

func helper() int {
	r, err := New(true)
	if err != nil {
		fmt.Println("new:", err)
		return 1
	}
	defer r.Stop()
	// Many short children, each leaving an orphan behind that re-parents to us.
	for i := 0; i < 50; i++ {
		_, wait, err := r.Start(fork("/bin/sh", "-c", "sleep 0.05 & exit 3"))
		if err != nil {
			fmt.Println("start:", err)
			return 1
		}
		if ws := wait(); ws.ExitStatus() != 3 {
			fmt.Println("status:", ws)
			return 1
		}
	}
	deadline := time.Now().Add(5 * time.Second)
	for r.Orphans() < 50 && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	if r.Orphans() != 50 {
		fmt.Println("orphans reaped:", r.Orphans())
		return 1
	}
	if z := zombies(); len(z) > 0 {
		fmt.Println("zombies:", z)
		return 1
	}
	fmt.Println("OK")
	return 0
}

func TestReaperAdoptsAndReapsOrphans(t *testing.T) {
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), "REAPER_HELPER=1")
	out, err := cmd.CombinedOutput()
	if err != nil || !strings.Contains(string(out), "OK") {
		t.Fatalf("%v: %s", err, out)
	}
}
