package oci

import (
	"bufio"
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"
)

const cgroupRoot = "/sys/fs/cgroup"

// cgroupCounters are the raw counters Stats turns into sandbox.Stats.
type cgroupCounters struct {
	cpuNanos  uint64
	memUsage  int64
	memLimit  int64
	memCache  int64
	pidsCount int64
}

// unifiedOnly reports whether the host runs pure cgroup v2 (no v1 controllers), which
// decides where a container's counters live. Hybrid hosts (v1 controllers plus a v2 tree
// without controllers, as on these machines) use the v1 files.
func unifiedOnly() bool {
	var st unix.Statfs_t
	return unix.Statfs(cgroupRoot, &st) == nil && st.Type == unix.CGROUP2_SUPER_MAGIC
}

// readCounters reads the counters of the cgroup at rel (the spec's cgroupsPath).
func readCounters(rel string, v2 bool) (cgroupCounters, error) {
	var c cgroupCounters
	if v2 {
		dir := filepath.Join(cgroupRoot, rel)
		cpu, err := readKeyed(filepath.Join(dir, "cpu.stat"))
		if err != nil {
			return c, err
		}
		c.cpuNanos = uint64(cpu["usage_usec"]) * 1000
		if c.memUsage, err = readInt(filepath.Join(dir, "memory.current")); err != nil {
			return c, err
		}
		c.memLimit, _ = readInt(filepath.Join(dir, "memory.max"))
		mem, _ := readKeyed(filepath.Join(dir, "memory.stat"))
		c.memCache = mem["file"]
		c.pidsCount, _ = readInt(filepath.Join(dir, "pids.current"))
		return c, nil
	}
	n, err := readInt(filepath.Join(cgroupRoot, "cpuacct", rel, "cpuacct.usage"))
	if err != nil {
		return c, err
	}
	c.cpuNanos = uint64(n)
	if c.memUsage, err = readInt(filepath.Join(cgroupRoot, "memory", rel, "memory.usage_in_bytes")); err != nil {
		return c, err
	}
	c.memLimit, _ = readInt(filepath.Join(cgroupRoot, "memory", rel, "memory.limit_in_bytes"))
	mem, _ := readKeyed(filepath.Join(cgroupRoot, "memory", rel, "memory.stat"))
	c.memCache = mem["total_cache"]
	c.pidsCount, _ = readInt(filepath.Join(cgroupRoot, "pids", rel, "pids.current"))
	return c, nil
}

func readInt(path string) (int64, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return 0, fmt.Errorf("oci: cgroup counter: %w", err)
	}
	s := strings.TrimSpace(string(b))
	if s == "max" {
		return math.MaxInt64, nil
	}
	v, err := strconv.ParseInt(s, 10, 64)
	if err != nil {
		return 0, fmt.Errorf("oci: cgroup counter %s: %w", path, err)
	}
	return v, nil
}

func readKeyed(path string) (map[string]int64, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("oci: cgroup counter: %w", err)
	}
	defer f.Close()
	m := map[string]int64{}
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		k, v, ok := strings.Cut(sc.Text(), " ")
		if !ok {
			continue
		}
		if n, err := strconv.ParseInt(strings.TrimSpace(v), 10, 64); err == nil {
			m[k] = n
		}
	}
	return m, sc.Err()
}

// cgroupDirs lists the directories a container's cgroup occupies on this host.
func cgroupDirs(rel string, v2 bool) []string {
	if v2 {
		return []string{filepath.Join(cgroupRoot, rel)}
	}
	ents, err := os.ReadDir(cgroupRoot)
	if err != nil {
		return nil
	}
	var dirs []string
	for _, e := range ents {
		if e.IsDir() {
			dirs = append(dirs, filepath.Join(cgroupRoot, e.Name(), rel))
		}
	}
	return dirs
}

// removeCgroups removes a dead container's leftover (empty) cgroup directories.
func removeCgroups(rel string, v2 bool) error {
	var errs []error
	for _, d := range cgroupDirs(rel, v2) {
		if err := os.Remove(d); err != nil && !errors.Is(err, os.ErrNotExist) {
			errs = append(errs, fmt.Errorf("oci: remove cgroup %s: %w", d, err))
		}
	}
	return errors.Join(errs...)
}

// diskUsage sums the allocated size of everything under dir (the sandbox's upper layer:
// what it wrote on top of its template).
func diskUsage(dir string) int64 {
	var total int64
	_ = filepath.WalkDir(dir, func(_ string, d os.DirEntry, err error) error {
		if err != nil {
			return nil
		}
		if info, err := d.Info(); err == nil {
			if st, ok := info.Sys().(*syscall.Stat_t); ok {
				total += st.Blocks * 512
			}
		}
		return nil
	})
	return total
}
