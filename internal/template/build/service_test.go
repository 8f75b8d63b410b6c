package build

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/aenv-dev/aenv/internal/catalog"
	"github.com/aenv-dev/aenv/internal/network"
	"github.com/aenv-dev/aenv/internal/orchestrator"
	"github.com/aenv-dev/aenv/internal/sandbox/oci"
	"github.com/aenv-dev/aenv/internal/template/base"
	"github.com/aenv-dev/aenv/internal/template/layered"
)

// realNode is a node with the OCI backend (runc), the real envd and the base template.
type realNode struct {
	cat  *catalog.Catalog
	orch *orchestrator.Orchestrator
	svc  *Service
	data string
}

var (
	envdOnce sync.Once
	envdPath string
	envdErr  error
)

func buildEnvd(t testing.TB) string {
	t.Helper()
	envdOnce.Do(func() {
		_, file, _, _ := runtime.Caller(0)
		repo := filepath.Join(filepath.Dir(file), "..", "..", "..")
		envdPath = filepath.Join(os.TempDir(), fmt.Sprintf("aenv-build-envd-%d", os.Getpid()))
		cmd := exec.Command("go", "build", "-o", envdPath, "./cmd/envd")
		cmd.Dir = repo
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
		if out, err := cmd.CombinedOutput(); err != nil {
			envdErr = fmt.Errorf("build envd: %w: %s", err, out)
		}
	})
	if envdErr != nil {
		t.Fatal(envdErr)
	}
	return envdPath
}

func TestMain(m *testing.M) {
	code := m.Run()
	if envdPath != "" {
		os.Remove(envdPath)
	}
	os.Exit(code)
}

func newRealNode(t testing.TB, cfg Config) *realNode {
	t.Helper()
	return newNode(t, cfg, false)
}

// newNode makes a real node; with layeredBase its base template is also a sealed layer
// (as `aenv serve` makes it), so its sandboxes and builds run on layered roots.
func newNode(t testing.TB, cfg Config, layeredBase bool) *realNode {
	t.Helper()
	return newNodeAt(t, cfg, layeredBase, 0)
}

// newNodeAt makes node number net (0 or 1) of a test: each has a network and cgroup
// parent of its own, so two can run side by side.
func newNodeAt(t testing.TB, cfg Config, layeredBase bool, net int) *realNode {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root (runc, netns, overlayfs)")
	}
	if _, err := exec.LookPath("runc"); err != nil {
		t.Skip("needs runc (Debian package runc)")
	}
	for _, p := range []string{"/bin/busybox", "/bin/bash-static"} {
		if _, err := os.Stat(p); err != nil {
			t.Skipf("needs %s (busybox-static, bash-static)", p)
		}
	}
	ctx := context.Background()
	data := t.TempDir()
	os.Chmod(data, 0o711)
	baseDir := filepath.Join(data, "templates", "base", "rootfs")
	if err := base.Build(ctx, base.Options{Out: baseDir}); err != nil {
		t.Fatal(err)
	}
	cat, err := catalog.Open(filepath.Join(data, "aenv.db"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cat.Close() })
	var art json.RawMessage
	if layeredBase {
		if _, err := exec.LookPath("mkfs.ext4"); err != nil {
			t.Skip("needs mkfs.ext4 (e2fsprogs) for the layered base")
		}
		res, err := layered.Build(ctx, baseDir, filepath.Join(data, "templates", "base", "layered"), 512)
		if err != nil {
			t.Fatal(err)
		}
		art = res.Artifact
	}
	if err := cat.Templates().Put(catalog.Template{ID: "base", Kind: catalog.KindTemplate, RootFSDir: baseDir,
		DefaultUser: "user", DefaultWorkdir: "/home/user", Artifact: art}); err != nil {
		t.Fatal(err)
	}
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	be, err := oci.New(ctx, oci.Config{DataDir: filepath.Join(data, "oci"), EnvdPath: buildEnvd(t), Runtime: "runc",
		CgroupParent: fmt.Sprintf("aenv-bldtest%d", net), Logger: log,
		Network: network.Config{Bridge: fmt.Sprintf("aenvbldt%d", net), Subnet: fmt.Sprintf("10.89.%d.0/24", 40+net),
			Prefix: fmt.Sprintf("aenvb%d", net), PoolSize: 1}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		be.Close(context.Background())
		// The test's bridge, nft tables and cgroup parent are its own: leave nothing behind.
		if err := be.Pool().Teardown(context.Background()); err != nil {
			t.Errorf("tear down the test network: %v", err)
		}
		dirs, _ := filepath.Glob(fmt.Sprintf("/sys/fs/cgroup/*/aenv-bldtest%d", net))
		for _, d := range dirs {
			os.Remove(d)
		}
	})
	orch, err := orchestrator.New(orchestrator.Config{Registerer: prometheus.NewRegistry(), Logger: log}, be, cat)
	if err != nil {
		t.Fatal(err)
	}
	if err := orch.Start(ctx); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		sctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		orch.Shutdown(sctx)
	})
	cfg.DataDir, cfg.Logger = data, log
	if rp, ok := cfg.Publisher.(*recordingPublisher); ok {
		rp.tpls = cat.Templates()
	}
	svc, err := New(cfg, orch, cat.Templates())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(svc.Close)
	return &realNode{cat: cat, orch: orch, svc: svc, data: data}
}

// build requests and starts a build and waits for it to finish.
func (n *realNode) build(t testing.TB, name string, spec Spec) Record {
	t.Helper()
	rec, err := n.svc.Request(context.Background(), RequestOptions{Name: name})
	if err != nil {
		t.Fatal(err)
	}
	if err := n.svc.Start(context.Background(), rec.TemplateID, rec.ID, spec); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(3 * time.Minute)
	for time.Now().Before(deadline) {
		r, err := n.svc.Get(rec.TemplateID, rec.ID)
		if err != nil {
			t.Fatal(err)
		}
		if r.Status.Finished() {
			return r
		}
		time.Sleep(100 * time.Millisecond)
	}
	t.Fatal("build did not finish within 3 minutes")
	return Record{}
}

func (n *realNode) logText(id string) string {
	var b strings.Builder
	for _, e := range n.svc.Logs(id, 0, 0) {
		b.WriteString(e.Level + " " + e.Message + "\n")
	}
	return b.String()
}

// noSandboxes checks that builds leave no sandbox behind.
func (n *realNode) noSandboxes(t *testing.T) {
	t.Helper()
	items, _, err := n.orch.List(context.Background(), orchestrator.ListFilter{})
	if err != nil || len(items) != 0 {
		t.Errorf("sandboxes left after builds: %d (%v)", len(items), err)
	}
}

func TestBuildInRealSandbox(t *testing.T) {
	pub := &recordingPublisher{}
	n := newRealNode(t, Config{ReadyTimeout: 20 * time.Second, Publisher: pub})
	upload := makeTar(t, true,
		tarEntry{name: "hello.txt", body: "hello from the context\n"},
		tarEntry{name: "dir/", typ: 0x35, mode: 0o755},
		tarEntry{name: "dir/run.sh", body: "#!/bin/sh\necho run\n", mode: 0o755},
	)
	if err := n.svc.PutFile("h1", strings.NewReader(string(upload))); err != nil {
		t.Fatal(err)
	}
	spec := Spec{FromTemplate: "base", Steps: []Step{
		{Type: StepRun, Args: []string{"echo building as $(whoami) in $(pwd)"}},
		{Type: StepEnv, Args: []string{"GREETING", "hi there", "N", "1"}},
		{Type: StepWorkdir, Args: []string{"/app"}},
		{Type: StepRun, Args: []string{`echo "$GREETING" > greeting.txt && whoami > who.txt`}},
		{Type: StepCopy, Args: []string{"hello.txt", "/app/"}, FilesHash: "h1"},
		{Type: StepCopy, Args: []string{"dir", "/opt/tools", "root", "0750"}, FilesHash: "h1"},
		{Type: StepRun, Args: []string{"touch /etc/as-root", "root"}},
	}, StartCmd: "echo started > /app/started; exec sleep 600", ReadyCmd: "test -f /app/started"}
	rec := n.build(t, "built-one", spec)
	if rec.Status != StatusReady {
		t.Fatalf("build %s: %+v\n%s", rec.Status, rec.Reason, n.logText(rec.ID))
	}
	logs := n.logText(rec.ID)
	for _, want := range []string{"building as user in /home/user", "[4/7] RUN", "copied 1 entries to /app", "ready"} {
		if !strings.Contains(logs, want) {
			t.Errorf("log lacks %q:\n%s", want, logs)
		}
	}
	if got, inCat := pub.calls(); len(got) != 1 || got[0].ID != rec.TemplateID || !inCat[0] {
		t.Errorf("published %+v (in the catalog then: %v), want template %s once, after it was registered", got, inCat, rec.TemplateID)
	}
	tpl, err := n.cat.Templates().Resolve("built-one")
	if err != nil {
		t.Fatal(err)
	}
	if tpl.ID != rec.TemplateID || tpl.DefaultUser != "user" || tpl.DefaultWorkdir != "/app" ||
		tpl.EnvVars["GREETING"] != "hi there" || tpl.StartCmd != spec.StartCmd {
		t.Errorf("template = %+v", tpl)
	}
	root := tpl.RootFSDir
	for path, want := range map[string]string{
		"app/greeting.txt": "hi there\n", "app/who.txt": "user\n", "app/hello.txt": "hello from the context\n",
		"app/started": "started\n", "opt/tools/run.sh": "#!/bin/sh\necho run\n",
	} {
		if b, err := os.ReadFile(filepath.Join(root, path)); err != nil || string(b) != want {
			t.Errorf("%s = %q, %v; want %q", path, b, err, want)
		}
	}
	for path, want := range map[string]struct {
		uid  uint32
		mode os.FileMode
	}{"app/hello.txt": {1000, 0o644}, "opt/tools/run.sh": {0, 0o750}, "app": {1000, 0o755 | os.ModeDir}, "etc/as-root": {0, 0o644}} {
		fi, err := os.Lstat(filepath.Join(root, path))
		if err != nil {
			t.Errorf("%s: %v", path, err)
			continue
		}
		if uid := statUID(fi); uid != want.uid || fi.Mode() != want.mode {
			t.Errorf("%s: uid %d mode %v, want %d %v", path, uid, fi.Mode(), want.uid, want.mode)
		}
	}
	if fi, err := os.Stat(filepath.Join(root, "proc")); err != nil || !fi.IsDir() {
		t.Errorf("mount point /proc missing: %v", err)
	}
	if ents, _ := os.ReadDir(filepath.Join(root, "proc")); len(ents) != 0 {
		t.Errorf("/proc content captured: %d entries", len(ents))
	}
	n.noSandboxes(t)

	// A sandbox from the new template sees the build's files, user, workdir and env.
	sb, err := n.orch.Create(context.Background(), orchestrator.CreateRequest{TemplateID: "built-one", Secure: true})
	if err != nil {
		t.Fatal(err)
	}
	defer n.orch.Kill(context.Background(), sb.ID)
	ep, _, err := n.orch.Endpoint(context.Background(), sb.ID, false)
	if err != nil {
		t.Fatal(err)
	}
	sess := NewSession(sb.ID, fmt.Sprintf("http://%s", joinHostPort(ep.Host, 49983)), sb.EnvdAccessToken, http.DefaultClient)
	var out strings.Builder
	if err := sess.Run(context.Background(), Command{Script: `echo "$(whoami) $(pwd) $GREETING $(cat hello.txt)"`, Stdout: &out}); err != nil {
		t.Fatal(err)
	}
	if got := strings.TrimSpace(out.String()); got != "user /app hi there hello from the context" {
		t.Errorf("sandbox from the template: %q", got)
	}

	// Rebuilds replace the template's files, but keep the ones a sandbox still runs on.
	builds := func() int {
		ents, _ := os.ReadDir(filepath.Join(n.data, "templates", rec.TemplateID, "builds"))
		return len(ents)
	}
	small := Spec{FromTemplate: "base", Steps: []Step{{Type: StepRun, Args: []string{"true"}}}}
	if r := n.build(t, "built-one", small); r.Status != StatusReady || r.TemplateID != rec.TemplateID {
		t.Fatalf("rebuild: %+v", r)
	}
	if got := builds(); got != 2 {
		t.Errorf("after a rebuild with a sandbox on the old build: %d build dirs, want 2", got)
	}
	if err := n.orch.Kill(context.Background(), sb.ID); err != nil {
		t.Fatal(err)
	}
	if r := n.build(t, "built-one", small); r.Status != StatusReady {
		t.Fatalf("rebuild: %+v", r)
	}
	if got := builds(); got != 1 {
		t.Errorf("after a rebuild with no sandbox on old builds: %d build dirs, want 1", got)
	}
	if _, err := n.svc.Delete(context.Background(), "built-one"); err != nil {
		t.Fatal(err)
	}
	if got := pub.deletes(); !slices.Equal(got, []string{rec.TemplateID}) {
		t.Errorf("deleted from the repository: %q, want %s", got, rec.TemplateID)
	}
}

func TestBuildFailures(t *testing.T) {
	n := newRealNode(t, Config{ReadyTimeout: 2 * time.Second})
	tests := []struct {
		name     string
		spec     Spec
		step     string
		contains string
	}{
		{"failing RUN", Spec{FromTemplate: "base", Steps: []Step{
			{Type: StepRun, Args: []string{"true"}}, {Type: StepRun, Args: []string{"echo oops >&2; exit 3"}},
		}}, "2", "exit code 3"},
		{"unknown user", Spec{FromTemplate: "base", Steps: []Step{{Type: StepUser, Args: []string{"nobody-here"}}}},
			"1", "does not exist"},
		// E2B fails the command run as an unknown user, in envd's words.
		{"command as an unknown user", Spec{FromTemplate: "base", Steps: []Step{
			{Type: StepRun, Args: []string{"true"}}, {Type: StepUser, Args: []string{"ghost"}}, {Type: StepRun, Args: []string{"echo hi"}},
		}}, "3", "failed to run command 'echo hi': command failed: unauthenticated: invalid username: 'ghost'"},
		{"ready never succeeds", Spec{FromTemplate: "base", StartCmd: "sleep 600", ReadyCmd: "false"},
			"finalize", "did not succeed within 2s"},
		{"start command dies", Spec{FromTemplate: "base", StartCmd: "exit 7", ReadyCmd: "false"},
			"finalize", "exited before the ready command"},
		{"unknown base", Spec{FromTemplate: "no-such-template"}, "base", "not found"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			name := strings.ReplaceAll(tt.name, " ", "-")
			rec := n.build(t, name, tt.spec)
			if rec.Status != StatusError || rec.Reason == nil || rec.Reason.Step != tt.step ||
				!strings.Contains(rec.Reason.Message, tt.contains) {
				t.Fatalf("record = %s %+v, want error at step %s containing %q\n%s", rec.Status, rec.Reason, tt.step, tt.contains, n.logText(rec.ID))
			}
			if _, err := n.cat.Templates().Resolve(name); !errors.Is(err, catalog.ErrNotFound) {
				t.Errorf("failed build registered a template: %v", err)
			}
			if _, err := os.Stat(filepath.Join(n.data, "templates", rec.TemplateID)); !errors.Is(err, os.ErrNotExist) {
				t.Errorf("failed build left files: %v", err)
			}
		})
	}
	n.noSandboxes(t)
	// A build can only be started once.
	if err := n.svc.Start(context.Background(), "x", "nope", Spec{FromTemplate: "base"}); !errors.Is(err, ErrNotFound) {
		t.Errorf("start of an unknown build: %v", err)
	}
}
