package main

import (
	"bytes"
	"encoding/json"
	"io"
	"net/http"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/aenv-dev/aenv/internal/catalog"
	"github.com/aenv-dev/aenv/internal/sandbox"
	"github.com/aenv-dev/aenv/internal/sandbox/mock"
)

// pauseNode is node() over a mock that snapshots and keeps processes across a pause, so
// a memory pause and a pause to disk differ, with the bodies of every pause and connect
// request recorded (keyed "pause" and "connect").
type pauseNode struct {
	url    string
	cat    *catalog.Catalog
	be     *mock.Backend
	mu     sync.Mutex
	bodies map[string][]string
}

func newPauseNode(t *testing.T) *pauseNode {
	t.Helper()
	be := mock.New(mock.Options{Capabilities: sandbox.Capabilities{Snapshots: true, PauseKeepsProcesses: true}})
	n := &pauseNode{be: be, bodies: map[string][]string{}}
	n.url, n.cat = mockNodeWith(t, be, func(srv http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			for _, suffix := range []string{"pause", "connect"} {
				if r.Method == http.MethodPost && strings.HasSuffix(r.URL.Path, "/"+suffix) {
					raw, _ := io.ReadAll(r.Body)
					r.Body = io.NopCloser(bytes.NewReader(raw))
					n.mu.Lock()
					n.bodies[suffix] = append(n.bodies[suffix], string(raw))
					n.mu.Unlock()
				}
			}
			srv.ServeHTTP(w, r)
		})
	})
	return n
}

// lastBody decodes the last recorded body of kind.
func (n *pauseNode) lastBody(t *testing.T, kind string) map[string]any {
	t.Helper()
	n.mu.Lock()
	defer n.mu.Unlock()
	bs := n.bodies[kind]
	if len(bs) == 0 {
		t.Fatalf("no %s request was sent", kind)
	}
	var m map[string]any
	if err := json.Unmarshal([]byte(bs[len(bs)-1]), &m); err != nil {
		t.Fatalf("%s body %q: %v", kind, bs[len(bs)-1], err)
	}
	return m
}

// record is the sandbox's persisted state as the orchestrator stored it.
func (n *pauseNode) record(t *testing.T, id string) (state string, onDisk bool) {
	t.Helper()
	raw, err := n.cat.Sandboxes().Get(id)
	if err != nil {
		t.Fatal(err)
	}
	var rec struct {
		State        string          `json:"state"`
		DiskSnapshot json.RawMessage `json:"diskSnapshot"`
	}
	if err := json.Unmarshal(raw, &rec); err != nil {
		t.Fatal(err)
	}
	return rec.State, len(rec.DiskSnapshot) > 0
}

func (n *pauseNode) info(t *testing.T, id string) string {
	t.Helper()
	var sb struct {
		State string `json:"state"`
	}
	if err := json.Unmarshal([]byte(mustAenv(t, n.url, "info", id)), &sb); err != nil {
		t.Fatal(err)
	}
	return sb.State
}

func TestPauseToDiskAndResumeCLI(t *testing.T) {
	n := newPauseNode(t)
	id := strings.TrimSpace(mustAenv(t, n.url, "start", "-d"))
	launches := len(n.be.Launches())

	stdout, _, err := aenv(t, n.url, "pause", id, "--disk")
	if err != nil || !strings.Contains(stdout, "paused to disk") {
		t.Fatalf("pause --disk: %v %q", err, stdout)
	}
	if body := n.lastBody(t, "pause"); len(body) != 1 || body["memory"] != false {
		t.Fatalf("pause --disk sent %v, want {\"memory\": false}", body)
	}
	if state, onDisk := n.record(t, id); !onDisk {
		t.Fatalf("after pause --disk the record is %s without a disk snapshot", state)
	}
	if slices.Contains(n.be.Live(), id) {
		t.Fatal("pause --disk left the instance running (its resources are not released)")
	}
	if got := n.info(t, id); got != "paused" {
		t.Fatalf("info after pause --disk: state %q", got)
	}

	if stdout, _, err := aenv(t, n.url, "resume", id); err != nil || !strings.Contains(stdout, "resumed") {
		t.Fatalf("resume: %v %q", err, stdout)
	}
	if body := n.lastBody(t, "connect"); body["memory"] != nil || body["timeout"] != float64(300) {
		t.Fatalf("resume sent %v, want only the default timeout", body)
	}
	if got := n.info(t, id); got != "running" {
		t.Fatalf("info after resume: state %q", got)
	}
	if _, onDisk := n.record(t, id); onDisk {
		t.Fatal("resumed sandbox still records a disk snapshot")
	}
	if !slices.Contains(n.be.Live(), id) || len(n.be.Launches()) != launches+1 {
		t.Fatalf("resume from disk: live %v, %d launches (want %d)", n.be.Live(), len(n.be.Launches()), launches+1)
	}
}

func TestPauseInMemoryAndColdResumeCLI(t *testing.T) {
	n := newPauseNode(t)
	id := strings.TrimSpace(mustAenv(t, n.url, "start", "-d"))
	launches := len(n.be.Launches())

	mustAenv(t, n.url, "pause", id)
	if body := n.lastBody(t, "pause"); len(body) != 0 {
		t.Fatalf("pause sent %v, want {} (the server's default: keep memory)", body)
	}
	if state, onDisk := n.record(t, id); onDisk || state != "paused" {
		t.Fatalf("plain pause: state %s, on disk %v; want paused in memory", state, onDisk)
	}
	if !slices.Contains(n.be.Live(), id) {
		t.Fatal("a memory pause stopped the instance")
	}

	if stdout, _, err := aenv(t, n.url, "resume", id, "--cold", "--timeout", "2m"); err != nil || !strings.Contains(stdout, "resumed") {
		t.Fatalf("resume --cold: %v %q", err, stdout)
	}
	if body := n.lastBody(t, "connect"); body["memory"] != false || body["timeout"] != float64(120) {
		t.Fatalf("resume --cold sent %v, want memory false and timeout 120", body)
	}
	// A cold boot relaunches the sandbox from its filesystem instead of thawing it.
	if got := len(n.be.Launches()); got != launches+1 {
		t.Fatalf("resume --cold: %d launches, want %d (a fresh boot)", got, launches+1)
	}
	if got := n.info(t, id); got != "running" {
		t.Fatalf("info after resume --cold: state %q", got)
	}

	// A plain resume of a memory pause thaws the instance: no new launch.
	mustAenv(t, n.url, "pause", id)
	mustAenv(t, n.url, "resume", id)
	if got := len(n.be.Launches()); got != launches+1 {
		t.Fatalf("plain resume of a memory pause launched again (%d launches)", got)
	}
}
