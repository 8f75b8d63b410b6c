package oci

import (
	"context"
	"os"
	"strings"
	"testing"

	"github.com/aenv-dev/aenv/internal/sandbox"
)

// TestBootID: every sandbox sees a boot id of its own, not the host's, read-only, and
// no trace of its source in its /dev: one on a directory root, one on a layered root,
// and fork children on blank containers moved onto their roots.
func TestBootID(t *testing.T) {
	e := newTestBackend(t, nil)
	if !e.b.bootIDs {
		t.Skip("this runtime gives containers no boot id of their own")
	}
	host, err := os.ReadFile(bootIDPath)
	if err != nil {
		t.Fatal(err)
	}
	a := e.launch(t, "bid-dir", sandbox.Resources{})
	b := e.launchBlock(t, "bid-layered", testLayered(t), sandbox.Resources{})
	res, err := b.Fork(context.Background(), []sandbox.ForkSpec{{SandboxID: "bid-fork1"}, {SandboxID: "bid-fork2"}})
	if err != nil {
		t.Fatal(err)
	}
	all := []*Instance{a, b}
	for _, r := range res {
		if r.Err != nil {
			t.Fatal(r.Err)
		}
		k := r.Instance.(*Instance)
		e.waitReady(t, k)
		all = append(all, k)
	}
	seen := map[string]string{strings.TrimSuffix(string(host), "\n"): "the host"}
	for _, i := range all {
		out := e.mustSh(t, i, "cat "+bootIDPath+"; ls -a /dev | grep boot_id; echo x 2>/dev/null > "+bootIDPath+" && echo writable; true")
		id := strings.TrimSuffix(out, "\n")
		if strings.Count(out, "\n") != 1 || len(id) != 36 || id[14] != '4' {
			t.Fatalf("%s: boot id, leftovers, writability: %q", i.id, out)
		}
		if other, ok := seen[id]; ok {
			t.Fatalf("%s sees the boot id of %s", i.id, other)
		}
		seen[id] = i.id
	}
}
