package server

import (
	"crypto/subtle"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/aenv-dev/aenv/internal/orchestrator"
	"github.com/aenv-dev/aenv/internal/sandbox"
	"github.com/aenv-dev/aenv/internal/server/api"
)

// httpMetrics are the node's HTTP request metrics.
type httpMetrics struct {
	duration *prometheus.HistogramVec
}

func newHTTPMetrics(reg prometheus.Registerer) (*httpMetrics, error) {
	m := &httpMetrics{
		duration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "aenv_http_request_duration_seconds",
			Help: "Duration of HTTP requests served by the node, by route (control plane) or route source (sandbox traffic). Streams count until they end.",
			// 0.5 ms .. ~30 min: envd streams can stay open for the life of a sandbox.
			Buckets: prometheus.ExponentialBuckets(0.0005, 2.5, 18),
		}, []string{"method", "route", "route_source", "status"}),
	}
	if err := reg.Register(m.duration); err != nil {
		var are prometheus.AlreadyRegisteredError
		if !errors.As(err, &are) {
			return nil, fmt.Errorf("register HTTP metrics: %w", err)
		}
		existing, ok := are.ExistingCollector.(*prometheus.HistogramVec)
		if !ok {
			return nil, fmt.Errorf("register HTTP metrics: %w", err)
		}
		m.duration = existing
	}
	return m, nil
}

func (m *httpMetrics) observe(method, route, source string, status int, d time.Duration) {
	m.duration.WithLabelValues(methodLabel(method), route, source, strconv.Itoa(status/100)+"xx").Observe(d.Seconds())
}

// methodLabel bounds the label's cardinality: arbitrary methods collapse to "other".
func methodLabel(m string) string {
	switch m {
	case http.MethodGet, http.MethodHead, http.MethodPost, http.MethodPut, http.MethodPatch,
		http.MethodDelete, http.MethodOptions:
		return m
	}
	return "other"
}

// MetricsHandler serves the Prometheus metrics, asking for the bearer token when the
// node has one (Options.MetricsToken).
func (s *Server) MetricsHandler() http.Handler {
	h := promhttp.HandlerFor(s.registry, promhttp.HandlerOpts{Registry: s.registry})
	if s.metricsToken == "" {
		return h
	}
	want := []byte("Bearer " + s.metricsToken)
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if subtle.ConstantTimeCompare([]byte(r.Header.Get("Authorization")), want) != 1 {
			w.Header().Set("WWW-Authenticate", `Bearer realm="aenv metrics"`)
			writeError(w, http.StatusUnauthorized, "/metrics needs the node's metrics_token as a bearer token")
			return
		}
		h.ServeHTTP(w, r)
	})
}

func (h *handlers) GetSandboxMetrics(w http.ResponseWriter, r *http.Request, id api.SandboxID, p api.GetSandboxMetricsParams) {
	if p.Start != nil && p.End != nil && *p.End < *p.Start {
		writeError(w, http.StatusBadRequest, "end (%d) must not be before start (%d)", *p.End, *p.Start)
		return
	}
	stats, err := h.s.orch.Metrics(r.Context(), id)
	if err != nil {
		writeOrchError(w, r, err)
		return
	}
	out := make([]api.SandboxMetric, 0, len(stats))
	for _, st := range stats {
		ts := st.Timestamp.Unix()
		if (p.Start != nil && ts < *p.Start) || (p.End != nil && ts > *p.End) {
			continue
		}
		out = append(out, metricBody(st))
	}
	writeJSON(w, http.StatusOK, out)
}

const maxMetricsIDs = 100

func (h *handlers) GetSandboxesMetrics(w http.ResponseWriter, r *http.Request, p api.GetSandboxesMetricsParams) {
	if len(p.SandboxIds) == 0 {
		writeError(w, http.StatusBadRequest, "sandbox_ids is required: a comma-separated list of sandbox IDs")
		return
	}
	if len(p.SandboxIds) > maxMetricsIDs {
		writeError(w, http.StatusBadRequest, "sandbox_ids may name at most %d sandboxes, got %d", maxMetricsIDs, len(p.SandboxIds))
		return
	}
	out := api.SandboxesWithMetrics{Sandboxes: map[string]api.SandboxMetric{}}
	for _, id := range p.SandboxIds {
		stats, err := h.s.orch.Metrics(r.Context(), id)
		if errors.Is(err, orchestrator.ErrNotFound) {
			continue
		}
		if err != nil {
			writeOrchError(w, r, err)
			return
		}
		if len(stats) > 0 {
			out.Sandboxes[id] = metricBody(stats[len(stats)-1])
		}
	}
	writeJSON(w, http.StatusOK, out)
}

func metricBody(st sandbox.Stats) api.SandboxMetric {
	return api.SandboxMetric{
		Timestamp:     st.Timestamp.UTC(),
		TimestampUnix: st.Timestamp.Unix(),
		CpuCount:      int32(st.CPUCount),
		CpuUsedPct:    float32(st.CPUUsedPct),
		MemUsed:       st.MemUsed,
		MemTotal:      st.MemTotal,
		MemCache:      st.MemCache,
		DiskUsed:      st.DiskUsed,
		DiskTotal:     st.DiskTotal,
	}
}
