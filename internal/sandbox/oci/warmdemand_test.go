package oci

import (
	"testing"
	"time"
)

func TestDemandSize(t *testing.T) {
	t0 := time.Date(2026, 12, 3, 9, 0, 0, 0, time.UTC)
	at := func(d time.Duration) time.Time { return t0.Add(d) }
	burst := func(start time.Duration, n int, gap time.Duration) []time.Time {
		var ts []time.Time
		for i := range n {
			ts = append(ts, at(start+time.Duration(i)*gap))
		}
		return ts
	}
	cat := func(parts ...[]time.Time) []time.Time {
		var out []time.Time
		for _, p := range parts {
			out = append(out, p...)
		}
		return out
	}
	tests := []struct {
		name     string
		launches []time.Time
		now      time.Time
		lo, hi   int
		want     int
	}{
		{"no launch", nil, at(0), 2, 16, 2},
		{"one launch", burst(0, 1, 0), at(time.Second), 2, 16, 2},
		{"burst of 10", burst(0, 10, 10*time.Millisecond), at(time.Second), 2, 16, 10},
		{"burst above the cap", burst(0, 40, 10*time.Millisecond), at(time.Second), 2, 16, 16},
		{"sequential, 1 s apart", burst(0, 30, time.Second), at(31 * time.Second), 2, 16, 3},
		{"burst held 9 min later", burst(0, 10, 0), at(9 * time.Minute), 2, 16, 10},
		{"burst forgotten after burstHold", burst(0, 10, 0), at(burstHold + time.Second), 2, 16, 2},
		{"smaller burst later keeps the peak", cat(burst(0, 10, 0), burst(5*time.Minute, 4, 0)), at(6 * time.Minute), 2, 16, 10},
		{"peak renewed by an equal burst", cat(burst(0, 10, 0), burst(8*time.Minute, 10, 0)), at(16 * time.Minute), 2, 16, 10},
		{"old peak replaced by a new smaller one", cat(burst(0, 10, 0), burst(11*time.Minute, 4, 0)), at(12 * time.Minute), 2, 16, 4},
		{"launches spread over more than the window", burst(0, 6, 1500*time.Millisecond), at(10 * time.Second), 1, 16, 2},
		{"lo above the burst", burst(0, 3, 0), at(time.Second), 5, 16, 5},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var d demand
			for _, ts := range tt.launches {
				d.launched(ts)
			}
			if got := d.size(tt.now, tt.lo, tt.hi); got != tt.want {
				t.Fatalf("size = %d, want %d (peak %d at %v)", got, tt.want, d.peak, d.peakAt.Sub(t0))
			}
		})
	}
}
