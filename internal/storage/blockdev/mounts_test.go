package blockdev

import (
	"slices"
	"testing"
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
