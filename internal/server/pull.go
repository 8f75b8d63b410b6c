package server

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"slices"
	"strings"
	"sync"

	"github.com/google/go-containerregistry/pkg/name"

	"github.com/aenv-dev/aenv/internal/catalog"
	"github.com/aenv-dev/aenv/internal/image"
	"github.com/aenv-dev/aenv/internal/image/install"
	"github.com/aenv-dev/aenv/internal/orchestrator"
	"github.com/aenv-dev/aenv/internal/sandbox"
	"github.com/aenv-dev/aenv/internal/server/api"
	"github.com/aenv-dev/aenv/internal/snapshot"
)

// Puller configures POST /aenv/templates/pull: image pulls into the node's own catalog,
// which `aenv pull` cannot open while the node holds its lock.
type Puller struct {
	// Templates is the node's open catalog (*catalog.Templates).
	Templates install.Templates
	// DataDir is the node's data directory (images and templates live under it).
	DataDir string
	// CanConvert reports whether this node runs layered roots, which decides the default
	// of the request's convert: converting where the base template is not layered would
	// cost minutes and need FUSE and loop devices for roots the node would not use.
	CanConvert func() bool
	// DockerConfig is the docker config.json with registry credentials (default ~/.docker).
	DockerConfig string
	// Publisher, when set, publishes each converted pull (its sealed layers and config)
	// to the shared repository, as builds and snapshots are, so that other nodes sharing
	// it can create sandboxes from it (*snapshot.Publisher). Unconverted pulls are
	// directories, which cannot be published.
	Publisher TemplatePublisher
	// InUse reports whether a sandbox runs on a directory template's rootfs, which keeps
	// a replaced template's files until it is gone (nil: none does).
	InUse func(rootfsDir string) bool
	// Retired, when set, is called with a template a pull replaced: the node stops the
	// warm containers of the old version and collects the data directory's garbage
	// (build.Service.Retired).
	Retired func(ctx context.Context, old catalog.Template)
	// Capacity refuses templates whose resources the node could never give a sandbox.
	Capacity orchestrator.Capacity
	// Log receives publication and clean-up failures (default slog.Default()).
	Log *slog.Logger

	// mu serialises pulls: two pulls of one name would both pass install's name check,
	// and a replace reads and rewrites the old entry.
	mu sync.Mutex
}

func (h *handlers) PullTemplate(w http.ResponseWriter, r *http.Request) {
	p := h.s.puller
	if p == nil {
		writeError(w, http.StatusNotImplemented, "image pulls are not enabled on this node")
		return
	}
	var body api.TemplatePullRequest
	if !decodeRequired(w, r, &body) {
		return
	}
	req, err := p.request(body)
	if err != nil {
		writeError(w, http.StatusBadRequest, "%s", err.Error())
		return
	}

	w.Header().Set("Content-Type", "application/x-ndjson")
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(http.StatusOK)
	rc := http.NewResponseController(w)
	var wmu sync.Mutex
	send := func(ev api.TemplatePullEvent) {
		wmu.Lock()
		defer wmu.Unlock()
		// A client that went away cancels the request context, which stops the pull.
		if err := json.NewEncoder(w).Encode(ev); err != nil {
			return
		}
		if err := rc.Flush(); err != nil {
			slog.Debug("flush pull progress", "err", err)
		}
	}
	req.Progress = func(ev image.Progress) { send(progressEvent(ev)) }

	t, replaced, err := p.run(r.Context(), req)
	if err != nil {
		status := pullStatus(err)
		if status >= 500 {
			h.s.log.Error("pull template", "ref", req.Ref, "name", req.Name, "err", err)
		}
		send(api.TemplatePullEvent{Error: &api.Error{Code: int32(status), Message: err.Error()}})
		return
	}
	h.s.log.Info("pulled template", "ref", req.Ref, "template", t.ID, "aliases", t.Aliases,
		"converted", req.Convert, "replaced", replaced)
	names := t.Aliases
	if len(names) == 0 {
		names = []string{t.ID}
	}
	conv := req.Convert
	send(api.TemplatePullEvent{Template: &api.TemplatePullResult{TemplateID: t.ID, Names: names,
		Converted: &conv, Replaced: &replaced}})
}

// request validates the body into an install request, so that a bad one answers 400
// before the stream (and its 200) starts.
func (p *Puller) request(b api.TemplatePullRequest) (install.Request, error) {
	ref := strings.TrimSpace(b.Ref)
	if ref == "" {
		return install.Request{}, errors.New("ref is required (an image reference such as ubuntu:22.04)")
	}
	src, err := image.ParseReference(ref)
	if err != nil {
		return install.Request{}, fmt.Errorf("ref %q: %w", ref, err)
	}
	if src.Transport == image.Registry {
		if _, err := name.ParseReference(src.Ref); err != nil {
			return install.Request{}, fmt.Errorf("ref %q: %w", ref, err)
		}
	}
	req := install.Request{Ref: ref, DataDir: p.DataDir, Name: deref(b.Name),
		StartCmd: deref(b.StartCmd), ReadyCmd: deref(b.ReadyCmd),
		StartFromImage: b.StartFromImage != nil && *b.StartFromImage, User: strings.TrimSpace(deref(b.User)),
		Resources: sandbox.Resources{CPUCount: int(derefInt(b.CpuCount)), MemoryMB: int(derefInt(b.MemoryMB)),
			DiskSizeMB: int(derefInt(b.DiskSizeMB))}}
	if req.Name == "" {
		req.Name = install.DefaultName(src)
	}
	if !catalog.ValidName(req.Name) {
		return install.Request{}, fmt.Errorf("template name %q: use letters, digits, '.', '_' and '-'", req.Name)
	}
	if strings.ContainsAny(req.User, ": \t\n/") {
		return install.Request{}, fmt.Errorf("user %q: an account name or uid of the image, without a group", req.User)
	}
	r := req.Resources
	if r.CPUCount < 0 || r.MemoryMB < 0 || r.DiskSizeMB < 0 {
		return install.Request{}, errors.New("cpuCount, memoryMB and diskSizeMB must not be negative")
	}
	if err := p.Capacity.Check(r); err != nil {
		return install.Request{}, err
	}
	if b.Convert != nil {
		req.Convert = *b.Convert
	} else if p.CanConvert != nil {
		req.Convert = p.CanConvert()
	}
	req.Pull.DockerConfig = p.DockerConfig
	req.Log = p.Log
	if b.InsecureRegistries != nil {
		req.Pull.InsecureRegistries = *b.InsecureRegistries
	}
	if s := deref(b.Platform); s != "" {
		parts := strings.Split(s, "/")
		if len(parts) < 2 || len(parts) > 3 || parts[0] == "" || parts[1] == "" {
			return install.Request{}, fmt.Errorf("platform %q: want os/arch[/variant]", s)
		}
		pl := image.Platform{OS: parts[0], Architecture: parts[1]}
		if len(parts) == 3 {
			pl.Variant = parts[2]
		}
		req.Pull.Platform = &pl
	}
	return req, nil
}

// run installs req. A name that already is a template is replaced the way a rebuild
// replaces it: the new files go to a fresh directory and the catalog entry keeps its ID
// and aliases, so sandboxes on the old version keep their root and users' references
// by ID stay valid.
func (p *Puller) run(ctx context.Context, req install.Request) (catalog.Template, bool, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	old, err := p.Templates.Resolve(req.Name)
	switch {
	case errors.Is(err, catalog.ErrNotFound):
		t, err := install.Run(ctx, p.Templates, req)
		if err == nil {
			p.publish(ctx, t, req.Convert)
			p.sweep()
		}
		return t, false, err
	case err != nil:
		return catalog.Template{}, false, err
	case old.Kind != catalog.KindTemplate:
		return catalog.Template{}, false, fmt.Errorf("%w: %q is a snapshot; pick another name", catalog.ErrAliasTaken, req.Name)
	case old.ID == baseTemplateID || old.ID == minimalTemplateID:
		// The node reinstalls these at every start; a pulled one would not survive that.
		return catalog.Template{}, false, fmt.Errorf("%w: %q is a built-in template of the node; pick another name", catalog.ErrAliasTaken, req.Name)
	}
	rt := &replacing{Templates: p.Templates, name: req.Name, old: old}
	if _, err := install.Run(ctx, rt, req); err != nil {
		return catalog.Template{}, true, err
	}
	// install returns the entry as it built it, under the ID it made up.
	p.publish(ctx, rt.stored, req.Convert)
	// The old version's files go once no sandbox runs on them (at a later pull if some
	// still do now).
	if old.RootFSDir != rt.stored.RootFSDir {
		if _, err := install.Retire(p.DataDir, old.RootFSDir); err != nil {
			p.logger().Warn("retire the replaced template's files", "template", old.ID, "err", err)
		}
	}
	p.sweep()
	if p.Retired != nil {
		p.Retired(context.WithoutCancel(ctx), old)
	}
	return rt.stored, true, nil
}

// TemplatePublisher publishes a registered template to the repository in the background.
type TemplatePublisher interface {
	PublishTemplate(ctx context.Context, t catalog.Template, envdVersion string) (*snapshot.Handle, error)
}

// publish starts the background publication of a converted pull. The pull has
// succeeded on this node whatever happens there; a failure leaves it local, and says so.
func (p *Puller) publish(ctx context.Context, t catalog.Template, converted bool) {
	if p.Publisher == nil || !converted {
		return
	}
	if _, err := p.Publisher.PublishTemplate(context.WithoutCancel(ctx), t, ""); err != nil {
		p.logger().Error("publish the pulled template; it stays usable on this node only", "template", t.ID, "err", err)
	}
}

// sweep removes replaced templates' files that no sandbox uses any more.
func (p *Puller) sweep() {
	removed, err := install.SweepRetired(p.DataDir, p.InUse)
	if err != nil {
		p.logger().Warn("remove replaced templates' files", "err", err)
	}
	for _, d := range removed {
		p.logger().Info("removed a replaced template's files", "dir", d)
	}
}

func (p *Puller) logger() *slog.Logger {
	if p.Log != nil {
		return p.Log
	}
	return slog.Default()
}

// baseTemplateID and minimalTemplateID are the templates the node installs itself
// (node.ensureBaseTemplates).
const (
	baseTemplateID    = "base"
	minimalTemplateID = "base-minimal"
)

// replacing lets install.Run register over an existing template: the name reads as free,
// and the new entry takes over the old one's ID and aliases.
type replacing struct {
	install.Templates
	name   string
	old    catalog.Template
	stored catalog.Template
}

func (r *replacing) Resolve(idOrAlias string) (catalog.Template, error) {
	if idOrAlias == r.name {
		return catalog.Template{}, fmt.Errorf("template %q: %w", idOrAlias, catalog.ErrNotFound)
	}
	return r.Templates.Resolve(idOrAlias)
}

func (r *replacing) Put(t catalog.Template) error {
	t.ID = r.old.ID
	t.CreatedAt = r.old.CreatedAt
	// A name that was the old template's ID is not an alias of it.
	aliases := slices.DeleteFunc(append(t.Aliases, r.old.Aliases...), func(a string) bool { return a == t.ID })
	t.Aliases = slices.Compact(slices.Sorted(slices.Values(aliases)))
	if err := r.Templates.Put(t); err != nil {
		return err
	}
	r.stored = t
	return nil
}

// pullStatus maps install failures onto the code of the stream's error event.
func pullStatus(err error) int {
	switch {
	case errors.Is(err, catalog.ErrInvalid), errors.Is(err, image.ErrBadReference),
		errors.Is(err, image.ErrUnsupportedSource), errors.Is(err, image.ErrPlatform), errors.Is(err, install.ErrUnknownUser),
		errors.Is(err, image.ErrUnusableImage):
		return http.StatusBadRequest
	case errors.Is(err, image.ErrUnauthorized):
		return http.StatusUnauthorized
	case errors.Is(err, image.ErrNotFound):
		return http.StatusNotFound
	case errors.Is(err, catalog.ErrAliasTaken):
		return http.StatusConflict
	case errors.Is(err, context.Canceled):
		return 499
	case errors.Is(err, context.DeadlineExceeded):
		return http.StatusGatewayTimeout
	case errors.Is(err, image.ErrMissingTool):
		return http.StatusNotImplemented
	default:
		// Mostly a registry that cannot be reached or answers garbage.
		return http.StatusBadGateway
	}
}

func progressEvent(p image.Progress) api.TemplatePullEvent {
	phase, layer, layers, digest := string(p.Phase), p.Layer, p.Layers, p.Digest
	done, total, cached, final := p.Done, p.Total, p.Cached, p.Final
	ev := api.TemplatePullEvent{Phase: &phase, Layer: &layer, Layers: &layers, Done: &done, Total: &total}
	if digest != "" {
		ev.Digest = &digest
	}
	if cached {
		ev.Cached = &cached
	}
	if final {
		ev.Final = &final
	}
	return ev
}
