package build

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// Build phases timed by aenv_template_build_phase_duration_seconds, in order.
const (
	PhaseQueue    = "queue"    // waiting for a build slot
	PhaseBase     = "base"     // pulling and importing the base image, or resolving the base template
	PhaseSandbox  = "sandbox"  // starting the build sandbox and making sure the default user exists
	PhaseSteps    = "steps"    // the build steps
	PhaseReady    = "ready"    // the start command and the wait for the ready command
	PhaseCapture  = "capture"  // capturing the sandbox as the template
	PhaseRegister = "register" // catalog, repository publish, pruning older builds
)

// metrics are the builder's Prometheus metrics.
type metrics struct {
	phase    *prometheus.HistogramVec
	builds   *prometheus.CounterVec
	failures *prometheus.CounterVec
	running  prometheus.Gauge
}

func newMetrics(reg prometheus.Registerer) (*metrics, error) {
	if reg == nil {
		reg = prometheus.NewRegistry() // counted, not exported
	}
	m := &metrics{
		phase: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "aenv_template_build_phase_duration_seconds",
			Help: "Duration of template build phases (queue, base, sandbox, steps, ready, capture, register), including the phase a build failed in.",
			// 10 ms .. ~1.5 h: an import of a large image or a long RUN step.
			Buckets: prometheus.ExponentialBuckets(0.01, 2.5, 14),
		}, []string{"phase"}),
		builds: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "aenv_template_builds_total",
			Help: "Template builds that finished, by result (ready or error).",
		}, []string{"result"}),
		failures: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "aenv_template_build_failures_total",
			Help: "Failed template builds by the step that failed: base, step (one of the build steps) or finalize.",
		}, []string{"step"}),
		running: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "aenv_template_builds_running",
			Help: "Template builds started and not finished (including those waiting for a slot).",
		}),
	}
	var err error
	if m.phase, err = register(reg, m.phase); err != nil {
		return nil, err
	}
	if m.builds, err = register(reg, m.builds); err != nil {
		return nil, err
	}
	if m.failures, err = register(reg, m.failures); err != nil {
		return nil, err
	}
	if m.running, err = register(reg, m.running); err != nil {
		return nil, err
	}
	return m, nil
}

// register registers c, or returns the collector already registered under its name
// (a second builder on the same registry, in tests, shares the first one's series).
func register[T prometheus.Collector](reg prometheus.Registerer, c T) (T, error) {
	err := reg.Register(c)
	if err == nil {
		return c, nil
	}
	var are prometheus.AlreadyRegisteredError
	if errors.As(err, &are) {
		if ex, ok := are.ExistingCollector.(T); ok {
			return ex, nil
		}
	}
	return c, fmt.Errorf("register build metrics: %w", err)
}

// finished counts a build's outcome; step is the failed step ("base", "1".."N",
// "finalize"), numbered steps counted together to bound the label's values.
func (m *metrics) finished(err error, step string) {
	if err == nil {
		m.builds.WithLabelValues(string(StatusReady)).Inc()
		return
	}
	m.builds.WithLabelValues(string(StatusError)).Inc()
	if _, numErr := strconv.Atoi(step); numErr == nil {
		step = "step"
	}
	m.failures.WithLabelValues(step).Inc()
}

// phases times one build's phases: each enter ends the phase before it.
type phases struct {
	m   *metrics
	cur string
	at  time.Time
}

func (p *phases) enter(phase string) {
	p.end()
	p.cur, p.at = phase, time.Now()
}

func (p *phases) end() {
	if p.cur != "" {
		p.m.phase.WithLabelValues(p.cur).Observe(time.Since(p.at).Seconds())
		p.cur = ""
	}
}

type phasesKey struct{}

// enterPhase starts timing phase for the build ctx belongs to (no-op outside a build).
func enterPhase(ctx context.Context, phase string) {
	if p, ok := ctx.Value(phasesKey{}).(*phases); ok {
		p.enter(phase)
	}
}
