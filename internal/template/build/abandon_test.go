package build

import (
	"context"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/aenv-dev/aenv/internal/catalog"
	"github.com/aenv-dev/aenv/internal/orchestrator"
	"github.com/aenv-dev/aenv/internal/sandbox/mock"
)

// recordsNode is a build service over the mock backend: enough for build records, which
// never start a sandbox here.
func recordsNode(t *testing.T, data string, cfg Config) *Service {
	t.Helper()
	cat, err := catalog.Open(filepath.Join(t.TempDir(), "aenv.db"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cat.Close() })
	orch, err := orchestrator.New(orchestrator.Config{Registerer: prometheus.NewRegistry()}, mock.New(mock.Options{}), cat)
	if err != nil {
		t.Fatal(err)
	}
	if err := orch.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		orch.Shutdown(ctx)
	})
	cfg.DataDir = data
	svc, err := New(cfg, orch, cat.Templates())
	if err != nil {
		t.Fatal(err)
	}
	return svc
}

// TestAbandonedBuildsEndInError: a build requested but never started does not stay
// waiting forever — a node restart ends it, and so does its start timeout.
func TestAbandonedBuildsEndInError(t *testing.T) {
	data := t.TempDir()
	svc := recordsNode(t, data, Config{})
	rec, err := svc.Request(context.Background(), RequestOptions{Name: "left"})
	if err != nil {
		t.Fatal(err)
	}
	if got, _ := svc.Get(rec.TemplateID, rec.ID); got.Status != StatusWaiting {
		t.Fatalf("status before the restart: %s", got.Status)
	}
	svc.Close()

	svc = recordsNode(t, data, Config{})
	got, err := svc.Get(rec.TemplateID, rec.ID)
	if err != nil || got.Status != StatusError || got.Reason == nil || !strings.Contains(got.Reason.Message, "before the build was started") {
		t.Fatalf("after a restart: %+v %v", got, err)
	}
	logs := svc.Logs(rec.ID, 0, 0)
	if last := logs[len(logs)-1]; last.Level != "error" || !strings.Contains(last.Message, "before the build was started") {
		t.Errorf("last log line %+v", last)
	}
	svc.Close()

	svc = recordsNode(t, t.TempDir(), Config{StartTimeout: 20 * time.Millisecond})
	defer svc.Close()
	rec, err = svc.Request(context.Background(), RequestOptions{Name: "slow"})
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(50 * time.Millisecond)
	if b := svc.Builds(rec.TemplateID); len(b) != 1 || b[0].Status != StatusError || !strings.Contains(b[0].Reason.Message, "not started within 20ms") {
		t.Fatalf("builds after the start timeout: %+v", b)
	}
	if err := svc.Start(context.Background(), rec.TemplateID, rec.ID, Spec{FromTemplate: "base"}); err == nil {
		t.Error("an expired build started")
	}
}
