package gateway

import (
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/aenv-dev/aenv/internal/cluster/scheduler"
	pb "github.com/aenv-dev/aenv/internal/cluster/scheduler/gen/schedulerv1"
)

// recorder is an HTTP endpoint standing in for a node's API in routing tests: it answers
// creates and forks with new ids and says which node it is on every other path. The
// whole-node behaviour is tested with real nodes in test/integration.
type recorder struct {
	id  string
	srv *httptest.Server
	mu  sync.Mutex
	n   int
	// knows, when set, are the only templates its creates find (others: 404).
	knows map[string]bool
	// snapshots are the names of the snapshots it took, deleted the templates deleted
	// (DELETE /templates/{id}), which answer deleteStatus (default 204).
	snapshots, deleted []string
	deleteStatus       int
}

func newRecorder(t testing.TB, id string) *recorder {
	r := &recorder{id: id}
	r.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		r.mu.Lock()
		r.n++
		n := r.n
		r.mu.Unlock()
		w.Header().Set("Content-Type", "application/json")
		switch {
		case req.Method == http.MethodPost && strings.HasSuffix(req.URL.Path, "/snapshots"):
			var body struct {
				Name string `json:"name"`
			}
			_ = json.NewDecoder(req.Body).Decode(&body)
			r.mu.Lock()
			r.snapshots = append(r.snapshots, body.Name)
			r.mu.Unlock()
			w.WriteHeader(http.StatusCreated)
			fmt.Fprintf(w, `{"snapshotID":"%s-snap%d"}`, id, n)
		case req.Method == http.MethodPost && (req.URL.Path == "/v2/sandboxes" || req.URL.Path == "/sandboxes"):
			var body struct {
				TemplateID string `json:"templateID"`
			}
			_ = json.NewDecoder(req.Body).Decode(&body)
			r.mu.Lock()
			known := r.knows == nil || r.knows[body.TemplateID]
			r.mu.Unlock()
			if !known {
				w.WriteHeader(http.StatusNotFound)
				fmt.Fprintf(w, `{"code":404,"message":"template not found: %s"}`, body.TemplateID)
				return
			}
			w.WriteHeader(http.StatusCreated)
			fmt.Fprintf(w, `{"sandboxID":"%s-sb%d"}`, id, n)
		case req.Method == http.MethodDelete && strings.HasPrefix(req.URL.Path, "/templates/"):
			r.mu.Lock()
			r.deleted = append(r.deleted, strings.TrimPrefix(req.URL.Path, "/templates/"))
			code := r.deleteStatus
			r.mu.Unlock()
			if code == 0 {
				code = http.StatusNoContent
			}
			w.WriteHeader(code)
			if code != http.StatusNoContent {
				fmt.Fprintf(w, `{"code":%d,"message":"delete failed"}`, code)
			}
		case req.Method == http.MethodPost && strings.HasSuffix(req.URL.Path, "/fork"):
			fmt.Fprintf(w, `{"sandboxes":[{"sandboxID":"%s-fork%d"}]}`, id, n)
		default:
			fmt.Fprintf(w, `{"node":%q,"path":%q,"host":%q,"adopt":%q}`, id, req.URL.Path, req.Host, req.Header.Get("X-Aenv-Adopt"))
		}
	}))
	t.Cleanup(r.srv.Close)
	return r
}

type fixture struct {
	state *scheduler.State
	gw    *httptest.Server
	nodes map[string]*recorder
	clock *time.Time
}

func newFixture(t testing.TB, nodeIDs ...string) *fixture {
	now := time.Unix(1_800_000_000, 0)
	f := &fixture{clock: &now, nodes: map[string]*recorder{}}
	f.state = scheduler.New(scheduler.Config{StaleAfter: 5 * time.Second, Now: func() time.Time { return *f.clock }})
	*f.clock = f.clock.Add(6 * time.Second) // past the scheduler's warm-up
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	g := grpc.NewServer()
	scheduler.NewServer(f.state, nil).Register(g)
	go g.Serve(ln)
	t.Cleanup(g.Stop)
	conn, err := grpc.NewClient(ln.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	gw, err := New(Config{Scheduler: pb.NewSchedulerClient(conn), APIKeys: []string{"k1"}, Domains: []string{"sb.example"}})
	if err != nil {
		t.Fatal(err)
	}
	f.gw = httptest.NewServer(gw)
	t.Cleanup(f.gw.Close)
	for _, id := range nodeIDs {
		f.nodes[id] = newRecorder(t, id)
		f.beat(t, id)
	}
	return f
}

func (f *fixture) beat(t testing.TB, id string, sandboxes ...string) {
	req := &pb.HeartbeatRequest{Node: &pb.NodeInfo{Id: id, Endpoint: f.nodes[id].srv.URL, Backend: "oci"}}
	for _, s := range sandboxes {
		req.Sandboxes = append(req.Sandboxes, &pb.SandboxReport{Id: s, State: "running"})
	}
	if err := f.state.Heartbeat(req); err != nil {
		t.Fatal(err)
	}
}

func (f *fixture) do(t *testing.T, method, path string, hdr map[string]string) (int, map[string]any) {
	req, _ := http.NewRequest(method, f.gw.URL+path, strings.NewReader(`{"templateID":"base"}`))
	for k, v := range hdr {
		if k == "Host" {
			req.Host = v
			continue
		}
		req.Header.Set(k, v)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	raw, _ := io.ReadAll(resp.Body)
	var m map[string]any
	_ = json.Unmarshal(raw, &m)
	return resp.StatusCode, m
}

func TestRouting(t *testing.T) {
	f := newFixture(t, "a", "b")
	f.beat(t, "b", "sb-on-b")
	key := map[string]string{"X-API-Key": "k1"}
	for _, tc := range []struct {
		name         string
		method, path string
		hdr          map[string]string
		code         int
		node         string
	}{
		{"REST path", "GET", "/sandboxes/sb-on-b", key, 200, "b"},
		{"v2 path", "POST", "/v2/sandboxes/sb-on-b/connect", key, 200, "b"},
		{"envd by header, no API key needed", "POST", "/process.Process/Start", map[string]string{headerSandboxID: "sb-on-b", headerSandboxPort: "49983"}, 200, "b"},
		{"by host", "GET", "/files", map[string]string{"Host": "49983-sb-on-b.sb.example"}, 200, "b"},
		{"by /proxy", "GET", "/proxy/sb-on-b/8080/x", nil, 200, "b"},
		{"unknown sandbox", "GET", "/sandboxes/nope", key, 404, ""},
		{"missing key", "GET", "/sandboxes/sb-on-b", nil, 401, ""},
		{"wrong key", "GET", "/sandboxes/sb-on-b", map[string]string{"X-API-Key": "k2"}, 401, ""},
		{"templates to any node", "GET", "/templates", key, 200, "a"},
		{"health without key", "GET", "/health", nil, 204, ""},
		{"volumes are node-local", "POST", "/volumes", key, 501, ""},
		{"volume content is node-local", "GET", "/volumecontent/vol_x/file", key, 501, ""},
		{"secrets are node-local", "GET", "/secrets/x", key, 501, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			code, body := f.do(t, tc.method, tc.path, tc.hdr)
			if code != tc.code || (tc.node != "" && body["node"] != tc.node) {
				t.Fatalf("%s %s = %d %v; want %d from %q", tc.method, tc.path, code, body, tc.code, tc.node)
			}
		})
	}
	// The node sees the original host, so its own host routing works.
	if _, body := f.do(t, "GET", "/files", map[string]string{"Host": "49983-sb-on-b.sb.example"}); body["host"] != "49983-sb-on-b.sb.example" {
		t.Fatalf("forwarded host %v", body["host"])
	}
}

func TestCreateBindsAndForkBinds(t *testing.T) {
	f := newFixture(t, "a")
	code, body := f.do(t, "POST", "/v2/sandboxes", map[string]string{"X-API-Key": "k1"})
	id, _ := body["sandboxID"].(string)
	if code != 201 || id == "" {
		t.Fatalf("create = %d %v", code, body)
	}
	// Bound at once, before any heartbeat lists it.
	if l, err := f.state.Lookup(id); err != nil || l.Node.Id != "a" {
		t.Fatalf("Lookup(%s) after create = %v, %v", id, l, err)
	}
	code, body = f.do(t, "POST", "/sandboxes/"+id+"/fork", map[string]string{"X-API-Key": "k1"})
	if code != 200 {
		t.Fatalf("fork = %d %v", code, body)
	}
	child := body["sandboxes"].([]any)[0].(map[string]any)["sandboxID"].(string)
	if l, err := f.state.Lookup(child); err != nil || l.Node.Id != "a" {
		t.Fatalf("Lookup(fork child %s) = %v, %v", child, l, err)
	}
}

func TestCreateSkipsUnreachableNode(t *testing.T) {
	f := newFixture(t, "a", "b")
	f.nodes["a"].srv.Close() // registered, heartbeat fresh, but gone
	for range 4 {
		code, body := f.do(t, "POST", "/v2/sandboxes", map[string]string{"X-API-Key": "k1"})
		if code != 201 || !strings.HasPrefix(body["sandboxID"].(string), "b-") {
			t.Fatalf("create with node a unreachable = %d %v", code, body)
		}
	}
}

// A snapshot taken on one node is unknown to the others until they sync the repository:
// a create placed on such a node goes to another; a template no node knows is the
// nodes' 404.
func TestCreateTriesAnotherNodeOnUnknownTemplate(t *testing.T) {
	f := newFixture(t, "a", "b")
	f.nodes["a"].knows = map[string]bool{}
	f.nodes["b"].knows = map[string]bool{"snap": true}
	for range 4 {
		req, _ := http.NewRequest("POST", f.gw.URL+"/v2/sandboxes", strings.NewReader(`{"templateID":"snap"}`))
		req.Header.Set("X-API-Key", "k1")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		var body map[string]any
		_ = json.NewDecoder(resp.Body).Decode(&body)
		resp.Body.Close()
		if id, _ := body["sandboxID"].(string); resp.StatusCode != 201 || !strings.HasPrefix(id, "b-") {
			t.Fatalf("create from a snapshot only node b knows = %d %v", resp.StatusCode, body)
		}
	}
	code, body := f.do(t, "POST", "/v2/sandboxes", map[string]string{"X-API-Key": "k1"}) // "base": nobody knows it
	if code != 404 || !strings.Contains(fmt.Sprint(body["message"]), `template not found: base`) {
		t.Fatalf("create of a template no node knows = %d %v; want the nodes' 404", code, body)
	}
}

func TestSchedulerWarmingUp(t *testing.T) {
	f := newFixture(t, "a")
	*f.clock = f.clock.Add(-6 * time.Second) // as if the scheduler had just started
	code, body := f.do(t, "GET", "/sandboxes/unknown", map[string]string{"X-API-Key": "k1"})
	if code != 503 || !strings.Contains(fmt.Sprint(body["message"]), "started moments ago") {
		t.Fatalf("lookup miss while the scheduler warms up = %d %v; want 503", code, body)
	}

	// A sandbox whose node reports it during the warm-up (a new leader learning the
	// cluster) is served once the heartbeat comes: the gateway waits for it.
	go func() {
		time.Sleep(300 * time.Millisecond)
		err := f.state.Heartbeat(&pb.HeartbeatRequest{Node: &pb.NodeInfo{Id: "a", Endpoint: f.nodes["a"].srv.URL, Backend: "oci"},
			Sandboxes: []*pb.SandboxReport{{Id: "sb-late", State: "running"}}})
		if err != nil {
			t.Error(err)
		}
	}()
	code, body = f.do(t, "GET", "/sandboxes/sb-late", map[string]string{"X-API-Key": "k1"})
	if code != 200 || body["node"] != "a" {
		t.Fatalf("lookup of a sandbox reported during the warm-up = %d %v; want node a's 200", code, body)
	}
}

func TestStaleNode(t *testing.T) {
	f := newFixture(t, "a", "b")
	f.beat(t, "a", "sb-a")
	*f.clock = f.clock.Add(4 * time.Second)
	f.beat(t, "b")
	*f.clock = f.clock.Add(2 * time.Second) // a: 6 s silent, b: 2 s
	code, body := f.do(t, "GET", "/sandboxes/sb-a", map[string]string{"X-API-Key": "k1"})
	if code != 503 || !strings.Contains(fmt.Sprint(body["message"]), "lost") {
		t.Fatalf("sandbox on a stale node = %d %v; want 503 saying lost", code, body)
	}
	code, body = f.do(t, "POST", "/v2/sandboxes", map[string]string{"X-API-Key": "k1"})
	if code != 201 || !strings.HasPrefix(body["sandboxID"].(string), "b-") {
		t.Fatalf("create with node a stale = %d %v", code, body)
	}
	*f.clock = f.clock.Add(10 * time.Second)
	code, body = f.do(t, "POST", "/v2/sandboxes", map[string]string{"X-API-Key": "k1"})
	if code != 503 || !strings.Contains(fmt.Sprint(body["message"]), "stale") {
		t.Fatalf("create with every node stale = %d %v; want 503 naming stale heartbeats", code, body)
	}
}

func TestCreateWithNodeLocalResourcesRefused(t *testing.T) {
	f := newFixture(t, "a")
	for _, body := range []string{
		`{"templateID":"base","volumeMounts":[{"name":"v","path":"/mnt/v"}]}`,
		`{"templateID":"base","envVars":{"K":"${e2b.secrets.k}"}}`,
	} {
		req, _ := http.NewRequest("POST", f.gw.URL+"/v2/sandboxes", strings.NewReader(body))
		req.Header.Set("X-API-Key", "k1")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		raw, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusNotImplemented || !strings.Contains(string(raw), "node-local") {
			t.Fatalf("%s: %d %s", body, resp.StatusCode, raw)
		}
	}
}
