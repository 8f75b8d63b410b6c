package bench

import (
	"bufio"
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
)

// MemSplit is host memory per sandbox by where it is held, from counters that only
// this node's work moves (MemAvailable moves with everything else on a shared machine):
// the anonymous memory of the node's and data planes' processes, and the sandboxes'
// parent cgroup (their processes, page cache and, on cgroup v1 with kmem accounting,
// kernel memory charged to them). Kernel objects charged to nobody (network namespaces,
// loop devices, mounts) are only in MemAvailable's figure.
type MemSplit struct {
	Node      int64 `json:"nodeBytes"`
	DataPlane int64 `json:"dataPlaneBytes"`
	Sandboxes int64 `json:"sandboxesBytes"`
}

// Total is the three together.
func (m MemSplit) Total() int64 { return m.Node + m.DataPlane + m.Sandboxes }

// readMemSplit takes one reading (absolute bytes) of the sources m measures CPU from.
func readMemSplit(m *CPUMeter) (MemSplit, error) {
	src := m.Sources()
	var r MemSplit
	var err error
	if r.Node, err = rssAnon(src.ProcRoot, src.NodePID); err != nil {
		return r, err
	}
	for _, pid := range src.DataPlanePIDs {
		v, err := rssAnon(src.ProcRoot, pid)
		if err != nil {
			return r, err
		}
		r.DataPlane += v
	}
	if p := strings.Trim(src.CgroupParent, "/"); p != "" {
		files := []string{filepath.Join(src.CgroupRoot, p, "memory.current"),
			filepath.Join(src.CgroupRoot, "memory", p, "memory.usage_in_bytes")}
		for _, f := range files {
			b, err := os.ReadFile(f)
			if err != nil {
				continue
			}
			if r.Sandboxes, err = strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64); err != nil {
				return r, fmt.Errorf("bench: %s: %w", f, err)
			}
			break
		}
	}
	return r, nil
}

// perSandbox is the growth from before to after, per sandbox.
func (m MemSplit) perSandbox(before MemSplit, n int) MemSplit {
	if n <= 0 {
		return MemSplit{}
	}
	k := int64(n)
	return MemSplit{Node: (m.Node - before.Node) / k, DataPlane: (m.DataPlane - before.DataPlane) / k,
		Sandboxes: (m.Sandboxes - before.Sandboxes) / k}
}

// rssAnon reads RssAnon (bytes) of process pid.
func rssAnon(procRoot string, pid int) (int64, error) {
	b, err := os.ReadFile(filepath.Join(procRoot, strconv.Itoa(pid), "status"))
	if err != nil {
		return 0, fmt.Errorf("bench: %w", err)
	}
	return parseRssAnon(b)
}

func parseRssAnon(b []byte) (int64, error) {
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		rest, ok := strings.CutPrefix(sc.Text(), "RssAnon:")
		if !ok {
			continue
		}
		f := strings.Fields(rest)
		if len(f) != 2 || f[1] != "kB" {
			break
		}
		kb, err := strconv.ParseInt(f[0], 10, 64)
		if err != nil || kb < 0 {
			break
		}
		return kb * 1024, nil
	}
	return 0, fmt.Errorf("bench: no valid RssAnon line in a process status")
}
