package snapshot

import (
	"errors"
	"fmt"
	"slices"

	"github.com/aenv-dev/aenv/internal/catalog"
)

// Names across nodes. A name is unique in a node's catalog, and a node refuses a name
// its catalog already holds, which includes every complete record synced from the
// repository. Two nodes may still give the same name to two snapshots within one sync
// interval, before either has seen the other's. Every node then settles the clash the
// same way: the name belongs to the older entry of the same kind (earlier CreatedAt,
// which the record carries from the node that made it, then the smaller id); the other
// stays reachable by its id. So all nodes sharing a repository resolve a name alike once
// they have synced.

// resolver finds a catalog entry by id or name (*catalog.Templates).
type resolver interface {
	Resolve(idOrAlias string) (catalog.Template, error)
}

// putNamed puts t, an entry synced from the repository, into the catalog, settling a
// clash over its name as described above.
func (p *Publisher) putNamed(t catalog.Template) error {
	err := p.cat.Put(t)
	if !errors.Is(err, catalog.ErrAliasTaken) || len(t.Aliases) == 0 {
		return err
	}
	name := t.Aliases[0]
	if r, ok := p.cat.(resolver); ok {
		holder, rerr := r.Resolve(name)
		if rerr == nil && holder.ID != name && holder.ID != t.ID && holder.Kind == t.Kind &&
			slices.Contains(holder.Aliases, name) && older(t, holder) {
			holder.Aliases = slices.DeleteFunc(holder.Aliases, func(a string) bool { return a == name })
			if err := p.cat.Put(holder); err != nil {
				return fmt.Errorf("snapshot: hand name %q from %s to the older %s: %w", name, holder.ID, t.ID, err)
			}
			p.log.Warn("snapshot: two snapshots share a name; the older keeps it, the other is reachable by id",
				"name", name, "kept_by", t.ID, "by_id_only", holder.ID)
			if err = p.cat.Put(t); !errors.Is(err, catalog.ErrAliasTaken) {
				return err
			}
		}
	}
	// The name stays with the entry that holds it: keep ours reachable by id.
	p.log.Warn("snapshot: name taken on this node; registering by id only", "id", t.ID, "name", name)
	t.Aliases = nil
	return p.cat.Put(t)
}

// older reports whether a was created before b (ties: the smaller id).
func older(a, b catalog.Template) bool {
	if c := a.CreatedAt.Compare(b.CreatedAt); c != 0 {
		return c < 0
	}
	return a.ID < b.ID
}
