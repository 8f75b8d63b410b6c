package orchestrator

import (
	"context"
	"errors"
	"testing"

	"github.com/aenv-dev/aenv/internal/sandbox"
)

// stopRecorder is an instance that records which stop a pause to disk used.
type stopRecorder struct {
	sandbox.Instance
	calls []string
	err   error
}

func (s *stopRecorder) Stop(context.Context) error {
	s.calls = append(s.calls, "Stop")
	return s.err
}

// capturedStopRecorder also offers the stop after a capture.
type capturedStopRecorder struct{ stopRecorder }

func (s *capturedStopRecorder) StopAfterCapture(context.Context) error {
	s.calls = append(s.calls, "StopAfterCapture")
	return s.err
}

func TestStopCaptured(t *testing.T) {
	boom := errors.New("boom")
	tests := []struct {
		name     string
		captured bool // the instance offers StopAfterCapture
		err      error
		want     string
	}{
		{"plain instance stops", false, nil, "Stop"},
		{"plain instance error", false, boom, "Stop"},
		{"captured stopper preferred", true, nil, "StopAfterCapture"},
		{"captured stopper error", true, boom, "StopAfterCapture"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			rec := &stopRecorder{err: tt.err}
			var inst sandbox.Instance = rec
			if tt.captured {
				c := &capturedStopRecorder{stopRecorder{err: tt.err}}
				rec, inst = &c.stopRecorder, c
			}
			if err := stopCaptured(context.Background(), inst); err != tt.err {
				t.Fatalf("stopCaptured = %v, want %v", err, tt.err)
			}
			if len(rec.calls) != 1 || rec.calls[0] != tt.want {
				t.Fatalf("calls %v, want [%s]", rec.calls, tt.want)
			}
		})
	}
}
