package build

import (
	"context"
	"sync"

	"github.com/aenv-dev/aenv/internal/catalog"
	"github.com/aenv-dev/aenv/internal/repository"
	"github.com/aenv-dev/aenv/internal/snapshot"
)

// recordingPublisher records the templates a build publishes and whether each was
// already in the catalog (tpls) at the time.
type recordingPublisher struct {
	tpls      Templates
	mu        sync.Mutex
	published []catalog.Template
	inCatalog []bool
	deleted   []string
}

func (p *recordingPublisher) PublishTemplate(_ context.Context, t catalog.Template, _ string) (*snapshot.Handle, error) {
	_, err := p.tpls.Get(t.ID)
	p.mu.Lock()
	defer p.mu.Unlock()
	p.published = append(p.published, t)
	p.inCatalog = append(p.inCatalog, err == nil)
	return nil, nil
}

func (p *recordingPublisher) Delete(_ context.Context, id string) (repository.GCResult, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.deleted = append(p.deleted, id)
	return repository.GCResult{}, nil
}

func (p *recordingPublisher) calls() ([]catalog.Template, []bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]catalog.Template(nil), p.published...), append([]bool(nil), p.inCatalog...)
}

func (p *recordingPublisher) deletes() []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]string(nil), p.deleted...)
}
