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

// DiscoverNode finds, under procRoot, the process listening on TCP port (the node a
// bench talks to on this machine), the data planes serving it and its sandboxes'
// cgroup parent. A data plane is a `<exe> dataplane --dir D` process the node started
// (its parent) or whose data directory (D's parent) the node has files open in; the
// cgroup parent is the node's AENV_BACKEND_CGROUP_PARENT, else "aenv" (a parent set in a
// config file must be given explicitly).
func DiscoverNode(procRoot string, port int) (CPUSources, error) {
	src := CPUSources{ProcRoot: procRoot}
	inodes, err := listeningInodes(procRoot, port)
	if err != nil {
		return src, err
	}
	if len(inodes) == 0 {
		return src, fmt.Errorf("bench: no process listens on port %d on this machine", port)
	}
	pids, _ := filepath.Glob(filepath.Join(procRoot, "[0-9]*"))
	for _, d := range pids {
		if ownsSocket(d, inodes) {
			src.NodePID, _ = strconv.Atoi(filepath.Base(d))
			break
		}
	}
	if src.NodePID == 0 {
		return src, fmt.Errorf("bench: no process found holding the socket listening on port %d", port)
	}
	nodeDir := filepath.Join(procRoot, strconv.Itoa(src.NodePID))
	for _, d := range pids {
		args := cmdline(d)
		if len(args) < 2 || args[1] != "dataplane" {
			continue
		}
		pid, _ := strconv.Atoi(filepath.Base(d))
		if ppid(d) == src.NodePID || opensUnder(nodeDir, filepath.Dir(flagValue(args, "--dir"))) {
			src.DataPlanePIDs = append(src.DataPlanePIDs, pid)
		}
	}
	src.CgroupParent = "aenv"
	if v := environValue(nodeDir, "AENV_BACKEND_CGROUP_PARENT"); v != "" {
		src.CgroupParent = v
	}
	return src, nil
}

// listeningInodes returns the socket inodes listening on port in /proc/net/tcp{,6}.
func listeningInodes(procRoot string, port int) (map[string]bool, error) {
	out := map[string]bool{}
	want := fmt.Sprintf(":%04X", port)
	for _, f := range []string{"tcp", "tcp6"} {
		raw, err := os.ReadFile(filepath.Join(procRoot, "net", f))
		if err != nil {
			if f == "tcp6" {
				continue
			}
			return nil, fmt.Errorf("bench: %w", err)
		}
		sc := bufio.NewScanner(bytes.NewReader(raw))
		for sc.Scan() {
			// sl local_address rem_address st tx:rx tr:tm retrnsmt uid timeout inode
			fl := strings.Fields(sc.Text())
			if len(fl) >= 10 && strings.HasSuffix(fl[1], want) && fl[3] == "0A" {
				out[fl[9]] = true
			}
		}
	}
	return out, nil
}

func ownsSocket(procDir string, inodes map[string]bool) bool {
	fds, err := os.ReadDir(filepath.Join(procDir, "fd"))
	if err != nil {
		return false
	}
	for _, fd := range fds {
		l, err := os.Readlink(filepath.Join(procDir, "fd", fd.Name()))
		if err == nil && strings.HasPrefix(l, "socket:[") && inodes[strings.TrimSuffix(l[len("socket:["):], "]")] {
			return true
		}
	}
	return false
}

// opensUnder reports whether the process has a file open under dir.
func opensUnder(procDir, dir string) bool {
	if dir == "" || dir == "." || dir == "/" {
		return false
	}
	fds, err := os.ReadDir(filepath.Join(procDir, "fd"))
	if err != nil {
		return false
	}
	for _, fd := range fds {
		if l, err := os.Readlink(filepath.Join(procDir, "fd", fd.Name())); err == nil && strings.HasPrefix(l, dir+"/") {
			return true
		}
	}
	return false
}

func cmdline(procDir string) []string {
	raw, err := os.ReadFile(filepath.Join(procDir, "cmdline"))
	if err != nil || len(raw) == 0 {
		return nil
	}
	return strings.Split(strings.TrimSuffix(string(raw), "\x00"), "\x00")
}

func flagValue(args []string, name string) string {
	for i, a := range args {
		if a == name && i+1 < len(args) {
			return args[i+1]
		}
		if v, ok := strings.CutPrefix(a, name+"="); ok {
			return v
		}
	}
	return ""
}

func ppid(procDir string) int {
	raw, err := os.ReadFile(filepath.Join(procDir, "stat"))
	if err != nil {
		return 0
	}
	i := bytes.LastIndexByte(raw, ')')
	if i < 0 {
		return 0
	}
	f := strings.Fields(string(raw[i+1:]))
	if len(f) < 2 {
		return 0
	}
	p, _ := strconv.Atoi(f[1])
	return p
}

func environValue(procDir, key string) string {
	raw, err := os.ReadFile(filepath.Join(procDir, "environ"))
	if err != nil {
		return ""
	}
	for _, kv := range strings.Split(string(raw), "\x00") {
		if v, ok := strings.CutPrefix(kv, key+"="); ok {
			return v
		}
	}
	return ""
}
