package envd

import (
	"math"
	"net/http"
	"net/http/httptest"
	"runtime/debug"
	"runtime/metrics"
	"sync/atomic"
	"testing"
	"time"
)

// TestIdleTrimmer checks when the trimmer trims and that it holds no timer between bursts
// (an idle envd must not wake).
func TestIdleTrimmer(t *testing.T) {
	const interval = 30 * time.Millisecond
	for _, tc := range []struct {
		name      string
		minGrowth int64
		growth    int64         // heap growth the burst leaves
		burst     time.Duration // requests every interval/3 for this long
		trims     int32
	}{
		{"no request: no trim", 0, 0, -1, 0},
		{"one request", 0, 0, 0, 1},
		{"a burst longer than the interval trims once, after it", 0, 0, 5 * interval, 1},
		{"less garbage than the minimum", 1 << 20, 1 << 10, 0, 0},
		{"more garbage than the minimum", 1 << 20, 2 << 20, interval, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var requests atomic.Int64
			var trims atomic.Int32
			var heap atomic.Int64
			tr := newIdleTrimmer(interval, tc.minGrowth, &requests)
			tr.trim = func() { trims.Add(1); heap.Store(0) }
			tr.heap, tr.base = heap.Load, 0
			defer tr.stop()
			request := func() { requests.Add(1); tr.poke() }
			if tc.burst >= 0 {
				heap.Store(tc.growth)
				request()
				for end := time.Now().Add(tc.burst); time.Now().Before(end); {
					time.Sleep(interval / 3)
					request()
				}
				if trims.Load() != 0 {
					t.Fatal("trimmed during the burst")
				}
			}
			time.Sleep(4 * interval)
			if got := trims.Load(); got != tc.trims {
				t.Fatalf("%d trims, want %d", got, tc.trims)
			}
			if tr.armed.Load() {
				t.Fatal("a timer is still set after the burst: an idle envd would wake")
			}
			// The next burst sets the timer again.
			heap.Store(tc.minGrowth)
			request()
			time.Sleep(4 * interval)
			if got := trims.Load(); got != tc.trims+1 {
				t.Fatalf("after a second burst: %d trims, want %d", got, tc.trims+1)
			}
		})
	}
}

// TestIdleTrimmerStop checks that a stopped trimmer neither trims nor sets a timer.
func TestIdleTrimmerStop(t *testing.T) {
	var requests atomic.Int64
	var trims atomic.Int32
	tr := newIdleTrimmer(10*time.Millisecond, 0, &requests)
	tr.trim = func() { trims.Add(1) }
	requests.Add(1)
	tr.poke()
	tr.stop()
	requests.Add(1)
	tr.poke()
	time.Sleep(50 * time.Millisecond)
	if n := trims.Load(); n != 0 {
		t.Fatalf("%d trims after stop, want 0", n)
	}
}

// restoreGC puts Go's default collector back after a test that changed it.
func restoreGC(t *testing.T) {
	t.Cleanup(func() {
		debug.SetGCPercent(100)
		debug.SetMemoryLimit(math.MaxInt64)
	})
}

func gcCycles() uint64 {
	s := []metrics.Sample{{Name: "/gc/cycles/total:gc-cycles"}}
	metrics.Read(s)
	return s[0].Value.Uint64()
}

var sink []byte

func TestTrimWhenIdleMinGrowth(t *testing.T) {
	restoreGC(t)
	debug.SetGCPercent(-1) // only TrimWhenIdle collects
	for _, tc := range []struct {
		name      string
		minGrowth int64
		garbage   int
		trims     bool
	}{
		{"every burst", 0, 0, true},
		{"less garbage than the minimum", 64 << 20, 1 << 20, false},
		{"more garbage than the minimum", 1 << 20, 4 << 20, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := New(Config{})
			t.Cleanup(s.Close)
			stop := s.TrimWhenIdle(20*time.Millisecond, tc.minGrowth)
			for i := 0; i < tc.garbage/4096; i++ {
				sink = make([]byte, 4096)
			}
			sink = nil
			before := gcCycles()
			s.ServeHTTP(httptest.NewRecorder(), httptest.NewRequest(http.MethodGet, "/health", nil)) // a burst...
			time.Sleep(200 * time.Millisecond)                                                       // ...then quiet for several intervals
			stop()
			if trimmed := gcCycles() > before; trimmed != tc.trims {
				t.Fatalf("trimmed %v, want %v", trimmed, tc.trims)
			}
		})
	}
}
