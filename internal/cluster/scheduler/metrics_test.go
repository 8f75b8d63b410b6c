package scheduler

import (
	"context"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	pb "github.com/aenv-dev/aenv/internal/cluster/scheduler/gen/schedulerv1"
)

// scrape GETs url and parses the exposition.
func scrape(t *testing.T, url string) map[string]*dto.MetricFamily {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	p := expfmt.NewTextParser(model.UTF8Validation)
	mfs, err := p.TextToMetricFamilies(resp.Body)
	if err != nil {
		t.Fatalf("parse %s: %v", url, err)
	}
	return mfs
}

// value is the value of the sample of family name whose label (if any) is label=val.
func value(t *testing.T, mfs map[string]*dto.MetricFamily, name, label, val string) float64 {
	t.Helper()
	mf := mfs[name]
	if mf == nil {
		t.Fatalf("no metric %s in the scrape", name)
	}
	for _, m := range mf.Metric {
		if label != "" && !hasLabel(m, label, val) {
			continue
		}
		switch {
		case m.Counter != nil:
			return m.Counter.GetValue()
		case m.Gauge != nil:
			return m.Gauge.GetValue()
		case m.Histogram != nil:
			return float64(m.Histogram.GetSampleCount())
		}
	}
	t.Fatalf("no sample %s{%s=%q}", name, label, val)
	return 0
}

func hasLabel(m *dto.Metric, name, val string) bool {
	for _, l := range m.Label {
		if l.GetName() == name && l.GetValue() == val {
			return true
		}
	}
	return false
}

// The scheduler's metrics, scraped over HTTP while gRPC calls go to it, count what
// happened: placements by result, heartbeats by result, nodes by state, leadership.
func TestMetricsScrape(t *testing.T) {
	s, clk := newTestState(t)
	srv := NewServer(s, nil)
	reg := prometheus.NewRegistry()
	if err := srv.EnableMetrics(reg); err != nil {
		t.Fatal(err)
	}
	if err := srv.EnableMetrics(prometheus.NewRegistry()); err == nil {
		t.Fatal("enabling the metrics twice succeeded")
	}
	web := httptest.NewServer(promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	defer web.Close()
	c := dialInsecure(t, serveGRPC(t, srv))
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()

	mfs := scrape(t, web.URL)
	if v := value(t, mfs, "aenv_scheduler_leader", "", ""); v != 1 {
		t.Errorf("a lone scheduler reports leader = %v, want 1", v)
	}
	if v := value(t, mfs, "aenv_scheduler_placements_total", "result", "placed"); v != 0 {
		t.Errorf("placements before any = %v", v)
	}

	s.SetMembers([]Member{{ID: "a", Serving: true}, {ID: "b", Serving: true}, {ID: "c", Serving: true}})
	for _, h := range []hb{{id: "a", cpu: 2, mem: 4096}, {id: "b", cpu: 2, mem: 4096}, {id: "c", cpu: 2, mem: 4096, draining: true}} {
		if _, err := c.Heartbeat(ctx, h.req()); err != nil {
			t.Fatal(err)
		}
	}
	_, _ = c.Heartbeat(ctx, hb{id: "intruder", cpu: 2, mem: 1}.req()) // not discovered
	_, _ = c.Heartbeat(ctx, &pb.HeartbeatRequest{})                   // no node id
	req := &pb.PlaceRequest{Resources: &pb.Resources{CpuCount: 1, MemoryMb: 512}}
	for range 3 {
		p, err := c.Place(ctx, req)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := c.Bind(ctx, &pb.BindRequest{SandboxId: "sb-" + p.ReservationId, NodeId: p.Node.Id, ReservationId: p.ReservationId}); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := c.Place(ctx, req); err != nil { // the fourth CPU: held, not bound
		t.Fatal(err)
	}
	_, _ = c.Place(ctx, req)                                                                         // no CPU left
	_, _ = c.Place(ctx, &pb.PlaceRequest{Resources: &pb.Resources{CpuCount: -1}})                    // invalid
	_, _ = c.Place(ctx, &pb.PlaceRequest{Resources: &pb.Resources{CpuCount: 1}, Backend: "microvm"}) // none of that kind

	mfs = scrape(t, web.URL)
	for _, tc := range []struct {
		name, label, val string
		want             float64
	}{
		{"aenv_scheduler_placements_total", "result", "placed", 4},
		{"aenv_scheduler_placements_total", "result", "no_capacity", 2},
		{"aenv_scheduler_placements_total", "result", "invalid", 1},
		{"aenv_scheduler_placement_duration_seconds", "", "", 4},
		{"aenv_scheduler_heartbeats_total", "result", "ok", 3},
		{"aenv_scheduler_heartbeats_total", "result", "unknown_node", 1},
		{"aenv_scheduler_heartbeats_total", "result", "invalid", 1},
		{"aenv_scheduler_nodes", "state", "ready", 2},
		{"aenv_scheduler_nodes", "state", "draining", 1},
		{"aenv_scheduler_nodes", "state", "stale", 0},
		{"aenv_scheduler_sandboxes_bound", "", "", 3},
		{"aenv_scheduler_reservations", "", "", 4},
	} {
		if got := value(t, mfs, tc.name, tc.label, tc.val); got != tc.want {
			t.Errorf("%s{%s=%q} = %v, want %v", tc.name, tc.label, tc.val, got, tc.want)
		}
	}

	// Silence: b and c go stale; a keeps beating.
	clk.advance(6 * time.Second)
	if _, err := c.Heartbeat(ctx, hb{id: "a", cpu: 2, mem: 4096}.req()); err != nil {
		t.Fatal(err)
	}
	mfs = scrape(t, web.URL)
	if got := value(t, mfs, "aenv_scheduler_nodes", "state", "stale"); got != 2 {
		t.Errorf("stale nodes = %v, want 2", got)
	}

	// A follower keeps no state and says it does not lead.
	srv.Follow("")
	mfs = scrape(t, web.URL)
	if got := value(t, mfs, "aenv_scheduler_leader", "", ""); got != 0 {
		t.Errorf("a follower reports leader = %v", got)
	}
	if got := value(t, mfs, "aenv_scheduler_nodes", "state", "ready"); got != 0 {
		t.Errorf("a follower reports %v ready nodes", got)
	}
}
