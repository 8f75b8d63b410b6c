package blockdev

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

func TestFreeLoops(t *testing.T) {
	sys := t.TempDir()
	for _, d := range []string{"loop0/loop", "loop1", "loop10", "loop2/loop", "loop9", "vda", "loopx", "zram0"} {
		if err := os.MkdirAll(filepath.Join(sys, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	got, err := freeLoops(sys)
	if err != nil {
		t.Fatal(err)
	}
	if want := []int{1, 9, 10}; !slices.Equal(got, want) {
		t.Fatalf("free loops %v, want %v (attached ones and other devices left out, numeric order)", got, want)
	}
	if _, err := freeLoops(filepath.Join(sys, "missing")); err == nil {
		t.Fatal("a missing /sys/block listed without error")
	}
}

// TestRemoveLoops makes three devices of its own far above the host's, attaches a file to
// one, and removes all three: the attached one stays, the free ones are gone, and only
// they were listed free.
func TestRemoveLoops(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root (loop devices)")
	}
	ctl, err := os.OpenFile("/dev/loop-control", os.O_RDWR, 0)
	if err != nil {
		t.Skipf("needs /dev/loop-control: %v", err)
	}
	defer ctl.Close()
	base := highestLoop(t) + 1000
	nums := []int{base, base + 1, base + 2}
	for _, n := range nums {
		if err := unix.IoctlSetInt(int(ctl.Fd()), unix.LOOP_CTL_ADD, n); err != nil {
			t.Fatalf("add loop%d: %v", n, err)
		}
	}
	t.Cleanup(func() {
		for _, n := range nums {
			unix.IoctlSetInt(int(ctl.Fd()), unix.LOOP_CTL_REMOVE, n)
		}
	})
	backing := filepath.Join(t.TempDir(), "disk")
	if err := os.WriteFile(backing, make([]byte, 1<<20), 0o600); err != nil {
		t.Fatal(err)
	}
	attached := attachTo(t, nums[1], backing)
	defer attached.Detach()

	free, err := freeLoops(sysBlock)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Contains(free, nums[0]) || !slices.Contains(free, nums[2]) || slices.Contains(free, nums[1]) {
		t.Fatalf("free loops %v: want loop%d and loop%d, not the attached loop%d", free, nums[0], nums[2], nums[1])
	}
	removed, err := removeLoops(int(ctl.Fd()), nums)
	if err != nil {
		t.Fatal(err)
	}
	if removed != 2 {
		t.Fatalf("removed %d devices, want the 2 free ones", removed)
	}
	for i, n := range nums {
		_, err := os.Stat(filepath.Join(sysBlock, "loop"+strconv.Itoa(n)))
		if exists := err == nil; exists != (i == 1) {
			t.Fatalf("loop%d exists %v after the removal, want %v", n, exists, i == 1)
		}
	}
	// Gone already: skipped, not an error.
	if removed, err := removeLoops(int(ctl.Fd()), nums[:1]); err != nil || removed != 0 {
		t.Fatalf("removing a device that is gone: %d, %v; want 0, nil", removed, err)
	}
}

func highestLoop(t *testing.T) int {
	t.Helper()
	ents, err := os.ReadDir(sysBlock)
	if err != nil {
		t.Fatal(err)
	}
	hi := 0
	for _, e := range ents {
		if n, err := strconv.Atoi(strings.TrimPrefix(e.Name(), "loop")); err == nil && strings.HasPrefix(e.Name(), "loop") {
			hi = max(hi, n)
		}
	}
	return hi
}

// attachTo attaches backing to loop device n (not AttachLoop's choice).
func attachTo(t *testing.T, n int, backing string) *Loop {
	t.Helper()
	bf, err := os.OpenFile(backing, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer bf.Close()
	path := fmt.Sprintf("/dev/loop%d", n)
	lf, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	cfg := unix.LoopConfig{Fd: uint32(bf.Fd())}
	if err := unix.IoctlLoopConfigure(int(lf.Fd()), &cfg); err != nil {
		lf.Close()
		t.Fatal(err)
	}
	return &Loop{path: path, f: lf}
}
