package oci

import "testing"

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
