package oci

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"slices"
	"testing"
)

func TestProbeCacheKey(t *testing.T) {
	b := &Backend{cfg: Config{DataDir: t.TempDir(), Runtime: "auto", UserNamespace: UserNSAuto, UIDBase: 100000}}
	names := []string{"runc", "crun"}
	key, err := b.probeKey(names)
	if err != nil {
		t.Fatal(err)
	}
	if _, _, ok := b.cachedProbe(key); ok {
		t.Fatal("an empty data dir answered from cache")
	}
	rt := runtimeCLI{name: "runc", bin: "/usr/sbin/runc"}
	if err := b.saveProbe(key, rt, true); err != nil {
		t.Fatal(err)
	}
	got, userns, ok := b.cachedProbe(key)
	if !ok || got.name != "runc" || got.bin != "/usr/sbin/runc" || !userns || got.root != filepath.Join(b.cfg.DataDir, "runc") {
		t.Fatalf("cached answer = %+v userns=%v ok=%v", got, userns, ok)
	}
	for _, tc := range []struct {
		name   string
		change func(*probeKey)
	}{
		{"another boot", func(k *probeKey) { k.BootID = "00000000-0000-0000-0000-000000000000" }},
		{"user namespaces forced off", func(k *probeKey) { k.UserNamespace = UserNSOff }},
		{"another uid base", func(k *probeKey) { k.UIDBase++ }},
		{"runtime binary replaced", func(k *probeKey) { k.Binaries = append([]string{"/usr/sbin/runc:1:2"}, k.Binaries[1:]...) }},
		{"data dir no longer traversable", func(k *probeKey) { k.Traversable = "/x is not traversable" }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			k := key
			k.Binaries = append([]string(nil), key.Binaries...)
			tc.change(&k)
			if _, _, ok := b.cachedProbe(k); ok {
				t.Error("a changed host state answered from cache")
			}
		})
	}
	if err := os.WriteFile(filepath.Join(b.cfg.DataDir, probeCacheFile), []byte("{torn"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, _, ok := b.cachedProbe(key); ok {
		t.Error("a torn cache file answered")
	}
}

// TestProbeAnsweredFromCache: a restart on an unchanged host does not run the probe
// containers again. The cached answer is altered to prove it is what probe returns.
func TestProbeAnsweredFromCache(t *testing.T) {
	env := newTestBackend(t, nil)
	b := env.b
	path := filepath.Join(b.cfg.DataDir, probeCacheFile)
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("the probe at New left no cache: %v", err)
	}
	var a probeAnswer
	if err := json.Unmarshal(data, &a); err != nil {
		t.Fatal(err)
	}
	if a.Name != b.rt.name || a.UserNS != b.userns {
		t.Fatalf("cached %+v, backend chose %s userns=%v", a, b.rt.name, b.userns)
	}
	a.UserNS = !a.UserNS
	data, _ = json.Marshal(a)
	if err := os.WriteFile(path, data, 0o600); err != nil {
		t.Fatal(err)
	}
	_, userns, err := b.probe(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if userns != a.UserNS {
		t.Fatal("probe ran the containers again instead of answering from cache")
	}
}

func TestHeldFirst(t *testing.T) {
	for _, tc := range []struct {
		name string
		dirs []string // made below the data dir
		want []string
	}{
		{"nothing held", nil, []string{"crun", "runc"}},
		{"empty roots", []string{"runc", "crun"}, []string{"crun", "runc"}},
		{"runc holds a container", []string{"runc/sb1"}, []string{"runc", "crun"}},
		{"only the probe's leftover", []string{"runc/" + probeID}, []string{"crun", "runc"}},
		{"crun holds one", []string{"crun/warm.1.1"}, []string{"crun", "runc"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			for _, d := range tc.dirs {
				if err := os.MkdirAll(filepath.Join(dir, d), 0o700); err != nil {
					t.Fatal(err)
				}
			}
			if got := heldFirst(dir, []string{"crun", "runc"}); !slices.Equal(got, tc.want) {
				t.Errorf("heldFirst = %v, want %v", got, tc.want)
			}
		})
	}
}
