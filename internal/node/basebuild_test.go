package node

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/aenv-dev/aenv/internal/sandbox/mock"
)

// While the build runs, base is pending with its latest step; after a failure, with the
// failure; other templates are never pending.
func TestBaseBuildPending(t *testing.T) {
	bs := newBaseBuild(slog.New(slog.NewTextHandler(io.Discard, nil)))
	if err := bs.pending(BaseTemplateID); err != nil {
		t.Fatalf("no build, pending = %v", err)
	}
	stepped, release := make(chan struct{}), make(chan error)
	bs.start(func(ctx context.Context, progress func(string)) error {
		progress("I: Retrieving nodejs 18.19.0")
		close(stepped)
		return <-release
	})
	<-stepped
	err := bs.pending(BaseTemplateID)
	if err == nil || !strings.Contains(err.Error(), "being built") || !strings.Contains(err.Error(), "Retrieving nodejs") ||
		!strings.Contains(err.Error(), MinimalTemplateID) {
		t.Fatalf("running build: pending = %v", err)
	}
	if err := bs.pending("other"); err != nil {
		t.Fatalf("other template pending: %v", err)
	}
	release <- errors.New("debootstrap exploded")
	bs.stop()
	if err := bs.pending(BaseTemplateID); err == nil || !strings.Contains(err.Error(), "could not be built") ||
		!strings.Contains(err.Error(), "debootstrap exploded") {
		t.Fatalf("failed build: pending = %v", err)
	}
}

// Close cancels a running build and waits for it.
func TestBaseBuildStopCancels(t *testing.T) {
	bs := newBaseBuild(slog.New(slog.NewTextHandler(io.Discard, nil)))
	bs.start(func(ctx context.Context, _ func(string)) error {
		<-ctx.Done()
		return ctx.Err()
	})
	done := make(chan struct{})
	go func() { bs.stop(); close(done) }()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("stop did not cancel the build")
	}
	if err := bs.pending(BaseTemplateID); !errors.Is(err, context.Canceled) {
		t.Fatalf("pending = %v", err)
	}
}

// A node that must build base itself and cannot reach the Debian mirror starts anyway;
// a create from base answers 503 saying why, base-minimal works, and nothing of the failed
// build is left in the data dir.
func TestOpenBaseBuildWithoutMirror(t *testing.T) {
	needMinimal(t)
	if _, err := exec.LookPath("debootstrap"); err != nil {
		t.Skip("needs debootstrap")
	}
	// A port nothing listens on: debootstrap's first download is refused.
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	mirror := "http://" + l.Addr().String() + "/debian"
	l.Close()
	cfg := nodeConfig(t)
	cfg.Templates.BaseRootFS = ""
	cfg.Templates.BaseMirror = mirror
	cfg.Backend.Kind = "test-mock"
	backends := Backends{"test-mock": func(context.Context, BackendEnv) (Backend, error) {
		return closingMock{mock.New(mock.Options{}), new(atomic.Int32)}, nil
	}}
	ctx := context.Background()
	n, err := Open(ctx, cfg, Options{Backends: backends, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatal(err)
	}
	defer n.Close(ctx)
	srv := httptest.NewServer(n.Handler)
	defer srv.Close()
	key, err := os.ReadFile(n.APIKey.Path)
	if err != nil {
		t.Fatal(err)
	}
	create := func(tpl string) (int, string) {
		req, _ := http.NewRequest(http.MethodPost, srv.URL+"/sandboxes", strings.NewReader(`{"templateID":"`+tpl+`"}`))
		req.Header.Set("X-API-Key", strings.TrimSpace(string(key)))
		req.Header.Set("Content-Type", "application/json")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	deadline := time.Now().Add(2 * time.Minute)
	for {
		code, body := create(BaseTemplateID)
		if code != http.StatusServiceUnavailable {
			t.Fatalf("create from base while it cannot be built: %d %s", code, body)
		}
		if strings.Contains(body, "could not be built") {
			if !strings.Contains(body, mirror) || !strings.Contains(body, "debootstrap") {
				t.Fatalf("the failure does not say what failed: %s", body)
			}
			break
		}
		if !strings.Contains(body, "being built") || time.Now().After(deadline) {
			t.Fatalf("create from base: %d %s", code, body)
		}
		time.Sleep(200 * time.Millisecond)
	}
	if code, body := create(MinimalTemplateID); code != http.StatusCreated {
		t.Fatalf("create from base-minimal: %d %s", code, body)
	}
	left, _ := filepath.Glob(filepath.Join(cfg.DataDir, "templates", BaseTemplateID, "*"))
	if len(left) != 0 {
		t.Fatalf("the failed build left %v", left)
	}
}
