package bench

import (
	"bufio"
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
)

// SandboxPSS sums the proportional set size of the host processes that belong to the
// sandbox id under procRoot ("/proc" for this machine): those whose command line or
// cgroup names it (a microVM's QEMU has the sandbox's directory on its command line, a
// container's processes live in its cgroup). PSS charges each shared page to its
// mappers in equal parts, so the sum over the children of one fork is what they cost
// together, their shared memory image counted once. It also returns how many processes
// matched; a process that ends during the scan is skipped.
func SandboxPSS(procRoot, id string) (pss int64, procs int, err error) {
	if id == "" {
		return 0, 0, fmt.Errorf("bench: PSS of an empty sandbox id")
	}
	dirs, err := filepath.Glob(filepath.Join(procRoot, "[0-9]*"))
	if err != nil {
		return 0, 0, fmt.Errorf("bench: list processes: %w", err)
	}
	needle := []byte(id)
	for _, d := range dirs {
		if !namesSandbox(d, needle) {
			continue
		}
		p, err := rollupPSS(filepath.Join(d, "smaps_rollup"))
		if err != nil {
			continue // gone meanwhile
		}
		pss += p
		procs++
	}
	return pss, procs, nil
}

func namesSandbox(procDir string, id []byte) bool {
	for _, f := range []string{"cmdline", "cgroup"} {
		if raw, err := os.ReadFile(filepath.Join(procDir, f)); err == nil && bytes.Contains(raw, id) {
			return true
		}
	}
	return false
}

// rollupPSS reads the Pss line (kB) of a smaps_rollup file.
func rollupPSS(path string) (int64, error) {
	raw, err := os.ReadFile(path)
	if err != nil {
		return 0, err
	}
	sc := bufio.NewScanner(bytes.NewReader(raw))
	for sc.Scan() {
		f := bytes.Fields(sc.Bytes())
		if len(f) >= 2 && string(f[0]) == "Pss:" {
			kb, err := strconv.ParseInt(string(f[1]), 10, 64)
			if err != nil {
				return 0, fmt.Errorf("bench: %s: %w", path, err)
			}
			return kb << 10, nil
		}
	}
	return 0, fmt.Errorf("bench: %s has no Pss line", path)
}
