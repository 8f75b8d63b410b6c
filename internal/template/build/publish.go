package build

import (
	"context"
	"errors"

	"github.com/aenv-dev/aenv/internal/catalog"
	"github.com/aenv-dev/aenv/internal/repository"
	"github.com/aenv-dev/aenv/internal/snapshot"
)

// Publisher publishes a registered template to the shared repository
// (*snapshot.Publisher), so other nodes sharing it can create sandboxes from it, and
// removes a deleted one from it.
type Publisher interface {
	PublishTemplate(ctx context.Context, t catalog.Template, envdVersion string) (*snapshot.Handle, error)
	// Delete is snapshot.ErrNotFound for a template the repository never had.
	Delete(ctx context.Context, id string) (repository.GCResult, error)
}

// publish starts the background publication of a template the build just registered.
// The build has succeeded on this node whatever happens here, so failures are logged:
// templates captured as plain directories cannot be published at all (only sealed
// layers can), and a repository fault leaves the template local to this node.
func (s *Service) publish(ctx context.Context, t catalog.Template, envdVersion string, logf func(level, msg string)) {
	if s.cfg.Publisher == nil {
		return
	}
	_, err := s.cfg.Publisher.PublishTemplate(context.WithoutCancel(ctx), t, envdVersion)
	switch {
	case err == nil:
		logf("info", "publishing the template to the repository in the background")
	case errors.Is(err, snapshot.ErrInvalid):
		s.log.Debug("template not published: it has no sealed layers", "template", t.ID, "err", err)
	default:
		s.log.Error("publish the template; it stays usable on this node only", "template", t.ID, "err", err)
		logf("warn", "the template could not be published to the repository: "+err.Error())
	}
}

// unpublish removes a deleted template from the repository, so other nodes drop it at
// their next sync; the local delete stands whatever happens there.
func (s *Service) unpublish(ctx context.Context, id string) {
	if s.cfg.Publisher == nil {
		return
	}
	if _, err := s.cfg.Publisher.Delete(context.WithoutCancel(ctx), id); err != nil && !errors.Is(err, snapshot.ErrNotFound) {
		s.log.Error("delete the template from the repository", "template", id, "err", err)
	}
}
