package server

import (
	"context"
	"errors"
	"net/http"
	"testing"
)

// recDrainer records the drain calls it gets.
type recDrainer struct {
	calls []bool
	err   error
}

func (d *recDrainer) Drain(_ context.Context, draining bool) (DrainResult, error) {
	d.calls = append(d.calls, draining)
	return DrainResult{Draining: draining, Paused: []string{}}, d.err
}

func TestDrainEndpoints(t *testing.T) {
	lone := newEnv(t)
	wantError(t, lone.do(http.MethodPost, "/aenv/drain", `{"draining":true}`), http.StatusNotFound, "not in a cluster")
	wantError(t, lone.do(http.MethodPost, "/nodes/n1/drain", ""), http.StatusNotFound, "not this node")

	e := newEnv(t)
	d := &recDrainer{}
	e.srv.HandleDrain("n1", d)
	for _, tc := range []struct {
		name, path, body string
		noKey            bool
		status           int
		want             []bool // the drain calls so far
	}{
		{"no key", "/aenv/drain", `{"draining":true}`, true, http.StatusUnauthorized, nil},
		{"no draining field", "/aenv/drain", `{}`, false, http.StatusBadRequest, nil},
		{"not JSON", "/aenv/drain", `drain`, false, http.StatusBadRequest, nil},
		{"drain", "/aenv/drain", `{"draining":true}`, false, http.StatusOK, []bool{true}},
		{"undrain", "/aenv/drain", `{"draining":false}`, false, http.StatusOK, []bool{true, false}},
		{"drain by id", "/nodes/n1/drain", "", false, http.StatusOK, []bool{true, false, true}},
		{"undrain by id", "/nodes/n1/undrain", "", false, http.StatusOK, []bool{true, false, true, false}},
		{"another node", "/nodes/n2/drain", "", false, http.StatusNotFound, []bool{true, false, true, false}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			hdr := map[string]string{"X-API-Key": testKey}
			if tc.noKey {
				hdr = nil
			}
			rec := e.doWith(http.MethodPost, tc.path, tc.body, hdr)
			if rec.Code != tc.status {
				t.Fatalf("status = %d, want %d (%s)", rec.Code, tc.status, rec.Body)
			}
			if tc.status == http.StatusOK {
				if got := decode[DrainResult](t, rec); got.Draining != d.calls[len(d.calls)-1] || got.Paused == nil {
					t.Errorf("answer = %+v", got)
				}
			}
			if len(d.calls) != len(tc.want) {
				t.Fatalf("drain calls = %v, want %v", d.calls, tc.want)
			}
			for i := range tc.want {
				if d.calls[i] != tc.want[i] {
					t.Fatalf("drain calls = %v, want %v", d.calls, tc.want)
				}
			}
		})
	}

	d.err = errors.New("keep the drain across restarts: disk full")
	wantError(t, e.do(http.MethodPost, "/aenv/drain", `{"draining":true}`), http.StatusInternalServerError, "disk full")
}
