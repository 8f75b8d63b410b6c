package integration

import (
	"bytes"
	"context"
	"encoding/json"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/aenv-dev/aenv/internal/bench"
)

// TestVolumesAndSecrets drives a real node: two sandboxes mount one volume and share it
// (writes, ownership, a lock across sandboxes), a secret placeholder in envVars reaches the
// sandbox's environment and nothing else, bad requests change nothing, and after a restart
// of the node the volume's content and the secret are still there. No volume mount
// outlives the sandboxes.
func TestVolumesAndSecrets(t *testing.T) {
	n := newNode(t, "AENV_SANDBOX_SHUTDOWN_ACTION=stop")
	n.start()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	c := n.client()
	const value = "it-secret-d41d8cd98f00b204e980"

	out, err := n.api(ctx, http.MethodPost, "/volumes", `{"name":"shared"}`, http.StatusCreated)
	if err != nil {
		t.Fatal(err)
	}
	var vol struct{ VolumeID, Token string }
	if err := json.Unmarshal(out, &vol); err != nil {
		t.Fatal(err)
	}
	if _, err := n.api(ctx, http.MethodPost, "/secrets", `{"name":"tok","value":"`+value+`"}`, http.StatusCreated); err != nil {
		t.Fatal(err)
	}
	create := func(body string) bench.Sandbox {
		t.Helper()
		out, err := n.api(ctx, http.MethodPost, "/v2/sandboxes", body, http.StatusCreated)
		if err != nil {
			t.Fatal(err)
		}
		var sb bench.Sandbox
		if err := json.Unmarshal(out, &sb); err != nil {
			t.Fatal(err)
		}
		n.observe()
		return sb
	}
	a := create(`{"templateID":"base","timeout":600,"volumeMounts":[{"name":"shared","path":"/mnt/shared"}],"envVars":{"TOK":"${e2b.secrets.tok}"}}`)
	b := create(`{"templateID":"base","timeout":600,"volumeMounts":[{"name":"shared","path":"/data"}]}`)

	if got := run(ctx, t, c, a, `echo "$TOK"`); got != value {
		t.Fatalf("TOK in the sandbox = %q", got)
	}
	run(ctx, t, c, a, "echo hello > /mnt/shared/f && echo 0 > /mnt/shared/counter")
	if got := run(ctx, t, c, b, "cat /data/f; stat -c %u:%g /data/f"); got != "hello\n1000:1000" {
		t.Fatalf("b reads %q", got)
	}
	// On the host the file belongs to uid 1000 too: one ownership for every sandbox.
	fi, err := os.Stat(filepath.Join(n.dataDir, "volumes", vol.VolumeID, "data", "f"))
	if err != nil {
		t.Fatal(err)
	}
	if st := fi.Sys().(*syscall.Stat_t); st.Uid != 1000 || st.Gid != 1000 {
		t.Fatalf("host owner %d:%d", st.Uid, st.Gid)
	}
	// One filesystem for both: mkdir is atomic across sandboxes, so 2 × 40 read-increment-
	// writes under a mkdir lock lose none.
	const incr = `for i in $(seq 1 40); do until mkdir %s/lock 2>/dev/null; do :; done; n=$(cat %s/counter); echo $((n+1)) > %s/counter; rmdir %s/lock; done`
	var wg sync.WaitGroup
	for _, s := range []struct {
		sb  bench.Sandbox
		dir string
	}{{a, "/mnt/shared"}, {b, "/data"}} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			run(ctx, t, c, s.sb, strings.ReplaceAll(incr, "%s", s.dir))
		}()
	}
	wg.Wait()
	if got := run(ctx, t, c, a, "cat /mnt/shared/counter"); got != "80" {
		t.Fatalf("counter = %s, want 80", got)
	}

	// Bad requests: clear 4xx, nothing changes.
	before := states(ctx, t, c)
	for _, tc := range []struct {
		name, method, path, body string
		want                     int
	}{
		{"unknown volume", "POST", "/v2/sandboxes", `{"templateID":"base","volumeMounts":[{"name":"nope","path":"/x"}]}`, 400},
		{"volume over /proc", "POST", "/v2/sandboxes", `{"templateID":"base","volumeMounts":[{"name":"shared","path":"/proc/x"}]}`, 400},
		{"unknown secret", "POST", "/v2/sandboxes", `{"templateID":"base","envVars":{"K":"${e2b.secrets.nope}"}}`, 400},
		{"volume name clash", "POST", "/volumes", `{"name":"shared"}`, 409},
		{"bad volume name", "POST", "/volumes", `{"name":"a/b"}`, 400},
		{"delete a mounted volume", "DELETE", "/volumes/" + vol.VolumeID, "", 409},
		{"oversized secret", "POST", "/secrets", `{"name":"big","value":"` + strings.Repeat("x", 64<<10+1) + `"}`, 400},
		{"secret name clash", "POST", "/secrets", `{"name":"tok","value":"x"}`, 409},
	} {
		if out, err := n.api(ctx, tc.method, tc.path, tc.body, tc.want); err != nil {
			t.Errorf("%s: %v (%s)", tc.name, err, out)
		}
	}
	if after := states(ctx, t, c); len(after) != len(before) {
		t.Fatalf("sandboxes changed: %v → %v", before, after)
	}
	if _, err := n.api(ctx, http.MethodGet, "/secrets/big", "", http.StatusNotFound); err != nil {
		t.Fatal(err)
	}

	// Restart: the volume and the secret survive; mounts do not outlive the sandboxes.
	n.stop()
	n.start()
	c = n.client()
	s := create(`{"templateID":"base","timeout":600,"volumeMounts":[{"name":"shared","path":"/v"}],"envVars":{"TOK":"${e2b.secrets.tok}"}}`)
	if got := run(ctx, t, c, s, `cat /v/f /v/counter; echo "$TOK"`); got != "hello\n80\n"+value {
		t.Fatalf("after restart: %q", got)
	}
	killAll(ctx, t, c)
	if _, err := n.api(ctx, http.MethodDelete, "/volumes/"+vol.VolumeID, "", http.StatusNoContent); err != nil {
		t.Fatal(err)
	}
	mi, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range strings.Split(string(mi), "\n") {
		if strings.Contains(l, n.dataDir) && strings.Contains(l, "/volumes") {
			t.Errorf("volume mount left: %s", l)
		}
	}
	if strings.Contains(n.output(), value) {
		t.Error("the node's log holds the secret value")
	}
	_ = filepath.WalkDir(filepath.Join(n.dataDir, "secrets"), func(p string, d os.DirEntry, err error) error {
		if err == nil && !d.IsDir() {
			if raw, _ := os.ReadFile(p); bytes.Contains(raw, []byte(value)) {
				t.Errorf("%s holds the secret value in the clear", p)
			}
		}
		return nil
	})
}
