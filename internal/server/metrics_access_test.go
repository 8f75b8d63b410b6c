package server

import (
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
)

// TestMetricsTokenAndListener: with a metrics token /metrics asks for it as a bearer
// token; with a listener of its own the API's /metrics answers 404 and MetricsHandler
// (what that listener serves) has the metrics.
func TestMetricsTokenAndListener(t *testing.T) {
	e := newEnv(t, func(o *Options) { o.MetricsToken = "s3cret" })
	for _, tc := range []struct {
		auth string
		want int
	}{{"", 401}, {"Bearer wrong", 401}, {"s3cret", 401}, {"Bearer s3cret", 200}} {
		rec := e.doWith("GET", "/metrics", "", map[string]string{"Authorization": tc.auth})
		if rec.Code != tc.want {
			t.Errorf("Authorization %q: %d, want %d", tc.auth, rec.Code, tc.want)
		}
		if tc.want == 200 && !strings.Contains(rec.Body.String(), "aenv_http_request_duration_seconds") {
			t.Errorf("metrics body: %.200s", rec.Body)
		}
	}

	e = newEnv(t, func(o *Options) { o.MetricsElsewhere = true })
	wantError(t, e.doWith("GET", "/metrics", "", nil), http.StatusNotFound, "metrics_listen")
	rec := httptest.NewRecorder()
	e.srv.MetricsHandler().ServeHTTP(rec, httptest.NewRequest("GET", "/metrics", nil))
	if rec.Code != 200 || !strings.Contains(rec.Body.String(), "aenv_http_request_duration_seconds") {
		t.Errorf("metrics listener: %d %.200s", rec.Code, rec.Body)
	}
}
