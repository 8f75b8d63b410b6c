package snapshot

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"strings"

	"github.com/aenv-dev/aenv/internal/repository"
)

// tracked is what this node knows of a record it published or synced:
// enough to notice the record's deletion or a new revision, and to know
// which fetched layers are still needed.
type tracked struct {
	ID       string              `json:"id"`
	Kind     repository.Kind     `json:"kind"`
	Revision int64               `json:"revision"`
	Local    bool                `json:"local"` // published by this node (else synced)
	Digests  []repository.Digest `json:"digests"`
}

func (p *Publisher) track(t tracked) error {
	b, err := json.Marshal(t)
	if err == nil {
		err = writeFileAtomic(p.path("records", t.ID+".json"), b)
	}
	if err != nil {
		return fmt.Errorf("snapshot: track %s: %w", t.ID, err)
	}
	return nil
}

func (p *Publisher) untrack(id string) error {
	if err := os.Remove(p.path("records", id+".json")); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("snapshot: untrack %s: %w", id, err)
	}
	return nil
}

func (p *Publisher) tracked(id string) (tracked, bool) {
	b, err := os.ReadFile(p.path("records", id+".json"))
	var t tracked
	if err != nil || json.Unmarshal(b, &t) != nil || t.ID != id {
		return tracked{}, false
	}
	return t, true
}

// trackedAll reads every tracked record; unreadable ones are skipped with a
// warning (they are rewritten by the next sync that sees their record).
func (p *Publisher) trackedAll() (map[string]tracked, error) {
	ents, err := os.ReadDir(p.path("records"))
	if err != nil {
		return nil, fmt.Errorf("snapshot: %w", err)
	}
	out := map[string]tracked{}
	for _, e := range ents {
		id, ok := strings.CutSuffix(e.Name(), ".json")
		if !ok {
			continue
		}
		if t, ok := p.tracked(id); ok {
			out[id] = t
		} else {
			p.log.Warn("snapshot: unreadable tracked record", "id", id)
		}
	}
	return out, nil
}

func (p *Publisher) journaled(id string) bool {
	_, err := os.Stat(p.path("publishing", id+".json"))
	return err == nil
}

// Knows reports whether this node's publisher has id: a publication in
// flight or journaled, or a record it published or synced. A snapshot in
// the catalog it does not know was registered but never handed to it (the
// node died in between), or its publication failed for good.
func (p *Publisher) Knows(id string) bool {
	p.mu.Lock()
	j := p.jobs[id]
	p.mu.Unlock()
	if j != nil || p.journaled(id) {
		return true
	}
	_, ok := p.tracked(id)
	return ok
}
