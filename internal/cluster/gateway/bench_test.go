package gateway

import (
	"io"
	"net/http"
	"slices"
	"testing"
	"time"
)

// BenchmarkOverhead measures GET /sandboxes/{id} straight to a node endpoint and through
// the gateway (scheduler lookup over gRPC on loopback, route cache, one more HTTP hop),
// reporting both medians; the difference is the gateway's cost per call. The whole-node
// figure comes from test/integration TestClusterNetns.
func BenchmarkOverhead(b *testing.B) {
	f := newFixture(b, "a")
	f.beat(b, "a", "sb")
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 16}}
	get := func(url string) time.Duration {
		req, _ := http.NewRequest(http.MethodGet, url, nil)
		req.Header.Set("X-API-Key", "k1")
		start := time.Now()
		resp, err := client.Do(req)
		if err != nil {
			b.Fatal(err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			b.Fatalf("GET %s: %d", url, resp.StatusCode)
		}
		return time.Since(start)
	}
	var direct, via []time.Duration
	for b.Loop() {
		direct = append(direct, get(f.nodes["a"].srv.URL+"/sandboxes/sb"))
		via = append(via, get(f.gw.URL+"/sandboxes/sb"))
	}
	slices.Sort(direct)
	slices.Sort(via)
	d, v := direct[len(direct)/2], via[len(via)/2]
	b.ReportMetric(float64(d.Microseconds()), "direct-p50-µs")
	b.ReportMetric(float64(v.Microseconds()), "gateway-p50-µs")
	b.ReportMetric(float64((v - d).Microseconds()), "overhead-p50-µs")
}
