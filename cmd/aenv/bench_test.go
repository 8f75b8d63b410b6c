package main

import (
	"bytes"
	"context"
	"strings"
	"testing"
)

// TestBenchFlags: bad flags are refused with a clear error before any node is contacted
// (the URL points at a closed port, so reaching it would fail differently).
func TestBenchFlags(t *testing.T) {
	tests := []struct {
		args    []string
		wantErr string
	}{
		{[]string{"bench", "create", "-o", "yaml"}, `-o "yaml": want table or json`},
		{[]string{"bench", "create", "--concurrency", "0", "-o", "json"}, "--concurrency [0]: want positive values"},
		{[]string{"bench", "create", "--repeat", "0", "-o", "json"}, "--repeat 0: want at least 1"},
		{[]string{"bench", "create", "--concurrency", "x"}, `invalid argument "x"`},
		{[]string{"bench", "density", "-o", "xml"}, `-o "xml": want table or json`},
		{[]string{"bench", "density", "--count", "0", "-o", "json"}, "count must be positive"},
		{[]string{"bench", "fork", "-o", "yaml"}, `-o "yaml": want table or json`},
		{[]string{"bench", "fork", "-n", "0", "-o", "json"}, "count (0) and runs (5) must be positive"},
		{[]string{"bench", "fork", "--runs", "0", "-o", "json"}, "count (16) and runs (0) must be positive"},
		{[]string{"bench", "fork", "--warmup", "-1", "-o", "json"}, "warmup (-1) not negative"},
		{[]string{"bench", "pause", "-o", "csv"}, `-o "csv": want table or json`},
		{[]string{"bench", "pause", "-n", "0", "-o", "json"}, "n (0) must be positive"},
		{[]string{"bench", "pause", "-n", "x"}, `invalid argument "x"`},
		{[]string{"bench", "snapshot", "-o", "csv"}, `-o "csv": want table or json`},
		{[]string{"bench", "snapshot", "-n", "0", "-o", "json"}, "n (0) must be positive"},
		{[]string{"bench", "snapshot", "--warmup", "-2", "-o", "json"}, "warmup (-2) not negative"},
		{[]string{"bench", "fork", "--pss", "--settle", "x"}, `invalid argument "x"`},
	}
	for _, tt := range tests {
		t.Run(strings.Join(tt.args, " "), func(t *testing.T) {
			root := newRootCmd()
			var out bytes.Buffer
			root.SetOut(&out)
			root.SetErr(&out)
			root.SetArgs(append(tt.args, "--url", "http://127.0.0.1:1", "--api-key", testKey))
			err := root.ExecuteContext(context.Background())
			if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
				t.Fatalf("err = %v, want one containing %q", err, tt.wantErr)
			}
		})
	}
}
