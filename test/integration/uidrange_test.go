package integration

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/aenv-dev/aenv/internal/sandbox/oci"
)

// TestTwoNodesUIDRanges runs two nodes on this host: their sandboxes' roots map to
// disjoint host uid blocks, both recorded in the host-wide file, and a third node
// configured with a base inside the first node's block refuses to start, naming it.
func TestTwoNodesUIDRanges(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	a, b := newNode(t, "AENV_SANDBOX_SHUTDOWN_ACTION=stop"), newNode(t, "AENV_SANDBOX_SHUTDOWN_ACTION=stop")
	a.start()
	b.start()
	ranges := map[*node][2]uint64{}
	for _, n := range []*node{a, b} {
		c := n.client()
		sb := n.create(ctx, c)
		f := strings.Fields(run(ctx, t, c, sb, "cat /proc/self/uid_map"))
		if len(f) != 3 || f[0] != "0" {
			t.Skipf("sandbox runs without a user namespace here (uid_map %v)", f)
		}
		host, _ := strconv.ParseUint(f[1], 10, 64)
		size, _ := strconv.ParseUint(f[2], 10, 64)
		ranges[n] = [2]uint64{host, host + size}
	}
	ra, rb := ranges[a], ranges[b]
	if ra[0] < rb[1] && rb[0] < ra[1] {
		t.Fatalf("the nodes' sandboxes share host uids: %v and %v", ra, rb)
	}

	raw, err := os.ReadFile(oci.DefaultUIDRangeFile)
	if err != nil {
		t.Fatal(err)
	}
	var rec []struct {
		Owner  string `json:"owner"`
		Base   uint64 `json:"base"`
		Ranges uint64 `json:"ranges"`
	}
	if err := json.Unmarshal(raw, &rec); err != nil {
		t.Fatalf("%s: %v", oci.DefaultUIDRangeFile, err)
	}
	var baseA uint64
	found := 0
	for _, r := range rec {
		for n, want := range ranges {
			if strings.HasPrefix(r.Owner, n.dataDir+"/") {
				found++
				if want[0] < r.Base || want[1] > r.Base+r.Ranges*65536 {
					t.Errorf("sandbox range %v outside the node's recorded block %d+%d×65536", want, r.Base, r.Ranges)
				}
				if n == a {
					baseA = r.Base
				}
			}
		}
	}
	if found != 2 {
		t.Fatalf("the record holds %d of the two nodes:\n%s", found, raw)
	}

	c := newNode(t, fmt.Sprintf("AENV_BACKEND_UID_BASE=%d", baseA+65536))
	out, err := c.startExpectingFailure(ctx)
	if err == nil {
		t.Fatalf("a node overlapping another's uid block started:\n%s", out)
	}
	if !strings.Contains(out, "overlaps") || !strings.Contains(out, a.dataDir) || !strings.Contains(out, "backend.uid_base") {
		t.Fatalf("the refusal does not name the overlap and the other node:\n%s", out)
	}
}

// startExpectingFailure runs `aenv serve` for a node that should refuse to start and
// returns its output and exit error.
func (n *node) startExpectingFailure(ctx context.Context) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, 60*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, n.bins.aenv, "serve", "--listen", fmt.Sprintf("127.0.0.1:%d", freePort(n.t)),
		"--data-dir", n.dataDir, "--envd", n.bins.envd, "--base-rootfs", n.bins.baseRootFS)
	cmd.Env = append(os.Environ(), "AENV_API_KEY="+n.key, "AENV_LOG_LEVEL=info")
	cmd.Env = append(cmd.Env, n.env...)
	out, err := cmd.CombinedOutput()
	return string(out), err
}
