package dataplane

import (
	"runtime"
	"runtime/debug"
	"testing"

	"github.com/aenv-dev/aenv/internal/storage/blockdev"
)

// TestTuneRuntime: the data plane sets GOGC and GOMAXPROCS only where its environment
// leaves them unset (an operator's setting wins), and raises Go's cap on threads.
func TestTuneRuntime(t *testing.T) {
	defer debug.SetGCPercent(debug.SetGCPercent(100))
	defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(1))
	defer debug.SetMaxThreads(debug.SetMaxThreads(10000))
	for _, c := range []struct {
		name           string
		env            map[string]string
		wantGC, wantPs int
	}{
		{"unset", nil, dataPlaneGCPercent, blockdev.ServingProcs()},
		{"GOGC set", map[string]string{"GOGC": "100"}, 100, blockdev.ServingProcs()},
		{"GOMAXPROCS set", map[string]string{"GOMAXPROCS": "1"}, dataPlaneGCPercent, 1},
	} {
		t.Run(c.name, func(t *testing.T) {
			debug.SetGCPercent(100)
			runtime.GOMAXPROCS(1)
			tuneRuntime(func(k string) string { return c.env[k] })
			if gc := debug.SetGCPercent(100); gc != c.wantGC {
				t.Errorf("GOGC %d, want %d", gc, c.wantGC)
			}
			if ps := runtime.GOMAXPROCS(0); ps != c.wantPs {
				t.Errorf("GOMAXPROCS %d, want %d", ps, c.wantPs)
			}
			// Room for the waiting readers of 5 000 disks and more.
			if mt := debug.SetMaxThreads(10000); mt < 5000*blockdev.IdleReaders*4 {
				t.Errorf("max threads %d, want room for 5 000 disks' readers", mt)
			}
		})
	}
}
