package orchestrator

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
)

func TestTTL(t *testing.T) {
	ctx := context.Background()
	type step struct {
		advance time.Duration
		do      func(h *harness, id string) error
		want    State // after the step; "" = gone
	}
	timeout := func(d time.Duration) func(*harness, string) error {
		return func(h *harness, id string) error { return h.o.SetTimeout(ctx, id, d) }
	}
	refresh := func(d time.Duration) func(*harness, string) error {
		return func(h *harness, id string) error { return h.o.Refresh(ctx, id, d) }
	}
	connect := func(d time.Duration) func(*harness, string) error {
		return func(h *harness, id string) error {
			_, _, err := h.o.Connect(ctx, id, ConnectOptions{Timeout: d})
			return err
		}
	}
	cases := []struct {
		name      string
		autoPause bool
		steps     []step
	}{
		{name: "expires at the absolute deadline", steps: []step{
			{advance: 59 * time.Second, want: StateRunning},
			{advance: time.Second, want: ""},
		}},
		{name: "auto-pause on expiry", autoPause: true, steps: []step{
			{advance: time.Minute, want: StatePaused},
			{advance: time.Hour, want: StatePaused},
		}},
		{name: "setTimeout shortens", steps: []step{
			{do: timeout(10 * time.Second), want: StateRunning},
			{advance: 9 * time.Second, want: StateRunning},
			{advance: time.Second, want: ""},
		}},
		{name: "setTimeout extends", steps: []step{
			{advance: 30 * time.Second, do: timeout(2 * time.Minute), want: StateRunning},
			{advance: 119 * time.Second, want: StateRunning},
			{advance: time.Second, want: ""},
		}},
		{name: "refresh never shortens", steps: []step{
			{do: refresh(time.Second), want: StateRunning},
			{advance: 30 * time.Second, want: StateRunning},
			{advance: 30 * time.Second, want: ""},
		}},
		{name: "refresh extends", steps: []step{
			{advance: 50 * time.Second, do: refresh(30 * time.Second), want: StateRunning},
			{advance: 29 * time.Second, want: StateRunning},
			{advance: time.Second, want: ""},
		}},
		{name: "connect never shortens", steps: []step{
			{do: connect(time.Second), want: StateRunning},
			{advance: 59 * time.Second, want: StateRunning},
			{advance: time.Second, want: ""},
		}},
		{name: "connect extends", steps: []step{
			{advance: 40 * time.Second, do: connect(time.Minute), want: StateRunning},
			{advance: 59 * time.Second, want: StateRunning},
			{advance: time.Second, want: ""},
		}},
		{name: "resume re-arms", autoPause: true, steps: []step{
			{advance: time.Minute, want: StatePaused},
			{do: connect(20 * time.Second), want: StateRunning},
			{advance: 20 * time.Second, want: StatePaused},
		}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, backendModes[0].opts, nil)
			sb := h.create(CreateRequest{Timeout: time.Minute, AutoPause: tc.autoPause})
			for i, st := range tc.steps {
				h.clock.Advance(st.advance)
				h.settle()
				if st.do != nil {
					if err := st.do(h, sb.ID); err != nil {
						t.Fatalf("step %d: %v", i, err)
					}
				}
				if got := h.state(sb.ID); got != st.want {
					t.Fatalf("step %d: state %q, want %q", i, got, st.want)
				}
			}
		})
	}
}

func TestSetTimeoutZeroExpiresNow(t *testing.T) {
	for _, autoPause := range []bool{false, true} {
		h := newHarness(t, backendModes[0].opts, nil)
		sb := h.create(CreateRequest{Timeout: time.Hour, AutoPause: autoPause})
		if err := h.o.SetTimeout(context.Background(), sb.ID, -5*time.Second); err != nil {
			t.Fatal(err)
		}
		want := State("")
		if autoPause {
			want = StatePaused
		}
		eventually(t, "expiry after setTimeout(0)", func() bool { return h.state(sb.ID) == want })
		if !autoPause && h.stored(sb.ID) != nil {
			t.Fatal("expired sandbox still persisted")
		}
		if !autoPause {
			eventually(t, "timeout kill counted", func() bool {
				return testutil.ToFloat64(h.o.m.kills.WithLabelValues("timeout")) == 1
			})
		}
	}
}

func TestTimeoutValidation(t *testing.T) {
	h := newHarness(t, backendModes[0].opts, func(c *Config) { c.MaxTimeout = time.Hour })
	sb := h.create(CreateRequest{})
	ctx := context.Background()
	if err := h.o.SetTimeout(ctx, sb.ID, 2*time.Hour); !errors.Is(err, ErrInvalid) {
		t.Fatalf("setTimeout above max: %v", err)
	}
	if err := h.o.Refresh(ctx, sb.ID, 2*time.Hour); !errors.Is(err, ErrInvalid) {
		t.Fatalf("refresh above max: %v", err)
	}
	if _, _, err := h.o.Connect(ctx, sb.ID, ConnectOptions{Timeout: -time.Second}); !errors.Is(err, ErrInvalid) {
		t.Fatalf("negative connect timeout: %v", err)
	}
}

// An expiry that fires while the TTL is being extended must not kill the sandbox.
func TestStaleTimerIgnored(t *testing.T) {
	h := newHarness(t, backendModes[0].opts, nil)
	sb := h.create(CreateRequest{Timeout: time.Minute})
	h.o.mu.Lock()
	e := h.o.entries[sb.ID]
	e.rec.EndAt = h.clock.Now().Add(time.Hour) // extended without re-arming the timer
	h.o.mu.Unlock()
	h.clock.Advance(time.Minute)
	h.settle()
	if h.state(sb.ID) != StateRunning {
		t.Fatal("stale timer killed a sandbox whose TTL was extended")
	}
	h.clock.Advance(59 * time.Minute) // the re-armed timer fires at the real deadline
	h.settle()
	if h.state(sb.ID) != "" {
		t.Fatal("re-armed timer did not expire the sandbox")
	}
}
