package microvm

import (
	"bytes"
	"crypto/rand"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/aenv-dev/aenv/internal/sandbox"
)

// TestForkChildrenDrawOwnRandom: fork children continue the parent's memory, the
// kernel's random generator and host name included. The node's /init of each child carries fresh
// entropy (as the orchestrator sends it), after which the parent and every child read
// different bytes from /dev/urandom. The parent first runs past the guest kernel's
// early-boot reseeding (every uptime/2 s for two minutes), or the children would
// diverge on their own within seconds and the test could not fail; after it the
// kernel reseeds once a minute, so without the entropy all three read the same bytes.
func TestForkChildrenDrawOwnRandom(t *testing.T) {
	if testing.Short() {
		t.Skip("waits two minutes of guest uptime")
	}
	b := newTestBackend(t)
	src := launch(t, b, "sbx-rnsrc", sandbox.Resources{CPUCount: 1, MemoryMB: testMemMB, DiskSizeMB: templateMB})
	for {
		var up float64
		if _, err := fmt.Sscan(mustSh(t, src, "cut -d' ' -f1 /proc/uptime"), &up); err != nil {
			t.Fatal(err)
		}
		if up >= 122 {
			break
		}
		time.Sleep(time.Duration(122-up) * time.Second)
	}
	kids := []*Instance{forkOne(t, src, "sbx-rn1"), forkOne(t, src, "sbx-rn2")}
	for _, k := range kids {
		initEntropy(t, k)
		// The same /init names the child after itself (envd's -set-hostname).
		if got := strings.TrimSpace(mustSh(t, k, "hostname; grep -c \"$(hostname)\" /etc/hosts")); got != k.id+"\n1" {
			t.Errorf("%s after /init: host name and hosts file entries %q", k.id, got)
		}
	}
	seen := map[string]string{}
	for _, i := range append(kids, src) {
		r := strings.TrimSpace(mustSh(t, i, "head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \\n'"))
		if other, ok := seen[r]; ok {
			t.Fatalf("%s and %s read the same random bytes %s after the fork", other, i.id, r)
		}
		seen[r] = i.id
	}
}

// initEntropy posts an /init with fresh entropy and i's id to i's envd, as the
// orchestrator does for a sandbox whose memory came from a capture.
func initEntropy(t *testing.T, i *Instance) {
	t.Helper()
	e := make([]byte, 32)
	rand.Read(e)
	postInit(t, i, map[string]any{"entropy": e, "timestamp": time.Now().UTC(),
		"envVars": map[string]string{"E2B_SANDBOX_ID": i.id}})
}

// postInit posts body, as JSON, to i's envd /init and wants it applied.
func postInit(t testing.TB, i *Instance, body any) {
	t.Helper()
	raw, err := json.Marshal(body)
	if err != nil {
		t.Fatal(err)
	}
	ep := i.Endpoint()
	resp, err := http.Post(fmt.Sprintf("http://%s:%d/init", ep.Host, ep.EnvdPort), "application/json", bytes.NewReader(raw))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusNoContent {
		t.Fatalf("/init of %s: %s", i.id, resp.Status)
	}
}
