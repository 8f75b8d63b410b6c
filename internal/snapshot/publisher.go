// Package snapshot publishes templates and snapshots to the shared
// repository and keeps the node's catalog in step with it.
//
// Publication (Publisher.Publish) follows the repository's protocol: the
// layer files are hashed (once: digests are remembered per file), copied
// into the node cache so this node serves them locally at once, the record
// is written pending (naming every digest, which keeps GC off them), the
// blobs are uploaded by a bounded worker pool with retries, checked, and the
// record is marked complete; only then do other nodes use it. Publications
// are journaled under the state directory first, so a node that dies
// mid-upload finishes them after a restart.
//
// Sync registers in the local catalog every complete record of the
// repository this node does not have: with Options.LazyLayers its layer refs
// name digests only and sandboxes read them lazily (lazy.go), otherwise its
// layers are fetched to this node and the artifact's layer paths pointed at
// them; records deleted from the repository leave the catalog once no
// sandbox here uses them. Delete removes a record and collects blobs nothing
// references any more; Compact merges stacks deeper than the limit into a
// new record version.
//
// Layout under the state directory:
//
//	publishing/<id>.json   journal of a publication in flight (its Manifest)
//	records/<id>.json      records this node published or synced (tracked)
//	digests/<hash>.json    remembered digests of layer files
//	layers/<hex>.layer     layers fetched from the repository (and merges)
package snapshot

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/aenv-dev/aenv/internal/catalog"
	"github.com/aenv-dev/aenv/internal/repository"
	"github.com/aenv-dev/aenv/internal/repository/layers"
)

// Sentinel errors callers branch on.
var (
	ErrInvalid  = errors.New("snapshot: invalid manifest")
	ErrNotFound = errors.New("snapshot: not found")
	// ErrDeleted: the record was deleted while it was being published.
	ErrDeleted = errors.New("snapshot: deleted during publication")
	// ErrClosed: the publisher is shut down.
	ErrClosed = errors.New("snapshot: publisher closed")
)

// CatalogStore is the part of the node catalog (*catalog.Templates) that
// sync and delete change.
type CatalogStore interface {
	Put(t catalog.Template) error
	Get(id string) (catalog.Template, error)
	Delete(idOrAlias string) (catalog.Template, error)
}

// LayerFile is one sealed layer of a manifest, bottom first: a file, or a
// layer already in the repository that this node reads lazily (Digest, no
// Path).
type LayerFile struct {
	Path   string            `json:"path,omitempty"` // absolute
	Digest repository.Digest `json:"digest,omitempty"`
	UUID   string            `json:"uuid,omitempty"`
	Size   int64             `json:"size,omitempty"` // checked when set
	// Role is the record layer's role; empty means "rootfs".
	Role string `json:"role,omitempty"`
}

// Defaults are what sandboxes created from a template or snapshot start
// with, and the backend's artifact (stored verbatim but for layer refs).
type Defaults struct {
	EnvVars        map[string]string `json:"env_vars,omitempty"`
	StartCmd       string            `json:"start_cmd,omitempty"`
	ReadyCmd       string            `json:"ready_cmd,omitempty"`
	DefaultUser    string            `json:"default_user,omitempty"`
	DefaultWorkdir string            `json:"default_workdir,omitempty"`
	// EnvdAccessToken is a snapshot's catalog.Template.EnvdAccessToken.
	EnvdAccessToken string          `json:"envd_access_token,omitempty"`
	Artifact        json.RawMessage `json:"artifact,omitempty"`
	// Sandbox is a handoff's sandbox record (see handoff.go); empty otherwise.
	Sandbox json.RawMessage `json:"sandbox,omitempty"`
}

// Manifest describes what to publish.
type Manifest struct {
	ID             string               `json:"id"`
	Kind           repository.Kind      `json:"kind"`
	Name           string               `json:"name,omitempty"`
	Layers         []LayerFile          `json:"layers"`
	Resources      repository.Resources `json:"resources"`
	Config         Defaults             `json:"config"`
	EnvdVersion    string               `json:"envd_version,omitempty"`
	Backend        string               `json:"backend,omitempty"`
	SourceSandbox  string               `json:"source_sandbox,omitempty"`
	ParentSnapshot string               `json:"parent_snapshot,omitempty"`
	// CreatedAt is when the template or snapshot was made (its catalog entry's age);
	// zero: when the record is first written. Every node syncing the record gets it,
	// and settles name clashes by it (see putNamed).
	CreatedAt time.Time `json:"created_at,omitzero"`
}

// recordConfig is a record's Config: the defaults plus the publishing node,
// which alone may resume a pending record.
type recordConfig struct {
	Node string `json:"node"`
	// ClaimedBy is the node that resumed a handoff (see handoff.go).
	ClaimedBy string `json:"claimed_by,omitempty"`
	Defaults
}

func (m *Manifest) validate() error {
	if err := repository.ValidateID(m.ID); err != nil {
		return fmt.Errorf("%w: %v", ErrInvalid, err)
	}
	if err := m.Kind.Validate(); err != nil {
		return fmt.Errorf("%w: %v", ErrInvalid, err)
	}
	if m.Name != "" && repository.ValidateID(m.Name) != nil {
		return fmt.Errorf("%w: name %q", ErrInvalid, m.Name)
	}
	if len(m.Layers) == 0 {
		return fmt.Errorf("%w: %s has no layers", ErrInvalid, m.ID)
	}
	for i, l := range m.Layers {
		if l.Path == "" && l.Digest != "" {
			if err := l.Digest.Validate(); err != nil {
				return fmt.Errorf("%w: layer %d: %v", ErrInvalid, i, err)
			}
		} else if !filepath.IsAbs(l.Path) {
			return fmt.Errorf("%w: layer %d path %q is not absolute", ErrInvalid, i, l.Path)
		}
		if l.Size < 0 || len(l.Role) > 64 {
			return fmt.Errorf("%w: layer %d", ErrInvalid, i)
		}
	}
	if len(m.Config.Artifact) > 0 && !json.Valid(m.Config.Artifact) {
		return fmt.Errorf("%w: artifact is not JSON", ErrInvalid)
	}
	return nil
}

// State of a publication.
type State string

const (
	StatePending  State = "pending"
	StateComplete State = "complete"
	StateFailed   State = "failed"
)

// Status reports a publication.
type Status struct {
	ID    string
	State State
	Err   error // why it failed (StateFailed)
	// Blobs and Uploaded count distinct layer blobs and those in the
	// repository so far.
	Blobs, Uploaded int
}

// Options configure a Publisher.
type Options struct {
	// NodeID names this node in the records it publishes; required.
	NodeID string
	// StateDir holds journals, tracked records and fetched layers; required.
	StateDir string
	// Workers bounds blob uploads in flight (default 4).
	Workers int
	// MaxAttempts bounds tries of one repository call (default 8); RetryBase
	// is the first backoff (default 250ms), doubled up to 30s.
	MaxAttempts int
	RetryBase   time.Duration
	// MaxDepth is the layer count above which Compact merges (default 32).
	MaxDepth int
	// SyncInterval is the period of the background loop (default 30s).
	SyncInterval time.Duration
	// GCGrace is passed to repository.GC (0: its default; negative: none).
	GCGrace time.Duration
	// LazyLayers makes Sync register records with layer refs by digest only
	// (read lazily through the backend's layer resolver) instead of fetching
	// every layer first.
	LazyLayers bool
	// InUse reports whether a sandbox on this node uses a template or
	// snapshot; sync keeps the catalog entry of a record deleted elsewhere
	// until it is free. Nil means none is.
	InUse func(templateID string) bool
	// OnRemoved is called after sync removed a catalog entry (so a backend
	// can discard its capture). Optional.
	OnRemoved func(ctx context.Context, t catalog.Template)
	Logger    *slog.Logger
}

// Publisher publishes manifests and syncs the catalog. Safe for concurrent
// use; Close stops its background work.
type Publisher struct {
	repo  repository.Repository
	local localStore // nil when repo is not a node cache
	cat   CatalogStore
	o     Options
	log   *slog.Logger
	dg    digester
	sem   chan struct{}
	// hashes keeps the block hash lists of the layers this node published
	// or reads lazily (see lazy.go).
	hashes *layers.HashStore

	ctx    context.Context // cancelled by Close
	cancel context.CancelFunc
	wg     sync.WaitGroup

	mu     sync.Mutex
	jobs   map[string]*job
	closed bool

	syncMu sync.Mutex // one Sync (and one Compact pass) at a time
}

// localStore is what a node cache (*nodecache.Cache) offers beyond
// repository.Repository: blobs stored here first and uploaded later, pinned
// meanwhile. Without one the publisher uploads straight from the files.
type localStore interface {
	PutLocal(ctx context.Context, d repository.Digest, size int64, r io.Reader) (repository.BlobInfo, error)
	Publish(ctx context.Context, d repository.Digest) (repository.BlobInfo, error)
	Pin(owner string, digests ...repository.Digest) error
	Unpin(owner string) error
	Pinned() []repository.Digest
}

// New makes a publisher over repo (usually a *nodecache.Cache in front of
// posixfs or s3) and the node catalog. It starts nothing; call Start.
func New(repo repository.Repository, cat CatalogStore, o Options) (*Publisher, error) {
	if repo == nil || cat == nil {
		return nil, fmt.Errorf("%w: repository and catalog are required", ErrInvalid)
	}
	if o.NodeID == "" || o.StateDir == "" {
		return nil, fmt.Errorf("%w: NodeID and StateDir are required", ErrInvalid)
	}
	if o.Workers <= 0 {
		o.Workers = 4
	}
	if o.MaxAttempts <= 0 {
		o.MaxAttempts = 8
	}
	if o.RetryBase <= 0 {
		o.RetryBase = 250 * time.Millisecond
	}
	if o.MaxDepth <= 0 {
		o.MaxDepth = 32
	}
	if o.SyncInterval <= 0 {
		o.SyncInterval = 30 * time.Second
	}
	if o.Logger == nil {
		o.Logger = slog.Default()
	}
	for _, d := range stateDirs() {
		if err := os.MkdirAll(filepath.Join(o.StateDir, d), 0o755); err != nil {
			return nil, fmt.Errorf("snapshot: %w", err)
		}
	}
	ctx, cancel := context.WithCancel(context.Background())
	p := &Publisher{repo: repo, cat: cat, o: o, log: o.Logger, dg: digester{filepath.Join(o.StateDir, "digests")},
		sem: make(chan struct{}, o.Workers), ctx: ctx, cancel: cancel, jobs: map[string]*job{},
		hashes: &layers.HashStore{Dir: filepath.Join(o.StateDir, "blockhashes")}}
	if ls, ok := repo.(localStore); ok {
		p.local = ls
	}
	p.cleanTmp()
	return p, nil
}

// stateDirs are the directories of the publisher's state under Options.StateDir.
func stateDirs() []string {
	return []string{"publishing", "records", "digests", "layers", "blockhashes"}
}

func (p *Publisher) path(elem ...string) string {
	return filepath.Join(append([]string{p.o.StateDir}, elem...)...)
}

// Users is what sync asks of the sandboxes of this node
// (*orchestrator.Orchestrator, which itself publishes through the publisher,
// so it exists only after the publisher and is handed over at Start).
type Users interface {
	// UsesTemplate reports whether a sandbox on this node runs on a template
	// or snapshot (Options.InUse).
	UsesTemplate(id string) bool
	// DiscardTemplate is told of an entry sync removed (Options.OnRemoved).
	DiscardTemplate(ctx context.Context, t catalog.Template)
}

// Start resumes the publications a previous run left unfinished and starts
// the background loop (sync with jitter, compaction, retries of failed
// publications). It returns once the resumed publications are queued.
// users, when not nil, replaces Options.InUse and OnRemoved; nothing syncs
// in the background before Start.
func (p *Publisher) Start(ctx context.Context, users Users) error {
	if users != nil {
		p.o.InUse, p.o.OnRemoved = users.UsesTemplate, users.DiscardTemplate
	}
	if _, err := p.Resume(ctx); err != nil {
		return err
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return ErrClosed
	}
	p.wg.Go(func() { p.loop(p.ctx) })
	return nil
}

// Close stops the background loop and cancels uploads in flight; their
// journals stay, so the next Start finishes them.
func (p *Publisher) Close() error {
	p.mu.Lock()
	p.closed = true
	p.mu.Unlock()
	p.cancel()
	p.wg.Wait()
	return nil
}

// Resume queues every journaled publication not in flight (after a
// restart, or after one failed on a repository outage) and returns their
// handles.
func (p *Publisher) Resume(ctx context.Context) ([]*Handle, error) {
	ents, err := os.ReadDir(p.path("publishing"))
	if err != nil {
		return nil, fmt.Errorf("snapshot: %w", err)
	}
	var hs []*Handle
	for _, e := range ents {
		id, ok := strings.CutSuffix(e.Name(), ".json")
		if !ok || repository.ValidateID(id) != nil {
			continue
		}
		b, err := os.ReadFile(p.path("publishing", e.Name()))
		var m Manifest
		if err == nil {
			err = json.Unmarshal(b, &m)
		}
		if err == nil {
			err = m.validate()
		}
		if err != nil || m.ID != id {
			p.log.Error("snapshot: unreadable publication journal; dropping it", "id", id, "err", err)
			os.Remove(p.path("publishing", e.Name()))
			continue
		}
		h, started, err := p.start(m, false)
		if errors.Is(err, ErrClosed) {
			return hs, err
		}
		if started {
			p.log.Info("snapshot: resuming publication", "id", id)
		}
		if err == nil {
			hs = append(hs, h)
		}
	}
	return hs, nil
}

// Publish starts publishing m and returns at once: the layers stay usable
// on this node from their files, and the returned handle reports when the
// record is complete (usable by every node). Publishing an id already in
// flight returns its handle.
func (p *Publisher) Publish(ctx context.Context, m Manifest) (*Handle, error) {
	if err := m.validate(); err != nil {
		return nil, err
	}
	for i := range m.Layers {
		if m.Layers[i].Path != "" {
			m.Layers[i].Path = filepath.Clean(m.Layers[i].Path)
		}
		if m.Layers[i].Role == "" {
			m.Layers[i].Role = "rootfs"
		}
	}
	h, _, err := p.start(m, true)
	return h, err
}

// start runs a publication of m unless one is in flight (started false).
func (p *Publisher) start(m Manifest, journal bool) (h *Handle, started bool, err error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return nil, false, ErrClosed
	}
	if j := p.jobs[m.ID]; j != nil {
		if st := j.status(); st.State != StateFailed {
			return &Handle{j: j}, false, nil
		}
	}
	if journal {
		b, err := json.Marshal(m)
		if err == nil {
			err = writeFileAtomic(p.path("publishing", m.ID+".json"), b)
		}
		if err != nil {
			return nil, false, fmt.Errorf("snapshot: journal %s: %w", m.ID, err)
		}
	}
	ctx, cancel := context.WithCancel(p.ctx)
	j := &job{m: m, done: make(chan struct{}), cancel: cancel, st: Status{ID: m.ID, State: StatePending}}
	p.jobs[m.ID] = j
	p.wg.Go(func() {
		defer cancel()
		err := p.run(ctx, j)
		j.finish(err)
		if err == nil {
			// Complete publications answer Status from the repository;
			// failed ones stay to report their error.
			p.mu.Lock()
			if p.jobs[m.ID] == j {
				delete(p.jobs, m.ID)
			}
			p.mu.Unlock()
		}
		if err != nil {
			p.log.Error("snapshot: publication failed", "id", m.ID, "err", err)
		} else {
			p.log.Info("snapshot: published", "id", m.ID, "kind", m.Kind, "blobs", j.status().Blobs)
		}
	})
	return &Handle{j: j}, true, nil
}

// Status reports the publication of id: in flight or finished in this
// process, journaled, or else as the repository's record says.
func (p *Publisher) Status(ctx context.Context, id string) (Status, error) {
	p.mu.Lock()
	j := p.jobs[id]
	p.mu.Unlock()
	if j != nil {
		return j.status(), nil
	}
	if _, err := os.Stat(p.path("publishing", id+".json")); err == nil {
		return Status{ID: id, State: StatePending}, nil
	}
	for _, k := range repository.Kinds() {
		rec, err := p.repo.GetRecord(ctx, k, id)
		if errors.Is(err, repository.ErrNotFound) || errors.Is(err, repository.ErrInvalid) {
			continue
		}
		if err != nil {
			return Status{}, fmt.Errorf("snapshot: status of %s: %w", id, err)
		}
		st := Status{ID: id, State: StatePending, Blobs: len(rec.Digests())}
		if rec.State == repository.StateComplete {
			st.State, st.Uploaded = StateComplete, st.Blobs
		}
		return st, nil
	}
	return Status{}, fmt.Errorf("%w: %s", ErrNotFound, id)
}

// job is one publication.
type job struct {
	m      Manifest
	done   chan struct{}
	cancel context.CancelFunc

	mu     sync.Mutex
	st     Status
	hashed []repository.Digest // distinct layer digests, once known
}

func (j *job) status() Status {
	j.mu.Lock()
	defer j.mu.Unlock()
	return j.st
}

func (j *job) update(fn func(*Status)) {
	j.mu.Lock()
	fn(&j.st)
	j.mu.Unlock()
}

func (j *job) finish(err error) {
	j.update(func(s *Status) {
		if err != nil {
			s.State, s.Err = StateFailed, err
		} else {
			s.State, s.Uploaded = StateComplete, s.Blobs
		}
	})
	close(j.done)
}

// Handle follows one publication.
type Handle struct{ j *job }

// ID is the published record's id.
func (h *Handle) ID() string { return h.j.m.ID }

// Status reports the publication now.
func (h *Handle) Status() Status { return h.j.status() }

// Done is closed when the publication completed or failed.
func (h *Handle) Done() <-chan struct{} { return h.j.done }

// Wait blocks until the record is complete (nil) or the publication failed
// (its error), or ctx ends.
func (h *Handle) Wait(ctx context.Context) error {
	select {
	case <-h.j.done:
		return h.j.status().Err
	case <-ctx.Done():
		return ctx.Err()
	}
}

// inFlight lists the digests of unfinished publications (kept by GC).
func (p *Publisher) inFlight() []repository.Digest {
	p.mu.Lock()
	defer p.mu.Unlock()
	var out []repository.Digest
	for _, j := range p.jobs {
		if j.status().State == StatePending {
			out = append(out, j.digests()...)
		}
	}
	slices.Sort(out)
	return slices.Compact(out)
}
