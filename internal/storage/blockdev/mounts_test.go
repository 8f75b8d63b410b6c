package blockdev

import (
	"fmt"
	"os"
	"slices"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

func TestFUSEUnder(t *testing.T) {
	ms := Mounts{entries: []mountEntry{
		{dir: "/d/sandboxes/a/disk", fstype: fsType, source: fsName},
		{dir: "/d/sandboxes/b/disk", fstype: fsType, source: fsName},
		{dir: "/d/sandboxes/b/rootfs", fstype: "ext4", source: "/dev/loop3"},
		{dir: "/d/sandboxes/c/disk", fstype: "fuse.other", source: fsName},
		{dir: "/d/sandboxes-2/e/disk", fstype: fsType, source: fsName},
		{dir: "/elsewhere/disk", fstype: fsType, source: fsName},
	}}
	for _, c := range []struct {
		keep []string
		want []string
	}{
		{nil, []string{"/d/sandboxes/a/disk", "/d/sandboxes/b/disk"}},
		{[]string{"/d/sandboxes/a"}, []string{"/d/sandboxes/b/disk"}},
		{[]string{"/d/sandboxes/a/disk", "/d/sandboxes/b"}, nil},
	} {
		if got := ms.FUSEUnder("/d/sandboxes", c.keep...); !slices.Equal(got, c.want) {
			t.Errorf("FUSEUnder(keep %v) = %v, want %v", c.keep, got, c.want)
		}
	}
}

// TestMountsDevice checks the device name of every block-device mount of this host against
// the kernel's DEVNAME in its uevent file.
func TestMountsDevice(t *testing.T) {
	ms, err := ReadMounts()
	if err != nil {
		t.Fatal(err)
	}
	checked := 0
	for _, m := range ms.entries {
		raw, err := os.ReadFile(fmt.Sprintf("/sys/dev/block/%d:%d/uevent", unix.Major(m.dev), unix.Minor(m.dev)))
		if err != nil {
			continue // not a block device (tmpfs, overlay, proc...)
		}
		var want string
		for _, line := range strings.Split(string(raw), "\n") {
			if name, ok := strings.CutPrefix(line, "DEVNAME="); ok {
				want = "/dev/" + name
			}
		}
		if top := ms.top(m.dir); top != m {
			continue // another mount is on top of this one
		}
		got, err := ms.Device(m.dir)
		if err != nil {
			t.Errorf("Device(%s): %v", m.dir, err)
			continue
		}
		if got != want {
			t.Errorf("Device(%s) = %s, want %s", m.dir, got, want)
		}
		checked++
	}
	if checked == 0 {
		t.Skip("no filesystem on this host is mounted from a block device")
	}
	if _, err := ms.Device("/no/such/mount"); err == nil {
		t.Error("Device of a directory with nothing mounted: no error")
	}
}
