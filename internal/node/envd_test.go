package node

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestFindEnvd(t *testing.T) {
	dir := t.TempDir()
	exe := filepath.Join(dir, "envd")
	os.WriteFile(exe, []byte("#!/bin/sh\n"), 0o755)
	if got, err := findEnvd(exe); err != nil || got != exe {
		t.Fatalf("findEnvd = %q, %v", got, err)
	}
	noexec := filepath.Join(dir, "plain")
	os.WriteFile(noexec, nil, 0o644)
	for _, p := range []string{noexec, dir, filepath.Join(dir, "missing")} {
		if _, err := findEnvd(p); err == nil || !strings.Contains(err.Error(), "--envd") {
			t.Errorf("findEnvd(%s) err = %v", p, err)
		}
	}
}
