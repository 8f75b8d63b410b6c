package oci

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/aenv-dev/aenv/internal/atomicfile"
)

// The runtime probe runs real containers (up to four) and costs seconds, which is most of
// a node restart. Its answer depends only on the host as this boot left it, so it is kept
// in the data dir and reused while everything it depended on is unchanged: the boot (a
// reboot may bring another kernel, cgroup layout or sysctls), the runtime binary, the
// configuration and the data dir's permissions. Anything else re-probes; a stale answer
// could only make the first launch fail, never run a sandbox with weaker isolation, because
// the key includes the settings that decide whether user namespaces may be used.
const probeCacheFile = "probe-cache.json"

// probeKey is what the probe's answer depends on.
type probeKey struct {
	BootID        string `json:"boot_id"`
	Runtime       string `json:"runtime"`
	UserNamespace string `json:"user_namespace"`
	UIDBase       uint32 `json:"uid_base"`
	CgroupV2Only  bool   `json:"cgroup_v2_only"`
	MemSwap       bool   `json:"memsw"`
	Traversable   string `json:"traversable"`
	// Binaries: each candidate runtime's resolved path with its size and mtime.
	Binaries []string `json:"binaries"`
}

type probeAnswer struct {
	Key     probeKey `json:"key"`
	Name    string   `json:"name"`
	Bin     string   `json:"bin"`
	UserNS  bool     `json:"userns"`
	Version int      `json:"version"`
}

// probeCacheVersion changes when the probe itself changes what it checks.
const probeCacheVersion = 1

func (b *Backend) probeKey(names []string) (probeKey, error) {
	boot, err := os.ReadFile("/proc/sys/kernel/random/boot_id")
	if err != nil {
		return probeKey{}, fmt.Errorf("boot id: %w", err)
	}
	k := probeKey{
		BootID: strings.TrimSpace(string(boot)), Runtime: b.cfg.Runtime, UserNamespace: b.cfg.UserNamespace,
		UIDBase: b.cfg.UIDBase, CgroupV2Only: b.v2, MemSwap: b.memsw, Traversable: untraversable(b.cfg.DataDir),
	}
	for _, n := range names {
		bin, err := lookRuntime(n)
		if err != nil {
			k.Binaries = append(k.Binaries, n+":missing")
			continue
		}
		fi, err := os.Stat(bin)
		if err != nil {
			return probeKey{}, err
		}
		k.Binaries = append(k.Binaries, fmt.Sprintf("%s:%d:%d", bin, fi.Size(), fi.ModTime().UnixNano()))
	}
	return k, nil
}

// cachedProbe returns the answer an earlier probe of this same host state gave.
func (b *Backend) cachedProbe(key probeKey) (runtimeCLI, bool, bool) {
	data, err := os.ReadFile(filepath.Join(b.cfg.DataDir, probeCacheFile))
	if err != nil {
		return runtimeCLI{}, false, false
	}
	var a probeAnswer
	if json.Unmarshal(data, &a) != nil || a.Version != probeCacheVersion || !sameKey(a.Key, key) {
		return runtimeCLI{}, false, false
	}
	return runtimeCLI{name: a.Name, bin: a.Bin, root: filepath.Join(b.cfg.DataDir, a.Name)}, a.UserNS, true
}

func (b *Backend) saveProbe(key probeKey, rt runtimeCLI, userns bool) error {
	data, err := json.Marshal(probeAnswer{Key: key, Name: rt.name, Bin: rt.bin, UserNS: userns, Version: probeCacheVersion})
	if err != nil {
		return err
	}
	return atomicfile.WriteFile(filepath.Join(b.cfg.DataDir, probeCacheFile), data, 0o600)
}

func sameKey(a, b probeKey) bool {
	x, _ := json.Marshal(a)
	y, _ := json.Marshal(b)
	return string(x) == string(y)
}
