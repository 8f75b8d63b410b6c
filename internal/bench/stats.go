// Package bench measures a running aenv node from the outside, the way users reach it: the
// REST API for the lifecycle and envd's Connect API through the node's proxy for commands.
// It reports latency percentiles (create → first command completed, sequential and
// concurrent) and the density ceiling (how many idle sandboxes fit, and what each costs in
// host memory). Figures come from the real node; nothing here is simulated.
package bench

import (
	"math"
	"slices"
	"time"
)

// Summary describes a latency distribution. Percentiles use the nearest-rank method, so
// every reported value is one that was observed.
type Summary struct {
	N    int           `json:"n"`
	Min  time.Duration `json:"min"`
	P50  time.Duration `json:"p50"`
	P95  time.Duration `json:"p95"`
	P99  time.Duration `json:"p99"`
	Max  time.Duration `json:"max"`
	Mean time.Duration `json:"mean"`
}

// Summarize computes the summary of samples (which it does not modify). An empty input
// gives the zero Summary.
func Summarize(samples []time.Duration) Summary {
	if len(samples) == 0 {
		return Summary{}
	}
	s := slices.Clone(samples)
	slices.Sort(s)
	var sum time.Duration
	for _, d := range s {
		sum += d
	}
	return Summary{
		N:    len(s),
		Min:  s[0],
		P50:  Percentile(s, 50),
		P95:  Percentile(s, 95),
		P99:  Percentile(s, 99),
		Max:  s[len(s)-1],
		Mean: sum / time.Duration(len(s)),
	}
}

// Percentile returns the nearest-rank p-th percentile (0 < p <= 100) of sorted samples:
// the smallest sample with at least p% of the samples at or below it.
func Percentile(sorted []time.Duration, p float64) time.Duration {
	if len(sorted) == 0 {
		return 0
	}
	rank := int(math.Ceil(p / 100 * float64(len(sorted))))
	rank = min(max(rank, 1), len(sorted))
	return sorted[rank-1]
}

// Median returns the median of values, the lower middle one for an even count; used to
// combine repeated runs.
func Median(values []time.Duration) time.Duration {
	if len(values) == 0 {
		return 0
	}
	s := slices.Clone(values)
	slices.Sort(s)
	return s[(len(s)-1)/2]
}
