package oci

import (
	"reflect"
	"testing"

	"github.com/moby/sys/mountinfo"
)

func TestParseMountsUnder(t *testing.T) {
	table := `22 1 0:21 / /sys rw - sysfs sysfs rw
26 1 254:0 / / rw - ext4 /dev/vda rw
40 26 7:1 / /data/sb/a/rootfs rw - ext4 /dev/loop1 rw
41 26 0:50 /data/sb/a/x /elsewhere rw - none none rw
42 26 0:51 / /data/sb/ab rw - tmpfs t rw
43 40 0:52 / /data/sb/a/rootfs/proc rw - proc proc rw
44 26 0:53 / /data/sb/a\040b/rootfs rw - tmpfs t rw
45 26 0:54 / /data/sb/a rw - tmpfs t rw
46 26 0:55 / /data/sb/back\134slash rw - tmpfs t rw
47 26 0:56 / /data/sb/bad\04 rw - tmpfs t rw
short line`
	tests := []struct {
		dir  string
		want []string
	}{
		{"/data/sb/a", []string{"/data/sb/a/rootfs", "/data/sb/a/rootfs/proc", "/data/sb/a"}},
		{"/data/sb/a/", []string{"/data/sb/a/rootfs", "/data/sb/a/rootfs/proc", "/data/sb/a"}},
		{"/data/sb/a b", []string{"/data/sb/a b/rootfs"}},
		{`/data/sb/back\slash`, []string{`/data/sb/back\slash`}},
		{"/data/sb/none", nil},
		{"/sys", []string{"/sys"}},
	}
	for _, tc := range tests {
		if got := parseMountsUnder([]byte(table), tc.dir); !reflect.DeepEqual(got, tc.want) {
			t.Errorf("parseMountsUnder(%q) = %q, want %q", tc.dir, got, tc.want)
		}
	}
}

// TestMountsUnderMatchesMoby checks the scan against moby's parser (what it replaced) on
// this host's table, under directories other sessions do not mount in.
func TestMountsUnderMatchesMoby(t *testing.T) {
	for _, dir := range []string{"/sys", "/proc", "/dev", "/nonexistent"} {
		infos, err := mountinfo.GetMounts(mountinfo.PrefixFilter(dir))
		if err != nil {
			t.Fatal(err)
		}
		var want []string
		for _, m := range infos {
			want = append(want, m.Mountpoint)
		}
		got, err := mountsUnder(dir)
		if err != nil {
			t.Fatal(err)
		}
		if !reflect.DeepEqual(got, want) {
			t.Errorf("mountsUnder(%q) = %q, moby %q", dir, got, want)
		}
	}
}

func BenchmarkMountsUnder(b *testing.B) {
	for i := 0; i < b.N; i++ {
		if _, err := mountsUnder("/data/none"); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkMountsUnderMoby is what mountsUnder replaced, for comparison.
func BenchmarkMountsUnderMoby(b *testing.B) {
	for i := 0; i < b.N; i++ {
		if _, err := mountinfo.GetMounts(mountinfo.PrefixFilter("/data/none")); err != nil {
			b.Fatal(err)
		}
	}
}
