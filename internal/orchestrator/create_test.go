package orchestrator

import (
	"context"
	"encoding/json"
	"errors"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/aenv-dev/aenv/internal/sandbox"
	"github.com/aenv-dev/aenv/internal/sandbox/mock"
)

func TestCreateInitialisesEnvdAndPersists(t *testing.T) {
	h := newHarness(t, mock.Options{}, nil)
	sb := h.create(CreateRequest{TemplateID: "default", Timeout: 120 * time.Second, Secure: true,
		Metadata: map[string]string{"user": "a b"}, EnvVars: map[string]string{"FOO": "bar", "SHARED": "request"},
		AllowInternet: true})

	if !regexp.MustCompile(`^[a-z0-9]{20}$`).MatchString(sb.ID) {
		t.Fatalf("id %q is not 20 lowercase alphanumerics", sb.ID)
	}
	if sb.State != StateRunning || sb.TemplateID != "base" || sb.Alias != "default" {
		t.Fatalf("record = %+v", sb)
	}
	if sb.EnvdAccessToken == "" || sb.EnvdAccessToken != h.o.EnvdAccessToken(sb.ID) {
		t.Fatalf("envd token %q not the derived one", sb.EnvdAccessToken)
	}
	if sb.TrafficAccessToken == "" || sb.TrafficAccessToken == sb.EnvdAccessToken {
		t.Fatalf("traffic token %q", sb.TrafficAccessToken)
	}
	if sb.EnvdVersion != mock.EnvdVersion {
		t.Fatalf("envdVersion %q", sb.EnvdVersion)
	}
	now := h.clock.Now()
	if !sb.StartedAt.Equal(now) || !sb.EndAt.Equal(now.Add(120*time.Second)) {
		t.Fatalf("startedAt %v endAt %v, now %v", sb.StartedAt, sb.EndAt, now)
	}
	if sb.Resources != (sandbox.Resources{CPUCount: 1, MemoryMB: 256, DiskSizeMB: 2048}) {
		t.Fatalf("resources %+v (want template values, then defaults)", sb.Resources)
	}

	inst := h.b.Instance(sb.ID)
	if inst == nil {
		t.Fatal("backend has no instance")
	}
	plan := inst.Plan()
	if plan.Kind != sandbox.LaunchFresh || plan.RootFS.LowerDir != "/srv/base" || !plan.AllowInternet || plan.Resources != sb.Resources {
		t.Fatalf("launch plan %+v", plan)
	}
	inits := inst.Envd().Inits()
	if len(inits) != 1 {
		t.Fatalf("%d init calls", len(inits))
	}
	in := inits[0]
	wantEnv := map[string]string{"FOO": "bar", "SHARED": "request", "FROM_TEMPLATE": "1",
		"E2B_SANDBOX": "true", "E2B_SANDBOX_ID": sb.ID, "E2B_TEMPLATE_ID": "base"}
	for k, v := range wantEnv {
		if in.EnvVars[k] != v {
			t.Errorf("init env %s = %q, want %q", k, in.EnvVars[k], v)
		}
	}
	if in.AccessToken != sb.EnvdAccessToken || in.DefaultUser != "user" || in.DefaultWorkdir != "/home/user" || in.HeaderToken != "" {
		t.Fatalf("init request %+v", in)
	}
	if ts, err := time.Parse(time.RFC3339Nano, in.Timestamp); err != nil || !ts.Equal(now) {
		t.Fatalf("init timestamp %q: %v", in.Timestamp, err)
	}

	st := h.stored(sb.ID)
	if st == nil || st.State != StateRunning || st.EnvdAccessToken != sb.EnvdAccessToken || st.Metadata["user"] != "a b" {
		t.Fatalf("persisted record %+v", st)
	}
	if got := testutil.ToFloat64(h.o.m.creates.WithLabelValues("ok")); got != 1 {
		t.Fatalf("creates ok = %v", got)
	}
}

// The JSON keys of /init are envd's (e2b-protocol.md §3.6); check them on the wire
// rather than through the struct the code was written with.
func TestEnvdInitWireKeys(t *testing.T) {
	tok := "t"
	raw, err := json.Marshal(envdInit{EnvVars: map[string]string{}, AccessToken: &tok, DefaultUser: "user",
		DefaultWorkdir: "/home/user", Timestamp: "x"})
	if err != nil {
		t.Fatal(err)
	}
	var m map[string]any
	json.Unmarshal(raw, &m)
	for _, k := range []string{"envVars", "accessToken", "defaultUser", "defaultWorkdir", "timestamp"} {
		if _, ok := m[k]; !ok {
			t.Errorf("init body lacks %q: %s", k, raw)
		}
	}
}

func TestCreateInsecureHasNoEnvdToken(t *testing.T) {
	h := newHarness(t, mock.Options{}, nil)
	sb := h.create(CreateRequest{})
	if sb.EnvdAccessToken != "" {
		t.Fatalf("insecure create got token %q", sb.EnvdAccessToken)
	}
	if in := h.b.Instance(sb.ID).Envd().Inits()[0]; in.AccessToken != "" {
		t.Fatalf("insecure init sent token %q", in.AccessToken)
	}
}

func TestCreateRequestHandling(t *testing.T) {
	h := newHarness(t, mock.Options{}, func(c *Config) {
		c.MaxTimeout = time.Hour
		c.DefaultTimeout = 300 * time.Second
	})
	cases := []struct {
		name    string
		req     CreateRequest
		wantErr error
		check   func(t *testing.T, sb *Sandbox)
	}{
		{name: "empty template", req: CreateRequest{}, wantErr: ErrInvalid},
		{name: "unknown template", req: CreateRequest{TemplateID: "nope"}, wantErr: ErrTemplateNotFound},
		{name: "negative timeout", req: CreateRequest{TemplateID: "base", Timeout: -time.Second}, wantErr: ErrInvalid},
		{name: "timeout above max", req: CreateRequest{TemplateID: "base", Timeout: 2 * time.Hour}, wantErr: ErrInvalid},
		{name: "negative memory", req: CreateRequest{TemplateID: "base", Resources: sandbox.Resources{MemoryMB: -1}}, wantErr: ErrInvalid},
		{name: "empty env name", req: CreateRequest{TemplateID: "base", EnvVars: map[string]string{"": "x"}}, wantErr: ErrInvalid},
		{name: "default timeout", req: CreateRequest{TemplateID: "base"}, check: func(t *testing.T, sb *Sandbox) {
			if d := sb.EndAt.Sub(sb.StartedAt); d != 300*time.Second {
				t.Fatalf("ttl %v", d)
			}
		}},
		{name: "request resources win", req: CreateRequest{TemplateID: "base", Resources: sandbox.Resources{CPUCount: 4, MemoryMB: 1024, DiskSizeMB: 10}},
			check: func(t *testing.T, sb *Sandbox) {
				if sb.Resources != (sandbox.Resources{CPUCount: 4, MemoryMB: 1024, DiskSizeMB: 10}) {
					t.Fatalf("resources %+v", sb.Resources)
				}
			}},
		{name: "by id reports first alias", req: CreateRequest{TemplateID: "base"}, check: func(t *testing.T, sb *Sandbox) {
			if sb.TemplateID != "base" || sb.Alias != "default" {
				t.Fatalf("template %q alias %q", sb.TemplateID, sb.Alias)
			}
		}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			before := len(h.b.Launches())
			sb, err := h.o.Create(context.Background(), tc.req)
			if tc.wantErr != nil {
				if !errors.Is(err, tc.wantErr) {
					t.Fatalf("err = %v, want %v", err, tc.wantErr)
				}
				if len(h.b.Launches()) != before {
					t.Fatal("a rejected create reached the backend")
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			tc.check(t, sb)
		})
	}
}

// Every stage of create can fail; none may leave an instance, an entry or a record.
func TestCreateFailureLeavesNothing(t *testing.T) {
	boom := errors.New("boom")
	cases := []struct {
		name   string
		inject func(h *harness)
	}{
		{"launch", func(h *harness) { h.b.Fail(mock.StageLaunch, boom, 1) }},
		{"envd never healthy", func(h *harness) { h.b.Fail(mock.StageEnvdHealth, boom, -1) }},
		{"envd init", func(h *harness) { h.b.Fail(mock.StageEnvdInit, boom, 1) }},
		{"persist", func(h *harness) { h.store.failPuts(1) }},
		{"persist and stop", func(h *harness) { h.store.failPuts(1); h.b.Fail(mock.StageStop, boom, 1) }},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, mock.Options{}, func(c *Config) { c.EnvdReadyTimeout = 50 * time.Millisecond })
			tc.inject(h)
			if _, err := h.o.Create(context.Background(), CreateRequest{TemplateID: "base", Secure: true}); err == nil {
				t.Fatal("create succeeded despite the injected failure")
			}
			items, _, err := h.o.List(context.Background(), ListFilter{})
			if err != nil || len(items) != 0 {
				t.Fatalf("list after failure = %v, %v", items, err)
			}
			h.o.mu.Lock()
			n := len(h.o.entries)
			h.o.mu.Unlock()
			if n != 0 {
				t.Fatalf("%d entries left", n)
			}
			all, _ := h.cat.Sandboxes().All()
			if len(all) != 0 {
				t.Fatalf("records left: %v", all)
			}
			if tc.name != "persist and stop" {
				if live := h.b.Live(); len(live) != 0 {
					t.Fatalf("instances left: %v", live)
				}
			}
			if got := testutil.ToFloat64(h.o.m.failures.WithLabelValues(opCreate)); got != 1 {
				t.Fatalf("create failures = %v", got)
			}
			// The node keeps working after the failure.
			h.b.ClearFailures()
			h.create(CreateRequest{})
		})
	}
}

func TestEnvdHealthRetries(t *testing.T) {
	h := newHarness(t, mock.Options{}, nil)
	h.b.Fail(mock.StageEnvdHealth, errors.New("starting"), 3)
	h.create(CreateRequest{})
}

func TestCapacity(t *testing.T) {
	h := newHarness(t, mock.Options{Capabilities: sandbox.Capabilities{PauseReleasesMemory: true}, StopOnPause: true},
		func(c *Config) { c.MaxSandboxes = 2 })
	a := h.create(CreateRequest{})
	h.create(CreateRequest{})
	if _, err := h.o.Create(context.Background(), CreateRequest{TemplateID: "base"}); !errors.Is(err, ErrCapacity) {
		t.Fatalf("third create: %v, want ErrCapacity", err)
	}
	// A pause that releases memory frees a slot.
	if err := h.o.Pause(context.Background(), a.ID, sandbox.PauseOptions{}); err != nil {
		t.Fatal(err)
	}
	h.create(CreateRequest{})
}

// Requests above what the node can ever give are ErrInvalid naming the field and limit;
// requests that do not fit next to the sandboxes holding resources are ErrCapacity. A
// refusal launches nothing and registers nothing.
func TestResourceAdmission(t *testing.T) {
	h := newHarness(t, mock.Options{Capabilities: sandbox.Capabilities{PauseReleasesMemory: true}, StopOnPause: true},
		func(c *Config) { c.Capacity = Capacity{CPUCount: 4, MemoryMB: 2048, DiskSizeMB: 10000} })
	ctx := context.Background()
	refuse := func(r sandbox.Resources, want error, parts ...string) {
		t.Helper()
		launches := len(h.b.Launches())
		before, _, _ := h.o.List(ctx, ListFilter{})
		_, err := h.o.Create(ctx, CreateRequest{TemplateID: "base", Resources: r})
		if !errors.Is(err, want) {
			t.Fatalf("create %+v: %v, want %v", r, err, want)
		}
		for _, p := range parts {
			if !strings.Contains(err.Error(), p) {
				t.Fatalf("create %+v: %q does not say %q", r, err, p)
			}
		}
		after, _, _ := h.o.List(ctx, ListFilter{})
		if len(h.b.Launches()) != launches || len(after) != len(before) {
			t.Fatalf("refused create %+v left something: %d launches (was %d), %d sandboxes (was %d)",
				r, len(h.b.Launches()), launches, len(after), len(before))
		}
	}
	refuse(sandbox.Resources{MemoryMB: 100000000}, ErrInvalid, "memoryMB 100000000", "2048 MB", "memory_overcommit")
	refuse(sandbox.Resources{CPUCount: 5}, ErrInvalid, "cpuCount 5", "limit is 4", "cpu_overcommit")
	refuse(sandbox.Resources{DiskSizeMB: 10001}, ErrInvalid, "diskSizeMB 10001", "10000 MB")

	// CPUs are time-shared: three sandboxes of 4 CPUs fit; memory is what fills a node.
	a := h.create(CreateRequest{Resources: sandbox.Resources{CPUCount: 4, MemoryMB: 1024}})
	h.create(CreateRequest{Resources: sandbox.Resources{CPUCount: 4, MemoryMB: 512}})
	h.create(CreateRequest{Resources: sandbox.Resources{CPUCount: 4, MemoryMB: 256}})
	refuse(sandbox.Resources{MemoryMB: 257}, ErrCapacity, "node is out of sandbox capacity", "1792 of its 2048 MB", "asks for 257 MB")
	h.create(CreateRequest{Resources: sandbox.Resources{MemoryMB: 256}})
	// A pause that releases memory gives its share back.
	if err := h.o.Pause(ctx, a.ID, sandbox.PauseOptions{}); err != nil {
		t.Fatal(err)
	}
	refuse(sandbox.Resources{MemoryMB: 1025}, ErrCapacity, "1024 of its 2048 MB")
	h.create(CreateRequest{Resources: sandbox.Resources{MemoryMB: 1024}})
}

func TestTokensDeterministicPerSeed(t *testing.T) {
	h := newHarness(t, mock.Options{}, nil)
	id := "abcdefghij0123456789"
	tok := h.o.EnvdAccessToken(id)
	if tok != h.o.EnvdAccessToken(id) || tok == h.o.EnvdAccessToken("abcdefghij0123456788") {
		t.Fatal("token is not a function of the id")
	}
	h.restart()
	if h.o.EnvdAccessToken(id) != tok {
		t.Fatal("token changed across a restart: the seed was not persisted")
	}
	other := newHarness(t, mock.Options{}, nil)
	if other.o.EnvdAccessToken(id) == tok {
		t.Fatal("two nodes with different seeds derive the same token")
	}
}
