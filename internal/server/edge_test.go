package server

import (
	"net/http"
	"testing"
)

// Requests the API cannot honour are refused with a clear status, never served as if valid.
func TestMalformedQueryAndUnknownMethod(t *testing.T) {
	e := newEnv(t)
	for _, tc := range []struct {
		method, path string
		status       int
	}{
		// A query the parser cannot decode used to be dropped: the filter was ignored.
		{"GET", "/v2/sandboxes?metadata=%zz", http.StatusBadRequest},
		{"GET", "/sandboxes?metadata=a%3Db%26%zz", http.StatusBadRequest},
		{"GET", "/v2/sandboxes?metadata=nokey", http.StatusBadRequest},
		// A known path with a method it does not serve.
		{"PATCH", "/v2/sandboxes", http.StatusMethodNotAllowed},
		{"PUT", "/sandboxes/sbx1", http.StatusMethodNotAllowed},
		{"DELETE", "/v2/sandboxes", http.StatusMethodNotAllowed},
		// An unknown path stays 404.
		{"GET", "/nope", http.StatusNotFound},
	} {
		rec := e.do(tc.method, tc.path, "")
		if rec.Code != tc.status {
			t.Errorf("%s %s: %d %s, want %d", tc.method, tc.path, rec.Code, rec.Body, tc.status)
		}
	}
}
