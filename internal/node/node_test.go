package node

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/aenv-dev/aenv/internal/config"
	"github.com/aenv-dev/aenv/internal/sandbox/mock"
	"github.com/aenv-dev/aenv/internal/template/base"
)

// closingMock is the mock backend as a node Backend; it counts Close calls.
type closingMock struct {
	*mock.Backend
	closed *atomic.Int32
}

func (b closingMock) Close(context.Context) error { b.closed.Add(1); return nil }

// nodeConfig is a node config in a fresh data dir with a prebuilt base rootfs, an
// executable envd and the directory base (no mkfs).
func nodeConfig(t *testing.T) config.Config {
	t.Helper()
	src := t.TempDir()
	os.MkdirAll(filepath.Join(src, "home", "user"), 0o755)
	os.WriteFile(filepath.Join(src, base.StampFile), []byte(base.DebianVersion+"\n"), 0o644)
	envd := filepath.Join(t.TempDir(), "envd")
	os.WriteFile(envd, []byte("#!/bin/sh\n"), 0o755)
	cfg := config.Default()
	cfg.DataDir = filepath.Join(t.TempDir(), "data")
	cfg.Templates.BaseRootFS = src
	cfg.Templates.LayeredBase = false
	cfg.Envd.Path = envd
	// The data plane is this binary's `aenv dataplane`, which a test binary is not (the
	// integration tests run it).
	cfg.Backend.DataPlane = false
	return cfg
}

// A kind added to the registry is what the node runs: the factory gets the node's
// environment, the API serves sandboxes on that backend, and Close releases it last.
func TestOpenRegisteredKind(t *testing.T) {
	cfg := nodeConfig(t)
	cfg.Backend.Kind = "test-mock"
	var env BackendEnv
	var closed atomic.Int32
	backends := DefaultBackends()
	backends["test-mock"] = func(_ context.Context, e BackendEnv) (Backend, error) {
		env = e
		return closingMock{mock.New(mock.Options{}), &closed}, nil
	}
	ctx := context.Background()
	n, err := Open(ctx, cfg, Options{Backends: backends, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	if env.DataDir != filepath.Join(cfg.DataDir, "test-mock") || env.EnvdPath != cfg.Envd.Path || env.Layers == nil ||
		env.Registerer == nil || env.Logger == nil {
		t.Errorf("factory environment = %+v", env)
	}
	if n.Orchestrator.BackendName() != "mock" {
		t.Errorf("orchestrator runs on %q", n.Orchestrator.BackendName())
	}
	srv := httptest.NewServer(n.Handler)
	defer srv.Close()
	key, err := os.ReadFile(n.APIKey.Path)
	if err != nil {
		t.Fatal(err)
	}
	req, _ := http.NewRequest(http.MethodPost, srv.URL+"/sandboxes", strings.NewReader(`{"templateID":"base"}`))
	req.Header.Set("X-API-Key", strings.TrimSpace(string(key)))
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusCreated {
		t.Fatalf("create: %d %s", resp.StatusCode, body)
	}
	n.Close(ctx)
	n.Close(ctx)
	if closed.Load() != 1 {
		t.Fatalf("backend closed %d times, want 1", closed.Load())
	}
}

// An unknown kind fails before anything is made, naming the kinds there are.
func TestOpenUnknownKind(t *testing.T) {
	cfg := nodeConfig(t)
	cfg.Backend.Kind = "firecracker"
	_, err := Open(context.Background(), cfg, Options{Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err == nil || !strings.Contains(err.Error(), `"firecracker"`) || !strings.Contains(err.Error(), "oci") {
		t.Fatalf("err = %v", err)
	}
	if _, err := os.Stat(cfg.DataDir); !os.IsNotExist(err) {
		t.Fatalf("data dir made for a node that cannot start: %v", err)
	}
}

// A factory's failure closes what Open had made: the catalog lock is free again.
func TestOpenBackendFailureUnwinds(t *testing.T) {
	cfg := nodeConfig(t)
	cfg.Backend.Kind = "broken"
	backends := Backends{"broken": func(context.Context, BackendEnv) (Backend, error) {
		return nil, io.ErrUnexpectedEOF
	}}
	opts := Options{Backends: backends, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))}
	for range 2 {
		if _, err := Open(context.Background(), cfg, opts); !errors.Is(err, io.ErrUnexpectedEOF) {
			t.Fatalf("err = %v, want the factory's error (not a held catalog lock)", err)
		}
	}
}

// A bad network.egress_upstream_ca fails the start before anything is made: no data
// dir, no catalog, no data plane (found once only after the data plane had started).
func TestOpenBadEgressUpstreamCAChangesNothing(t *testing.T) {
	notPEM := filepath.Join(t.TempDir(), "ca.pem")
	if err := os.WriteFile(notPEM, []byte("not a certificate\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	tests := []struct{ name, file, want string }{
		{"missing", filepath.Join(t.TempDir(), "none.pem"), "no such file"},
		{"no certificate", notPEM, "holds no PEM certificate"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cfg := nodeConfig(t)
			cfg.Network.EgressUpstreamCA = tt.file
			_, err := Open(context.Background(), cfg, Options{Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
			if err == nil || !strings.Contains(err.Error(), "network.egress_upstream_ca") || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("err = %v, want network.egress_upstream_ca: …%s", err, tt.want)
			}
			if _, err := os.Stat(cfg.DataDir); !os.IsNotExist(err) {
				t.Fatalf("data dir made for a node that cannot start: %v", err)
			}
		})
	}
}
