// Package build builds templates: E2B's Template.build flow and `aenv build -f
// Dockerfile`. A build boots a sandbox on its base (a pulled image or an existing
// template), runs the steps in it through envd, runs the start command and waits for
// the ready command, captures the result as a new template and registers it. Records,
// logs and uploaded files live in the node's data directory.
package build

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/aenv-dev/aenv/internal/catalog"
	"github.com/aenv-dev/aenv/internal/image"
	"github.com/aenv-dev/aenv/internal/image/install"
	"github.com/aenv-dev/aenv/internal/orchestrator"
	"github.com/aenv-dev/aenv/internal/sandbox"
)

// Sandboxes is what a build needs from the orchestrator (*orchestrator.Orchestrator).
type Sandboxes interface {
	Create(ctx context.Context, req orchestrator.CreateRequest) (*orchestrator.Sandbox, error)
	Endpoint(ctx context.Context, id string, autoResume bool) (sandbox.Endpoint, *orchestrator.Sandbox, error)
	Kill(ctx context.Context, id string) error
	List(ctx context.Context, f orchestrator.ListFilter) ([]*orchestrator.Sandbox, string, error)
}

// Templates is the catalog part builds use (*catalog.Templates).
type Templates interface {
	Get(id string) (catalog.Template, error)
	Resolve(idOrAlias string) (catalog.Template, error)
	Put(t catalog.Template) error
	List(kind catalog.TemplateKind) ([]catalog.Template, error)
	Delete(idOrAlias string) (catalog.Template, error)
}

// Config tunes a Service.
type Config struct {
	// DataDir is the node's data directory (templates/, images/, builds/).
	DataDir string
	Pull    image.Options
	// Capturer, when set, turns every build sandbox into its template. Default: a
	// snapshot into layers where the build sandbox runs on a layered root, TarCapture
	// into a directory otherwise.
	Capturer Capturer
	// BuildTimeout bounds a whole build (default 1 h), StepTimeout one step (default
	// 30 min), ReadyTimeout the wait for the ready command (default 2 min).
	BuildTimeout time.Duration
	StepTimeout  time.Duration
	ReadyTimeout time.Duration
	// MaxUploadBytes bounds one uploaded file set (default 4 GiB).
	MaxUploadBytes int64
	// StartTimeout is how long a requested build may wait for its start (the SDK's
	// trigger after the uploads) before it ends in error as abandoned (default 1 h).
	StartTimeout time.Duration
	// MaxConcurrent builds run at once (default 2); others wait in "building".
	MaxConcurrent int
	// EnvdPort is envd's port when an endpoint does not say (default 49983).
	EnvdPort int
	HTTP     *http.Client
	// ConvertImages reports whether images a build starts from are also converted into
	// layered templates (so the build is captured as layers, not a directory); nil: when
	// the node's base template is layered. ImageDiskMB is their disk size (default
	// install.DefaultDiskMB; sandboxes asking for more grow it).
	ConvertImages func() bool
	ImageDiskMB   int
	// GCGrace spares image data changed more recently than this from CollectGarbage
	// (default install.DefaultGCGrace).
	GCGrace time.Duration
	// StartupGCDelay is how long the collection New starts waits first (default none):
	// a node's restart lets its own work (adopting sandboxes, answering their first
	// requests) go before a collection that decodes every sandbox record.
	StartupGCDelay time.Duration
	// Publisher, when set, publishes each built template to the repository.
	Publisher Publisher
	Logger    *slog.Logger
	// Registerer receives the build metrics (nil: not exported).
	Registerer prometheus.Registerer
}

// Service runs builds and answers questions about them.
type Service struct {
	cfg   Config
	sbx   Sandboxes
	tpls  Templates
	store *store
	files *fileStore
	log   *slog.Logger
	sem   chan struct{}
	tags  *tagStore
	met   *metrics

	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup
	pullMu sync.Mutex // one image import at a time: imports of one image share a directory
	gcMu   sync.Mutex // one CollectGarbage at a time
}

// New opens the build records under cfg.DataDir. Builds a previous process left
// unfinished are marked failed: their sandboxes died with it.
func New(cfg Config, sbx Sandboxes, tpls Templates) (*Service, error) {
	if cfg.DataDir == "" {
		return nil, errors.New("build: DataDir is required")
	}
	if sbx == nil || tpls == nil {
		return nil, errors.New("build: sandboxes and templates are required")
	}
	if cfg.BuildTimeout <= 0 {
		cfg.BuildTimeout = time.Hour
	}
	if cfg.StepTimeout <= 0 {
		cfg.StepTimeout = 30 * time.Minute
	}
	if cfg.ReadyTimeout <= 0 {
		cfg.ReadyTimeout = 2 * time.Minute
	}
	if cfg.StartTimeout <= 0 {
		cfg.StartTimeout = time.Hour
	}
	if cfg.MaxUploadBytes <= 0 {
		cfg.MaxUploadBytes = 4 << 30
	}
	if cfg.MaxConcurrent <= 0 {
		cfg.MaxConcurrent = 2
	}
	if cfg.EnvdPort == 0 {
		cfg.EnvdPort = 49983
	}
	if cfg.HTTP == nil {
		cfg.HTTP = &http.Client{}
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	st, err := openStore(filepath.Join(cfg.DataDir, "builds"))
	if err != nil {
		return nil, err
	}
	fs, err := openFileStore(filepath.Join(cfg.DataDir, "builds", "files"), cfg.MaxUploadBytes)
	if err != nil {
		return nil, err
	}
	tags, err := openTagStore(tagsPath(cfg.DataDir))
	if err != nil {
		return nil, err
	}
	met, err := newMetrics(cfg.Registerer)
	if err != nil {
		return nil, err
	}
	s := &Service{cfg: cfg, sbx: sbx, tpls: tpls, store: st, files: fs, log: cfg.Logger.With("component", "build"),
		sem: make(chan struct{}, cfg.MaxConcurrent), tags: tags, met: met}
	s.ctx, s.cancel = context.WithCancel(context.Background())
	for _, r := range st.list(func(r *Record) bool { return r.Status == StatusBuilding }) {
		s.reclaimCapture(r)
		if err := s.abandon(r.ID, StatusBuilding, "the node stopped during the build"); err != nil {
			return nil, err
		}
	}
	// A build requested but not started when the node stopped lost its client's
	// session (the uploads and the start come from one SDK call): it never starts.
	for _, r := range st.list(func(r *Record) bool { return r.Status == StatusWaiting }) {
		if err := s.abandon(r.ID, StatusWaiting, "the node stopped before the build was started"); err != nil {
			return nil, err
		}
	}
	// Collect what deletes before a crash or on another node left behind.
	s.gcAfter(cfg.StartupGCDelay)
	return s, nil
}

// abandon ends a build that is still in status from in error, saying why.
func (s *Service) abandon(id string, from Status, why string) error {
	changed := false
	_, err := s.store.update(id, func(r *Record) error {
		if r.Status != from {
			return nil
		}
		changed = true
		r.Status, r.Reason, r.FinishedAt = StatusError, &Reason{Message: why}, time.Now().UTC()
		return nil
	})
	if err == nil && changed {
		s.store.log(id, "error", why)
	}
	return err
}

// expireWaiting ends in error the builds that were requested but not started within
// StartTimeout (the client went away), so none stays waiting forever.
func (s *Service) expireWaiting() {
	cutoff := time.Now().Add(-s.cfg.StartTimeout)
	for _, r := range s.store.list(func(r *Record) bool { return r.Status == StatusWaiting && r.CreatedAt.Before(cutoff) }) {
		why := fmt.Sprintf("the build was not started within %s of its request", s.cfg.StartTimeout)
		if err := s.abandon(r.ID, StatusWaiting, why); err != nil {
			s.log.Warn("expire a build never started", "build", r.ID, "err", err)
		}
	}
}

// Close cancels running builds and waits for them to clean up.
func (s *Service) Close() {
	s.cancel()
	s.wg.Wait()
}

// RequestOptions is POST /v3/templates.
type RequestOptions struct {
	Name      string
	Resources sandbox.Resources
	// Tags the build gets when it is ready, with the tag of a "name:tag" Name
	// (none at all: DefaultTag).
	Tags []string
}

// Request registers a new build of the template called Name (E2B's Template.build,
// step 1). A name that is already a template builds a new version of it.
func (s *Service) Request(_ context.Context, o RequestOptions) (Record, error) {
	name, tags, err := requestTags(o.Name, o.Tags)
	if err != nil {
		return Record{}, err
	}
	if !catalog.ValidName(name) {
		return Record{}, fmt.Errorf("%w: template name %q (letters, digits, '.', '_', '-')", ErrInvalidSpec, o.Name)
	}
	r := o.Resources
	if r.CPUCount < 0 || r.MemoryMB < 0 || r.DiskSizeMB < 0 {
		return Record{}, fmt.Errorf("%w: negative resources", ErrInvalidSpec)
	}
	tplID := ""
	t, err := s.tpls.Resolve(name)
	switch {
	case err == nil && t.Kind != catalog.KindTemplate:
		return Record{}, fmt.Errorf("%w: %q is a snapshot, not a template", ErrConflict, name)
	case err == nil:
		tplID = t.ID
	case errors.Is(err, catalog.ErrNotFound):
		for _, b := range s.store.list(func(b *Record) bool { return b.Name == name }) {
			tplID = b.TemplateID // an earlier, unfinished or failed build of the same name
		}
	default:
		return Record{}, err
	}
	if tplID == "" {
		tplID = install.NewID()
	}
	rec := &Record{ID: newBuildID(), TemplateID: tplID, Name: name, Status: StatusWaiting, Resources: r,
		Tags: tags, CreatedAt: time.Now().UTC()}
	if err := s.store.put(rec); err != nil {
		return Record{}, err
	}
	s.store.log(rec.ID, "info", fmt.Sprintf("build %s of template %s (%s) requested", rec.ID, name, tplID))
	return *rec, nil
}

// Start runs a requested build in the background (E2B's trigger step). It fails with
// ErrNotFound for an unknown build, ErrConflict when it was already started, and
// ErrInvalidSpec for a spec that cannot run.
func (s *Service) Start(_ context.Context, templateID, buildID string, spec Spec) error {
	// A refused start leaves the build waiting, to be started properly (or to expire).
	if err := s.startable(spec); err != nil {
		return err
	}
	if s.ctx.Err() != nil {
		return fmt.Errorf("%w: the node is shutting down", ErrConflict)
	}
	rec, err := s.store.update(buildID, func(r *Record) error {
		if r.TemplateID != templateID {
			return fmt.Errorf("build %q of template %q: %w", buildID, templateID, ErrNotFound)
		}
		if r.Status != StatusWaiting {
			return fmt.Errorf("%w: build %s is %s", ErrConflict, buildID, r.Status)
		}
		r.Status, r.Spec = StatusBuilding, &spec
		return nil
	})
	if err != nil {
		return err
	}
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		s.run(rec)
	}()
	return nil
}

// startable checks a spec and that the files its COPY steps name were uploaded.
func (s *Service) startable(spec Spec) error {
	if err := spec.Validate(); err != nil {
		return err
	}
	for _, st := range spec.Steps {
		if st.Type == StepCopy && !s.files.has(st.FilesHash) {
			return fmt.Errorf("%w: COPY %s: files %s were not uploaded", ErrInvalidSpec, st.Args[0], st.FilesHash)
		}
	}
	return nil
}

// Get returns a build of a template.
func (s *Service) Get(templateID, buildID string) (Record, error) {
	s.expireWaiting()
	r, ok := s.store.get(buildID)
	if !ok || r.TemplateID != templateID {
		return Record{}, fmt.Errorf("build %q of template %q: %w", buildID, templateID, ErrNotFound)
	}
	return r, nil
}

// Logs returns a build's log entries from offset on (limit 0: all).
func (s *Service) Logs(buildID string, offset, limit int) []LogEntry {
	return s.store.logsFrom(buildID, offset, limit)
}

// Builds lists the builds of a template (all templates when templateID is empty),
// oldest first.
func (s *Service) Builds(templateID string) []Record {
	s.expireWaiting()
	return s.store.list(func(r *Record) bool { return templateID == "" || r.TemplateID == templateID })
}

// Forget removes a template's build records and logs (after the template was deleted).
// Builds still running are left alone.
func (s *Service) Forget(templateID string) error {
	var errs []error
	for _, r := range s.Builds(templateID) {
		if r.Status == StatusBuilding {
			continue
		}
		errs = append(errs, s.store.remove(r.ID))
	}
	return errors.Join(errs...)
}

// FilePresent reports whether the COPY file set with this hash was uploaded
// (GET /templates/{id}/files/{hash}).
func (s *Service) FilePresent(hash string) (bool, error) { return s.files.Present(hash) }

// PutFile stores an uploaded COPY file set: a tar, optionally gzipped (the upload URL).
func (s *Service) PutFile(hash string, r io.Reader) error { return s.files.Put(hash, r) }

func newBuildID() string {
	b := make([]byte, 16)
	rand.Read(b)
	return fmt.Sprintf("%x-%x-%x-%x-%x", b[0:4], b[4:6], b[6:8], b[8:10], b[10:16])
}

// run executes one build and records its outcome.
func (s *Service) run(rec Record) {
	logf := func(level, msg string) { s.store.log(rec.ID, level, msg) }
	ph := &phases{m: s.met}
	ph.enter(PhaseQueue)
	defer ph.end()
	s.met.running.Inc()
	defer s.met.running.Dec()
	select {
	case s.sem <- struct{}{}:
		defer func() { <-s.sem }()
	case <-s.ctx.Done():
		s.finish(rec.ID, failStep("base", errors.New("the node stopped before the build ran")), logf)
		return
	default:
		logf("info", "waiting for another build to finish")
		select {
		case s.sem <- struct{}{}:
			defer func() { <-s.sem }()
		case <-s.ctx.Done():
			s.finish(rec.ID, failStep("base", errors.New("the node stopped before the build ran")), logf)
			return
		}
	}
	ctx, cancel := context.WithTimeout(context.WithValue(s.ctx, phasesKey{}, ph), s.cfg.BuildTimeout)
	defer cancel()
	start := time.Now()
	err := s.build(ctx, rec, logf)
	if err == nil {
		logf("info", fmt.Sprintf("build finished in %s", time.Since(start).Round(time.Millisecond)))
	} else if ctx.Err() != nil && errors.Is(err, context.DeadlineExceeded) {
		err = failStep(stepOf(err), fmt.Errorf("the build did not finish within %s", s.cfg.BuildTimeout))
	}
	s.finish(rec.ID, err, logf)
}

func stepOf(err error) string {
	var se *stepError
	if errors.As(err, &se) {
		return se.step
	}
	return "finalize"
}

func (s *Service) finish(id string, err error, logf func(level, msg string)) {
	if err != nil {
		logf("error", err.Error())
		s.log.Warn("template build failed", "build", id, "err", err)
	}
	s.met.finished(err, stepOf(err))
	rec, uerr := s.store.update(id, func(r *Record) error {
		r.FinishedAt, r.SandboxID = time.Now().UTC(), ""
		if err != nil {
			r.Status, r.Reason = StatusError, &Reason{Message: err.Error(), Step: stepOf(err)}
		} else {
			r.Status = StatusReady
		}
		return nil
	})
	if uerr != nil {
		s.log.Error("save build result", "build", id, "err", uerr)
	} else if err == nil {
		s.tagBuild(rec)
	}
}

// build does the work: base, sandbox, steps, start/ready, capture, register.
func (s *Service) build(ctx context.Context, rec Record, logf func(level, msg string)) error {
	spec := *rec.Spec
	enterPhase(ctx, PhaseBase)
	base, err := s.base(ctx, spec, logf)
	if err != nil {
		return failStep("base", err)
	}
	enterPhase(ctx, PhaseSandbox)
	logf("info", fmt.Sprintf("starting the build sandbox on %s", base.ID))
	sb, err := s.sbx.Create(ctx, orchestrator.CreateRequest{TemplateID: base.ID, Timeout: s.cfg.BuildTimeout + time.Minute,
		Secure: true, AllowInternet: true, Resources: rec.Resources, FlatRoot: true,
		Metadata: map[string]string{orchestrator.BuildMetadataKey: rec.ID, "aenv.template": rec.TemplateID}})
	if err != nil {
		return failStep("base", fmt.Errorf("start the build sandbox: %w", err))
	}
	defer func() {
		kctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Minute)
		defer cancel()
		if err := s.sbx.Kill(kctx, sb.ID); err != nil && !errors.Is(err, orchestrator.ErrNotFound) {
			s.log.Error("kill the build sandbox", "sandbox", sb.ID, "err", err)
		}
	}()
	if _, err := s.store.update(rec.ID, func(r *Record) error { r.SandboxID = sb.ID; return nil }); err != nil {
		return err
	}
	ep, _, err := s.sbx.Endpoint(ctx, sb.ID, false)
	if err != nil {
		return failStep("base", fmt.Errorf("reach the build sandbox: %w", err))
	}
	port := ep.EnvdPort
	if port == 0 {
		port = s.cfg.EnvdPort
	}
	sess := NewSession(sb.ID, fmt.Sprintf("http://%s", joinHostPort(ep.Host, port)), sb.EnvdAccessToken, s.cfg.HTTP)
	icfg := imageConfig(base)
	x := &executor{s: sess, files: s.files, logf: logf, stepTimeout: s.cfg.StepTimeout, readyTimeout: s.cfg.ReadyTimeout,
		st: state{user: base.DefaultUser, workdir: base.DefaultWorkdir, env: base.EnvVars,
			expose: icfg.ExposedPorts, labels: icfg.Labels}}
	if x.st.user == "" {
		x.st.user = "user"
	}
	if x.st.workdir == "" {
		x.st.workdir = "/home/user"
	}
	if err := x.ensureUser(ctx); err != nil {
		return failStep("base", err)
	}
	// The steps start as, and DEFAULT_USER returns to, the image's USER (an image
	// import's; later builds carry it as their default user), else the base template's
	// default user, else `user`.
	if icfg.User != "" {
		x.st.user = x.imageUser(ctx, icfg.User)
	}
	x.startUser = x.st.user
	enterPhase(ctx, PhaseSteps)
	if err := x.steps(ctx, spec.Steps); err != nil {
		return err
	}
	enterPhase(ctx, PhaseReady)
	if err := x.startAndWait(ctx, spec.StartCmd, spec.ReadyCmd); err != nil {
		return failStep("finalize", err)
	}
	enterPhase(ctx, PhaseCapture)
	logf("info", "capturing the template")
	dir := filepath.Join(s.cfg.DataDir, install.TemplatesDir, rec.TemplateID, "builds", rec.ID)
	c, err := s.capturer().Capture(ctx, sess, dir, logf)
	if err != nil {
		return failStep("finalize", err)
	}
	if err := s.journalCapture(rec.ID, c); err != nil {
		s.dropCapture(ctx, c, dir)
		return failStep("finalize", err)
	}
	icfg.ExposedPorts, icfg.Labels = x.st.expose, x.st.labels
	t := catalog.Template{
		ID: rec.TemplateID, Kind: catalog.KindTemplate, Resources: rec.Resources,
		EnvVars: x.st.env, StartCmd: spec.StartCmd, ReadyCmd: spec.ReadyCmd,
		DefaultUser: x.st.user, DefaultWorkdir: x.st.workdir,
		ExposedPorts: icfg.ExposedPorts, Labels: icfg.Labels, Entrypoint: icfg.Entrypoint, Cmd: icfg.Cmd,
	}
	if err := templateStorage(&t, c, rec, base.ID, icfg); err != nil {
		s.dropCapture(ctx, c, dir)
		return failStep("finalize", err)
	}
	if c.Layers != nil {
		// The artifact holds this backend's capture (which only it can discard); the
		// template's filesystem boots on any backend.
		t.Backend = sb.Backend
	}
	if rec.Name != rec.TemplateID {
		t.Aliases = []string{rec.Name}
	}
	old, oldErr := s.tpls.Get(rec.TemplateID)
	if oldErr == nil {
		t.Aliases = append(t.Aliases, old.Aliases...)
	}
	enterPhase(ctx, PhaseRegister)
	if err := s.tpls.Put(t); err != nil {
		s.dropCapture(ctx, c, dir)
		return failStep("finalize", fmt.Errorf("register the template: %w", err))
	}
	s.publish(ctx, t, sb.EnvdVersion, logf)
	// Earlier builds of the template are replaced; sandboxes still on them keep theirs
	// (their layers stay until the last one is gone).
	if oldErr == nil {
		s.discardCapture(ctx, old)
		defer s.Retired(context.WithoutCancel(ctx), old)
	}
	s.pruneBuilds(context.WithoutCancel(ctx), rec.TemplateID, rec.ID)
	logf("info", fmt.Sprintf("template %s (%s) is ready", rec.Name, rec.TemplateID))
	return nil
}

func joinHostPort(host string, port int) string {
	if strings.Contains(host, ":") {
		return fmt.Sprintf("[%s]:%d", host, port)
	}
	return fmt.Sprintf("%s:%d", host, port)
}

// base resolves the template a build starts from, pulling and importing an image when
// the spec names one. Imported images become templates "img-<digest>" so later builds
// from the same image skip the import.
func (s *Service) base(ctx context.Context, spec Spec, logf func(level, msg string)) (catalog.Template, error) {
	if spec.FromTemplate != "" {
		t, err := s.tpls.Resolve(spec.FromTemplate)
		if err != nil {
			return catalog.Template{}, fmt.Errorf("base template %q: %w", spec.FromTemplate, err)
		}
		if t.RootFSDir == "" && t.Kind == catalog.KindTemplate && !t.Layered() {
			return catalog.Template{}, fmt.Errorf("base template %q has no root filesystem on this node", spec.FromTemplate)
		}
		logf("info", fmt.Sprintf("base: template %s", t.ID))
		return t, nil
	}
	opts, err := s.pullOptions(spec, logf)
	if err != nil {
		return catalog.Template{}, err
	}
	logf("info", "pulling "+spec.FromImage)
	img, err := image.Pull(ctx, spec.FromImage, opts)
	if err != nil {
		return catalog.Template{}, err // "pull REF: why"
	}
	defer img.Close()
	hex := strings.TrimPrefix(img.Digest, "sha256:")
	id := install.ImportPrefix + hex[:min(24, len(hex))]
	return s.importImage(ctx, img, id, spec.FromImage, logf)
}

// Template is a catalog template with its builds, for the template endpoints.
type Template struct {
	catalog.Template
	Builds []Record
}

// ErrNotTemplate is returned by Delete for snapshots (they are deleted through the
// snapshot path).
var ErrNotTemplate = errors.New("not a template")

// Delete removes a built or pulled template: its catalog entry, build records and
// files. Sandboxes running on it keep their root (the directory is removed, their
// overlay keeps the lower open). Unknown is ErrNotFound.
func (s *Service) Delete(ctx context.Context, idOrAlias string) (catalog.Template, error) {
	t, err := s.tpls.Resolve(idOrAlias)
	if errors.Is(err, catalog.ErrNotFound) {
		return s.deleteUnbuilt(ctx, idOrAlias)
	}
	if err != nil {
		return catalog.Template{}, err
	}
	if t.Kind != catalog.KindTemplate {
		return catalog.Template{}, fmt.Errorf("%q: %w", idOrAlias, ErrNotTemplate)
	}
	for _, r := range s.Builds(t.ID) {
		if r.Status == StatusBuilding {
			return catalog.Template{}, fmt.Errorf("%w: template %s has a build running (%s)", ErrConflict, t.ID, r.ID)
		}
	}
	if _, err := s.tpls.Delete(t.ID); err != nil {
		return catalog.Template{}, err
	}
	s.unpublish(ctx, t.ID)
	// Its layers go once no sandbox or snapshot uses them.
	s.discardCapture(ctx, t)
	if err := s.tags.forget(t.ID); err != nil {
		s.log.Warn("remove template tags", "template", t.ID, "err", err)
	}
	if err := s.Forget(t.ID); err != nil {
		s.log.Warn("remove build records", "template", t.ID, "err", err)
	}
	s.removeFiles(ctx, t)
	s.Retired(ctx, t)
	return t, nil
}

// Templates lists the node's templates (not snapshots), oldest first.
func (s *Service) Templates() ([]catalog.Template, error) { return s.tpls.List(catalog.KindTemplate) }

// Resolve finds a template or snapshot by id or name; unknown is ErrNotFound.
func (s *Service) Resolve(idOrAlias string) (catalog.Template, error) {
	t, err := s.tpls.Resolve(idOrAlias)
	if errors.Is(err, catalog.ErrNotFound) {
		return t, fmt.Errorf("template %q: %w", idOrAlias, ErrNotFound)
	}
	return t, err
}
