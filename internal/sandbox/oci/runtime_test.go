package oci

import (
	"fmt"
	"os/exec"
	"testing"

	"golang.org/x/sys/unix"
)

// Each runtime's answer for a container it does not have, as they print it, and errors
// that are not that.
func TestNoContainer(t *testing.T) {
	const root = "/var/lib/aenv/oci/crun"
	for _, tc := range []struct {
		name, msg string
		want      bool
	}{
		{"runc", `time="2026-12-05T12:30:09Z" level=error msg="container does not exist"`, true},
		{"crun state", "error opening file `/var/lib/aenv/oci/crun/pd-a/status`: No such file or directory", true},
		{"crun delete", "cannot open directory '/var/lib/aenv/oci/crun/pd-a': No such file or directory", true},
		{"runsc", "loading container: container not found", true},
		{"crun, another file missing", "open `/sys/fs/cgroup/cpuset/aenv/x/cpuset.cpus`: No such file or directory", false},
		{"crun, another root", "error opening file `/run/crun/pd-a/status`: No such file or directory", false},
		{"runc, permission", `level=error msg="open /run/x: permission denied"`, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := noContainer(tc.msg, root); got != tc.want {
				t.Errorf("noContainer(%q) = %v, want %v", tc.msg, got, tc.want)
			}
		})
	}
}

// BenchmarkRuntimeCommand measures what one command of the runtime costs before it does
// anything (`--version`), run from its file and from the sealed copy the node runs it
// from (sealedCopy): crun re-executes itself from its file at every command. cpu-ms/op is
// the children's CPU per command.
func BenchmarkRuntimeCommand(b *testing.B) {
	for _, name := range []string{"crun", "runc"} {
		bin, err := exec.LookPath(name)
		if err != nil {
			continue
		}
		f, err := sealedCopy(name, bin)
		if err != nil {
			b.Fatal(err)
		}
		defer f.Close()
		for _, run := range []struct{ from, path string }{{"file", bin}, {"sealed", fmt.Sprintf("/proc/self/fd/%d", f.Fd())}} {
			b.Run(name+"/"+run.from, func(b *testing.B) {
				children := func() int64 {
					var c unix.Rusage
					_ = unix.Getrusage(unix.RUSAGE_CHILDREN, &c)
					return c.Utime.Nano() + c.Stime.Nano()
				}
				c0 := children()
				for range b.N {
					if out, err := exec.Command(run.path, "--version").CombinedOutput(); err != nil {
						b.Fatalf("%s --version: %v: %s", name, err, out)
					}
				}
				b.ReportMetric(float64(children()-c0)/float64(b.N)/1e6, "cpu-ms/op")
			})
		}
	}
}
