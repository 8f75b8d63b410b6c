package orchestrator

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/aenv-dev/aenv/internal/sandbox"
	"github.com/aenv-dev/aenv/internal/sandbox/mock"
)

func TestForkChildrenAreIsolatedCopies(t *testing.T) {
	ctx := context.Background()
	for _, mode := range snapModes {
		t.Run(mode.name, func(t *testing.T) {
			h := newHarness(t, mode.opts, nil)
			src := h.create(CreateRequest{Secure: true, Timeout: time.Hour, Metadata: map[string]string{"run": "1"},
				EnvVars: map[string]string{"OWN": "x"}, AutoPause: true, AutoResume: true})
			parent := h.inst(src.ID)
			parent.WriteFile("/shared", []byte("before"))
			parent.StartProcess("agent")

			const n = 6
			res, err := h.o.Fork(ctx, src.ID, n, 2*time.Minute)
			if err != nil {
				t.Fatal(err)
			}
			if len(res) != n {
				t.Fatalf("%d results, want %d", len(res), n)
			}
			parent.WriteFile("/shared", []byte("after"))
			if e := h.inst(src.ID).Envd().Inits()[0].Entropy; e != nil {
				t.Fatalf("a fresh sandbox's envd got entropy %x: its memory is its own", e)
			}
			seen := map[string]bool{src.ID: true}
			entropy := map[string]bool{}
			for i, r := range res {
				if r.Err != nil || r.Sandbox == nil {
					t.Fatalf("child %d: %+v", i, r)
				}
				c := r.Sandbox
				if seen[c.ID] || c.EnvdAccessToken == "" || c.EnvdAccessToken == src.EnvdAccessToken ||
					c.TrafficAccessToken == src.TrafficAccessToken {
					t.Fatalf("child %d shares identity with another sandbox: %+v", i, c)
				}
				seen[c.ID] = true
				if plan := h.inst(c.ID).Plan(); plan.Kind != sandbox.LaunchFromSnapshot || plan.SnapshotTemplate {
					t.Fatalf("child %d plan %+v: a fork's capture is no snapshot template", i, plan)
				}
				if c.TemplateID != src.TemplateID || c.Metadata["run"] != "1" || c.EnvVars["OWN"] != "x" ||
					!c.AutoPause || !c.AutoResume || c.State != StateRunning {
					t.Fatalf("child %d did not inherit the source's settings: %+v", i, c)
				}
				if want := h.clock.Now().Add(2 * time.Minute); !c.EndAt.Equal(want) {
					t.Fatalf("child %d endAt %v, want %v", i, c.EndAt, want)
				}
				if h.stored(c.ID) == nil {
					t.Fatalf("child %d not persisted", i)
				}
				// The child's envd may hold the source's token (its memory is the
				// source's): /init authenticates with it and replaces it.
				if in := h.inst(c.ID).Envd().Inits(); len(in) != 1 || in[0].HeaderToken != src.EnvdAccessToken ||
					in[0].AccessToken != c.EnvdAccessToken {
					t.Fatalf("child %d envd init %+v, want header token %q", i, in, src.EnvdAccessToken)
				}
				// Children that continue the source's memory continue its random generator
				// too, unless each gets entropy of its own.
				e := h.inst(c.ID).Envd().Inits()[0].Entropy
				if want := mode.opts.Capabilities.MemorySnapshots; (len(e) == entropyBytes) != want || want && entropy[string(e)] {
					t.Fatalf("child %d envd init entropy %x (seen before: %v), want %d fresh bytes: %v", i, e, entropy[string(e)], entropyBytes, want)
				}
				entropy[string(e)] = true
				h.inst(c.ID).WriteFile("/mine", []byte(fmt.Sprint(i)))
				hasAgent := slices.Contains(h.inst(c.ID).Processes(), "agent")
				if hasAgent != mode.opts.Capabilities.LiveFork {
					t.Fatalf("child %d continues processes = %v, backend LiveFork = %v", i, hasAgent, mode.opts.Capabilities.LiveFork)
				}
			}
			for i, r := range res {
				if got := h.file(r.Sandbox.ID, "/shared"); got != "before" {
					t.Fatalf("child %d sees /shared=%q: the parent's later write leaked", i, got)
				}
				if got := h.file(r.Sandbox.ID, "/mine"); got != fmt.Sprint(i) {
					t.Fatalf("child %d sees /mine=%q: another child's write leaked", i, got)
				}
			}
			if _, ok := parent.ReadFile("/mine"); ok {
				t.Fatal("the parent sees a child's write")
			}
			if after, _ := h.o.Get(ctx, src.ID); after.State != StateRunning || h.b.Instance(src.ID) != parent ||
				!after.EndAt.Equal(src.EndAt) {
				t.Fatalf("source after fork: %+v", after)
			}
			if d := h.b.DiscardedSnapshots(); !slices.Equal(d, []string{src.ID}) {
				t.Fatalf("fork capture discards = %v, want exactly the one capture", d)
			}
			items, _, _ := h.o.List(ctx, ListFilter{Metadata: map[string]string{"run": "1"}})
			if len(items) != n+1 {
				t.Fatalf("list shows %d sandboxes, want %d", len(items), n+1)
			}
			if c := histCount(t, h, opFork, stageTotal, "ok"); c != 1 {
				t.Fatalf("fork total observations = %d", c)
			}
		})
	}
}

func TestForkSomeChildrenFail(t *testing.T) {
	ctx := context.Background()
	h := newHarness(t, snapModes[0].opts, func(c *Config) { c.MaxSandboxes = 4 })
	src := h.create(CreateRequest{Timeout: time.Hour})
	h.b.Fail(mock.StageLaunch, errors.New("no network slot"), 2)
	// 1 source + 5 children against a limit of 4: two launches fail in the backend and
	// the remaining three compete for three slots... all three fit only if the two
	// failures happen first; so count outcomes instead of positions.
	res, err := h.o.Fork(ctx, src.ID, 5, 0)
	if err != nil {
		t.Fatal(err)
	}
	ok, launchFail, capacity := 0, 0, 0
	for _, r := range res {
		switch {
		case r.Err == nil && r.Sandbox != nil:
			ok++
		case r.Sandbox != nil:
			t.Fatalf("result with both sandbox and error: %+v", r)
		case errors.Is(r.Err, ErrCapacity):
			capacity++
		case r.Err != nil:
			launchFail++
		default:
			t.Fatal("empty fork result")
		}
	}
	if ok+launchFail+capacity != 5 || launchFail != 2 || ok > 3 || ok < 1 {
		t.Fatalf("outcomes ok=%d launch=%d capacity=%d", ok, launchFail, capacity)
	}
	live := h.b.Live()
	if len(live) != ok+1 {
		t.Fatalf("%d live instances, want %d (failed children must leave nothing)", len(live), ok+1)
	}
	all, _ := h.cat.Sandboxes().All()
	if len(all) != ok+1 {
		t.Fatalf("%d records, want %d", len(all), ok+1)
	}
	if h.state(src.ID) != StateRunning {
		t.Fatal("source not running after a partly failed fork")
	}
}

func TestForkRefusals(t *testing.T) {
	ctx := context.Background()
	for _, tc := range []struct {
		name    string
		opts    mock.Options
		count   int
		timeout time.Duration
		prepare func(h *harness, id string) string
		want    error
	}{
		{"count 0", snapModes[0].opts, 0, 0, nil, ErrInvalid},
		{"count -1", snapModes[0].opts, -1, 0, nil, ErrInvalid},
		{"count 101", snapModes[0].opts, 101, 0, nil, ErrInvalid},
		{"count 1000", snapModes[0].opts, 1000, 0, nil, ErrInvalid},
		{"negative timeout", snapModes[0].opts, 1, -time.Second, nil, ErrInvalid},
		{"timeout above max", snapModes[0].opts, 1, 48 * time.Hour, nil, ErrInvalid},
		{"unknown", snapModes[0].opts, 1, 0, func(*harness, string) string { return "nope" }, ErrNotFound},
		{"paused", snapModes[0].opts, 1, 0, func(h *harness, id string) string {
			if err := h.o.Pause(ctx, id, sandbox.PauseOptions{KeepMemory: true}); err != nil {
				h.t.Fatal(err)
			}
			return id
		}, ErrConflict},
		{"no snapshots", mock.Options{}, 1, 0, nil, ErrUnsupported},
		{"capture fails", snapModes[0].opts, 2, 0, func(h *harness, id string) string {
			h.b.Fail(mock.StageSnapshot, errors.New("freeze timed out"), 1)
			return id
		}, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, tc.opts, nil)
			sb := h.create(CreateRequest{Timeout: time.Hour})
			target := sb.ID
			if tc.prepare != nil {
				target = tc.prepare(h, sb.ID)
			}
			before := h.state(sb.ID)
			res, err := h.o.Fork(ctx, target, tc.count, tc.timeout)
			if err == nil || res != nil || (tc.want != nil && !errors.Is(err, tc.want)) {
				t.Fatalf("Fork = %v, %v; want %v", res, err, tc.want)
			}
			if live := h.b.Live(); len(live) > 1 {
				t.Fatalf("children started by a refused fork: %v", live)
			}
			if got := h.state(sb.ID); got != before {
				t.Fatalf("source state %q, want %q", got, before)
			}
		})
	}
}
