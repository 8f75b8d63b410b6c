package orchestrator

import (
	"context"
	"errors"
	"strings"

	"github.com/aenv-dev/aenv/internal/catalog"
	"github.com/aenv-dev/aenv/internal/repository"
	"github.com/aenv-dev/aenv/internal/sandbox"
	"github.com/aenv-dev/aenv/internal/snapshot"
)

// Publisher publishes this node's snapshots to the shared repository and keeps the
// layers of sandboxes pinned in the node cache (*snapshot.Publisher). Every call is
// best effort from the orchestrator's side: the user's operation has already succeeded
// locally, so a repository fault is logged, never returned.
type Publisher interface {
	// PublishTemplate starts a background publication of a catalog entry; the handle
	// may be nil (fakes).
	PublishTemplate(ctx context.Context, t catalog.Template, envdVersion string) (*snapshot.Handle, error)
	// Delete removes id from the repository and collects the layers nothing else
	// uses; snapshot.ErrNotFound when the repository never had it.
	Delete(ctx context.Context, id string) (repository.GCResult, error)
	PinSandbox(sandboxID, templateID string) error
	UnpinSandbox(sandboxID string) error
}

// PinLister lists the owners of node-cache pins (*nodecache.Cache), so Start can drop
// the pins of sandboxes that did not survive a restart.
type PinLister interface {
	PinOwners() []string
}

// publicationPinPrefix names the pins the publisher holds for uploads in flight; they
// are the publisher's to release, not the orchestrator's.
const publicationPinPrefix = "publish-"

// WithPublisher makes the orchestrator publish snapshots through p and pin the layers
// of its sandboxes; pins (may be nil) lets Start drop stale pins. Without it nothing
// is published and nothing pinned.
func WithPublisher(p Publisher, pins PinLister) Option {
	return func(o *Orchestrator) { o.pub, o.pins = p, pins }
}

// Publication states reported in SnapshotInfo.Publication.
const (
	// PublicationNone: not published (no repository, or the backend's capture has no
	// sealed layers to publish); the snapshot is usable on this node only.
	PublicationNone = ""
	// PublicationPending: uploading; other nodes see the snapshot once it completes.
	PublicationPending = "pending"
	// PublicationFailed: the publication could not start; this node retries nothing.
	PublicationFailed = "failed"
)

// publish starts publishing a template or snapshot just registered in the catalog and
// reports the publication state. Captures without sealed layers (directory roots)
// cannot be published and are not an error.
func (o *Orchestrator) publish(ctx context.Context, t catalog.Template, envdVersion string) string {
	if o.pub == nil {
		return PublicationNone
	}
	_, err := o.pub.PublishTemplate(context.WithoutCancel(ctx), t, envdVersion)
	switch {
	case err == nil:
		return PublicationPending
	case errors.Is(err, snapshot.ErrInvalid):
		o.log.Debug("not publishing: nothing the repository can hold", "template", t.ID, "err", err)
		return PublicationNone
	default:
		o.log.Error("publish to the repository; the snapshot stays usable on this node", "template", t.ID, "err", err)
		return PublicationFailed
	}
}

// unpublish removes a deleted template or snapshot from the repository.
func (o *Orchestrator) unpublish(ctx context.Context, id string) {
	if o.pub == nil {
		return
	}
	if _, err := o.pub.Delete(context.WithoutCancel(ctx), id); err != nil && !errors.Is(err, snapshot.ErrNotFound) {
		o.log.Error("delete from the repository", "template", id, "err", err)
	}
}

// pin keeps the repository layers of the template a sandbox runs on in the node cache
// while the sandbox exists (live or paused).
func (o *Orchestrator) pin(sandboxID, templateID string) {
	if o.pub == nil || templateID == "" {
		return
	}
	if err := o.pub.PinSandbox(sandboxID, templateID); err != nil {
		o.log.Warn("pin the sandbox's layers", "sandbox", sandboxID, "template", templateID, "err", err)
	}
}

func (o *Orchestrator) unpin(sandboxID string) {
	if o.pub == nil {
		return
	}
	if err := o.pub.UnpinSandbox(sandboxID); err != nil {
		o.log.Warn("unpin the sandbox's layers", "sandbox", sandboxID, "err", err)
	}
}

// reconcilePins runs at Start, after the sandboxes are loaded: pins of sandboxes that
// are gone are dropped (their layers become evictable) and kept sandboxes without pins
// (created before the node had a repository) get theirs.
func (o *Orchestrator) reconcilePins() {
	if o.pub == nil {
		return
	}
	o.mu.Lock()
	templates := make(map[string]string, len(o.entries))
	for id, e := range o.entries {
		templates[id] = e.rec.TemplateID
	}
	o.mu.Unlock()
	var owners []string
	if o.pins != nil {
		owners = o.pins.PinOwners()
	}
	pinned := map[string]bool{}
	for _, owner := range owners {
		pinned[owner] = true
		if _, ok := templates[owner]; ok || strings.HasPrefix(owner, publicationPinPrefix) {
			continue
		}
		o.unpin(owner)
	}
	for id, tpl := range templates {
		if !pinned[id] {
			o.pin(id, tpl)
		}
	}
}

// UsesTemplate reports whether a sandbox of this node (in any state, paused included)
// runs on template or snapshot id, directly or as the snapshot it was created from. The
// publisher's sync keeps such an entry in the catalog after its record was deleted
// elsewhere, until no sandbox uses it.
func (o *Orchestrator) UsesTemplate(id string) bool {
	o.mu.Lock()
	defer o.mu.Unlock()
	for _, e := range o.entries {
		if e.rec.TemplateID == id || e.rec.Launch.ParentSnapshot == id || e.rec.Launch.Adopted == id {
			return true
		}
	}
	return false
}

// DiscardTemplate tells the backend that a template or snapshot removed from the
// catalog by someone else (the publisher's sync, after another node deleted it) is no
// longer referenced, so it frees the capture's artifacts that nothing else uses.
func (o *Orchestrator) DiscardTemplate(ctx context.Context, t catalog.Template) {
	if t.Kind == catalog.KindTemplate {
		o.ForgetWarm(ctx, t)
		o.discardBuiltTemplate(ctx, t)
		return
	}
	if t.Kind != catalog.KindSnapshot || len(t.Artifact) == 0 {
		return
	}
	if _, ok := o.backend.(sandbox.SnapshotDiscarder); !ok || (t.Backend != "" && t.Backend != o.backend.Name()) {
		return
	}
	c, err := o.backend.DecodeCaptured(t.Artifact)
	if err != nil {
		// The record is gone; the backend's reconcile drops what nothing references.
		o.log.Error("decode deleted snapshot for discard", "snapshot", t.ID, "err", err)
		return
	}
	o.discardCapture(ctx, c)
}

// ForgetWarm tells the backend that template t was deleted or replaced by a new version,
// so the warm containers it keeps for t's root stop now instead of holding the old
// layers or directory (and their disk space, mounts and loop devices) until pushed out.
func (o *Orchestrator) ForgetWarm(ctx context.Context, t catalog.Template) {
	f, ok := o.backend.(sandbox.WarmForgetter)
	if !ok || t.Kind != catalog.KindTemplate {
		return
	}
	// A root that cannot be described any more (its artifact is unreadable) still has
	// its warm containers dropped: the backend drops those whose files are missing.
	root, err := o.templateRoot(t)
	if err != nil {
		root = sandbox.RootFS{LowerDir: o.directory(t.RootFSDir)}
	}
	if err := f.ForgetTemplate(context.WithoutCancel(ctx), root); err != nil {
		o.log.Warn("stop the warm containers of a removed template", "template", t.ID, "err", err)
	}
}
