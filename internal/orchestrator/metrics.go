package orchestrator

import (
	"fmt"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// Operation and stage label values of aenv_sandbox_stage_duration_seconds.
const (
	opCreate   = "create"
	opPause    = "pause"
	opResume   = "resume"
	opKill     = "kill"
	opSnapshot = "snapshot"
	opFork     = "fork"

	stageResolve  = "resolve_template"
	stageLaunch   = "launch"
	stageEnvdWait = "envd_wait"
	stageEnvdInit = "envd_init"
	stagePersist  = "persist"
	stagePause    = "pause"
	stageThaw     = "thaw"
	stageDecode   = "decode"
	stageStop     = "stop"
	stageCapture  = "capture"  // Instance.Snapshot
	stageRegister = "register" // catalog record of a snapshot
	stageTotal    = "total"
	// stageHandoff: a pause in a cluster publishing the sandbox for other nodes;
	// stageClaim: a resume on another node claiming and registering that publication.
	stageHandoff = "handoff"
	stageClaim   = "claim"
)

// BuildMetadataKey marks the sandboxes the template builder runs builds in (its value
// is the build id): their creates, kills and captures stay out of the lifecycle metrics.
const BuildMetadataKey = "aenv.build"

// metricsFor is where a sandbox's lifecycle is measured: o.m, or o.quiet for build
// sandboxes.
func (o *Orchestrator) metricsFor(meta map[string]string) *metrics {
	if meta[BuildMetadataKey] != "" {
		return o.quiet
	}
	return o.m
}

type metrics struct {
	stage    *prometheus.HistogramVec
	creates  *prometheus.CounterVec
	kills    *prometheus.CounterVec
	failures *prometheus.CounterVec
}

// newMetrics registers the orchestrator's collectors. Gauges are computed at scrape
// time from the live entries, so they can never drift from the truth.
func newMetrics(reg prometheus.Registerer, o *Orchestrator) (*metrics, error) {
	m := &metrics{
		stage: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "aenv_sandbox_stage_duration_seconds",
			Help: "Duration of each stage of sandbox lifecycle operations.",
			// 250 µs … ~4 min: container creates take milliseconds, VM cold boots minutes.
			Buckets: prometheus.ExponentialBuckets(0.00025, 2, 20),
		}, []string{"operation", "stage", "status"}),
		creates: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "aenv_sandbox_creates_total",
			Help: "Sandbox creates by outcome.",
		}, []string{"status"}),
		kills: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "aenv_sandbox_kills_total",
			Help: "Sandboxes killed, by reason (api, timeout, shutdown, failure).",
		}, []string{"reason"}),
		failures: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "aenv_sandbox_operation_failures_total",
			Help: "Failed lifecycle operations by operation.",
		}, []string{"operation"}),
	}
	gauge := func(name, help string, f func(g gauges) float64) prometheus.Collector {
		return prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: name, Help: help},
			func() float64 { return f(o.gauges()) })
	}
	cs := []prometheus.Collector{m.stage, m.creates, m.kills, m.failures,
		gauge("aenv_sandboxes_running", "Sandboxes running (including ones mid-operation).",
			func(g gauges) float64 { return float64(g.running) }),
		gauge("aenv_sandboxes_paused", "Sandboxes paused.",
			func(g gauges) float64 { return float64(g.paused) }),
		gauge("aenv_sandbox_allocated_cpus", "CPUs allocated to sandboxes that hold resources.",
			func(g gauges) float64 { return float64(g.cpus) }),
		gauge("aenv_sandbox_allocated_memory_bytes", "Memory allocated to sandboxes that hold resources.",
			func(g gauges) float64 { return float64(g.memMB) * (1 << 20) }),
	}
	for _, c := range cs {
		if err := reg.Register(c); err != nil {
			return nil, fmt.Errorf("orchestrator: register metrics: %w", err)
		}
	}
	return m, nil
}

type gauges struct {
	running, paused int
	cpus, memMB     int
}

// gauges counts entries. A paused sandbox still holds its allocation when the backend
// pauses in place (freezer), so it is counted as allocated then.
func (o *Orchestrator) gauges() gauges {
	releases := o.backend.Capabilities().PauseReleasesMemory
	o.mu.Lock()
	defer o.mu.Unlock()
	var g gauges
	for _, e := range o.entries {
		if e.rec.State == StatePaused {
			g.paused++
			if releases || e.rec.DiskSnapshot != nil {
				continue
			}
		} else if e.rec.State != StateCreating {
			g.running++
		}
		g.cpus += e.rec.Resources.CPUCount
		g.memMB += e.rec.Resources.MemoryMB
	}
	return g
}

// timeStage runs one stage and records its duration.
func (m *metrics) timeStage(operation, stage string, f func() error) error {
	start := time.Now()
	err := f()
	m.observe(operation, stage, start, err)
	return err
}

func (m *metrics) observe(operation, stage string, start time.Time, err error) {
	status := "ok"
	if err != nil {
		status = "error"
	}
	m.stage.WithLabelValues(operation, stage, status).Observe(time.Since(start).Seconds())
}
