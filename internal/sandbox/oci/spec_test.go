package oci

import (
	"os"
	"path/filepath"
	"testing"
)

func TestHostResolvConf(t *testing.T) {
	tests := []struct {
		name, content string
		use           bool
	}{
		{"remote", "nameserver 10.255.255.53\n", true},
		{"two remote", "search x\nnameserver 1.1.1.1\nnameserver 2606:4700::1111\n", true},
		{"systemd-resolved", "nameserver 127.0.0.53\noptions edns0\n", false},
		{"mixed", "nameserver 10.0.0.1\nnameserver ::1\n", false},
		{"no nameserver", "search example.com\n", false},
		{"garbage", "nameserver not-an-ip\n", false},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			p := filepath.Join(t.TempDir(), "resolv.conf")
			if err := os.WriteFile(p, []byte(tc.content), 0o644); err != nil {
				t.Fatal(err)
			}
			if got := hostResolvConf(p) == p; got != tc.use {
				t.Fatalf("use=%v, want %v", got, tc.use)
			}
		})
	}
	if hostResolvConf("/nonexistent") != "" {
		t.Fatal("missing file used")
	}
}

func TestBuildSpecLimits(t *testing.T) {
	tests := []struct {
		name            string
		p               specParams
		quota, memLimit int64
		userns          bool
	}{
		{"limits", specParams{cpuCount: 2, memoryMB: 512, pidsLimit: 100}, 200000, 512 << 20, false},
		{"no limits", specParams{pidsLimit: 100}, 0, 0, false},
		{"userns", specParams{cpuCount: 1, memoryMB: 64, idmap: &idMap{HostID: 165536, Size: 65536}}, 100000, 64 << 20, true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			s := buildSpec(tc.p)
			r := s.Linux.Resources
			if q := r.CPU.Quota; (q == nil && tc.quota != 0) || (q != nil && *q != tc.quota) {
				t.Errorf("quota %v, want %d", q, tc.quota)
			}
			if l := r.Memory.Limit; (l == nil && tc.memLimit != 0) || (l != nil && *l != tc.memLimit) {
				t.Errorf("memory %v, want %d", l, tc.memLimit)
			}
			if r.Pids.Limit != tc.p.pidsLimit {
				t.Errorf("pids %d", r.Pids.Limit)
			}
			hasUser := false
			for _, ns := range s.Linux.Namespaces {
				hasUser = hasUser || ns.Type == "user"
			}
			if hasUser != tc.userns || (tc.userns && s.Linux.UIDMappings[0].HostID != tc.p.idmap.HostID) {
				t.Errorf("userns %v mappings %v", hasUser, s.Linux.UIDMappings)
			}
			if s.Process.NoNewPrivileges || s.Linux.Seccomp == nil || len(s.Linux.MaskedPaths) == 0 {
				t.Error("hardening missing")
			}
			if a := s.Process.OOMScoreAdj; a == nil || *a <= 0 {
				t.Errorf("oomScoreAdj %v: the host's OOM killer would pick the data plane before a sandbox", a)
			}
		})
	}
}
