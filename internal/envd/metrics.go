package envd

import (
	"bufio"
	"bytes"
	"math"
	"net/http"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/aenv-dev/aenv/internal/envd/files"
)

// Metrics is the body of GET /metrics (E2B's field names).
type Metrics struct {
	Timestamp   int64   `json:"ts"`
	CPUCount    int     `json:"cpu_count"`
	CPUUsedPct  float64 `json:"cpu_used_pct"`
	MemTotal    uint64  `json:"mem_total"`
	MemUsed     uint64  `json:"mem_used"`
	MemCache    uint64  `json:"mem_cache"`
	MemTotalMiB uint64  `json:"mem_total_mib"`
	MemUsedMiB  uint64  `json:"mem_used_mib"`
	DiskUsed    uint64  `json:"disk_used"`
	DiskTotal   uint64  `json:"disk_total"`
}

// metricsSampler reads the sandbox's resources, preferring cgroup limits (a container sees the
// host's /proc) and falling back to /proc for a VM or a bare host.
type metricsSampler struct {
	disk   string
	cgroup string // cgroup filesystem root
	mu     sync.Mutex
	last   cpuSample
}

type cpuSample struct {
	at    time.Time
	busy  float64 // CPU-seconds used
	total float64 // CPU-seconds available (wall × cpus) for /proc; 0 for cgroup samples
}

func newMetricsSampler(disk string) *metricsSampler {
	return &metricsSampler{disk: disk, cgroup: "/sys/fs/cgroup"}
}

func (s *Server) metricsHandler(w http.ResponseWriter, r *http.Request) {
	if r.Method != http.MethodGet {
		files.Error(w, http.StatusMethodNotAllowed, "method not allowed")
		return
	}
	writeJSON(w, s.metrics.sample())
}

func readUint(path string) (uint64, bool) {
	b, err := os.ReadFile(path)
	if err != nil {
		return 0, false
	}
	v, err := strconv.ParseUint(strings.TrimSpace(string(b)), 10, 64)
	return v, err == nil
}

func statField(path, key string) (uint64, bool) {
	b, err := os.ReadFile(path)
	if err != nil {
		return 0, false
	}
	for _, line := range strings.Split(string(b), "\n") {
		k, v, ok := strings.Cut(line, " ")
		if ok && k == key {
			n, err := strconv.ParseUint(strings.TrimSpace(v), 10, 64)
			return n, err == nil
		}
	}
	return 0, false
}

func meminfo() map[string]uint64 {
	out := map[string]uint64{}
	f, err := os.Open("/proc/meminfo")
	if err != nil {
		return out
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		k, rest, ok := strings.Cut(sc.Text(), ":")
		if !ok {
			continue
		}
		fields := strings.Fields(rest)
		if len(fields) == 0 {
			continue
		}
		n, _ := strconv.ParseUint(fields[0], 10, 64)
		out[k] = n * 1024
	}
	return out
}

// cpuLimit returns the cgroup CPU quota in CPUs (0: none).
func (m *metricsSampler) cpuLimit() float64 {
	if b, err := os.ReadFile(m.cgroup + "/cpu.max"); err == nil {
		f := strings.Fields(string(b))
		if len(f) == 2 && f[0] != "max" {
			q, e1 := strconv.ParseFloat(f[0], 64)
			p, e2 := strconv.ParseFloat(f[1], 64)
			if e1 == nil && e2 == nil && p > 0 {
				return q / p
			}
		}
		return 0
	}
	q, ok1 := readInt(m.cgroup + "/cpu,cpuacct/cpu.cfs_quota_us")
	p, ok2 := readInt(m.cgroup + "/cpu,cpuacct/cpu.cfs_period_us")
	if ok1 && ok2 && q > 0 && p > 0 {
		return float64(q) / float64(p)
	}
	return 0
}

func readInt(path string) (int64, bool) {
	b, err := os.ReadFile(path)
	if err != nil {
		return 0, false
	}
	v, err := strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64)
	return v, err == nil
}

// cgroupCPUSeconds is the cgroup's consumed CPU time.
func (m *metricsSampler) cgroupCPUSeconds() (float64, bool) {
	if us, ok := statField(m.cgroup+"/cpu.stat", "usage_usec"); ok {
		return float64(us) / 1e6, true
	}
	if ns, ok := readUint(m.cgroup + "/cpu,cpuacct/cpuacct.usage"); ok {
		return float64(ns) / 1e9, true
	}
	return 0, false
}

// procCPU returns busy and total jiffies-as-seconds from /proc/stat.
func procCPU() (busy, total float64, ok bool) {
	b, err := os.ReadFile("/proc/stat")
	if err != nil {
		return 0, 0, false
	}
	line, _, _ := bytes.Cut(b, []byte("\n"))
	f := strings.Fields(string(line))
	if len(f) < 5 || f[0] != "cpu" {
		return 0, 0, false
	}
	var vals []float64
	for _, x := range f[1:] {
		v, _ := strconv.ParseFloat(x, 64)
		vals = append(vals, v)
	}
	for _, v := range vals {
		total += v
	}
	idle := vals[3]
	if len(vals) > 4 {
		idle += vals[4] // iowait
	}
	return total - idle, total, true
}

func (m *metricsSampler) cpu(limit float64) (float64, float64) {
	cpus := float64(runtime.NumCPU())
	useCgroup := limit > 0 && limit < cpus
	if useCgroup {
		cpus = limit
	}
	take := func() (cpuSample, bool) {
		now := time.Now()
		if useCgroup {
			if s, ok := m.cgroupCPUSeconds(); ok {
				return cpuSample{at: now, busy: s}, true
			}
			return cpuSample{}, false
		}
		busy, total, ok := procCPU()
		return cpuSample{at: now, busy: busy, total: total}, ok
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	prev := m.last
	if prev.at.IsZero() || time.Since(prev.at) > 30*time.Second {
		var ok bool
		if prev, ok = take(); !ok {
			return cpus, 0
		}
		time.Sleep(100 * time.Millisecond)
	}
	cur, ok := take()
	if !ok {
		return cpus, 0
	}
	m.last = cur
	var pct float64
	if useCgroup {
		wall := cur.at.Sub(prev.at).Seconds()
		if wall > 0 {
			pct = 100 * (cur.busy - prev.busy) / (wall * cpus)
		}
	} else if dt := cur.total - prev.total; dt > 0 {
		pct = 100 * (cur.busy - prev.busy) / dt
	}
	pct = math.Max(0, math.Min(100, pct))
	return cpus, math.Round(pct*100) / 100
}

func (m *metricsSampler) sample() Metrics {
	out := Metrics{Timestamp: time.Now().Unix()}
	limit := m.cpuLimit()
	cpus, pct := m.cpu(limit)
	out.CPUCount = int(math.Ceil(cpus))
	out.CPUUsedPct = pct

	mi := meminfo()
	total := mi["MemTotal"]
	used := total - mi["MemAvailable"]
	cache := mi["Cached"]
	// A cgroup memory limit below the machine's memory is the sandbox's size.
	if lim, ok := readUint(m.cgroup + "/memory.max"); ok && lim < total {
		cur, _ := readUint(m.cgroup + "/memory.current")
		file, _ := statField(m.cgroup+"/memory.stat", "file")
		total, cache = lim, file
		used = cur - min(cur, file)
	} else if lim, ok := readUint(m.cgroup + "/memory/memory.limit_in_bytes"); ok && lim < total {
		cur, _ := readUint(m.cgroup + "/memory/memory.usage_in_bytes")
		file, _ := statField(m.cgroup+"/memory/memory.stat", "total_cache")
		total, cache = lim, file
		used = cur - min(cur, file)
	}
	out.MemTotal, out.MemUsed, out.MemCache = total, used, cache
	out.MemTotalMiB, out.MemUsedMiB = total>>20, used>>20

	var st unix.Statfs_t
	if err := unix.Statfs(m.disk, &st); err == nil {
		bs := uint64(st.Bsize)
		out.DiskTotal = st.Blocks * bs
		out.DiskUsed = (st.Blocks - st.Bfree) * bs
	}
	return out
}
