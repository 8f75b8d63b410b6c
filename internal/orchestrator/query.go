package orchestrator

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"time"
)

// Listing limits (e2b-protocol.md §1.6).
const (
	DefaultListLimit = 100
	MaxListLimit     = 100
)

// Get returns a sandbox's record, running or paused. Sandboxes still being created
// are not visible yet.
func (o *Orchestrator) Get(ctx context.Context, id string) (*Sandbox, error) {
	o.mu.Lock()
	defer o.mu.Unlock()
	e := o.entries[id]
	if e == nil || e.rec.State == StateCreating {
		return nil, fmt.Errorf("%w: %s", ErrNotFound, id)
	}
	return e.clone(), nil
}

// List returns one page of sandboxes matching f, ordered by StartedAt (then id)
// descending unless f.Ascending, and the token of the next page ("" when this is the
// last). Limit 0 means DefaultListLimit; outside 1..MaxListLimit, an unknown state or
// a malformed token is ErrInvalid. f.TemplateID matches a template id or alias.
// Sandboxes being created or killed are not listed.
func (o *Orchestrator) List(ctx context.Context, f ListFilter) ([]*Sandbox, string, error) {
	limit := f.Limit
	if limit == 0 {
		limit = DefaultListLimit
	}
	if limit < 1 || limit > MaxListLimit {
		return nil, "", fmt.Errorf("%w: limit must be between 1 and %d", ErrInvalid, MaxListLimit)
	}
	states := map[string]bool{}
	for _, s := range f.States {
		switch s {
		case "running", "paused":
			states[s] = true
		default:
			return nil, "", fmt.Errorf("%w: unknown state %q (want running or paused)", ErrInvalid, s)
		}
	}
	var cur *cursor
	if f.NextToken != "" {
		c, err := decodeCursor(f.NextToken)
		if err != nil {
			return nil, "", err
		}
		cur = &c
	}
	templateIDs := map[string]bool{}
	if f.TemplateID != "" {
		templateIDs[f.TemplateID] = true
		if t, err := o.cat.Templates().Resolve(f.TemplateID); err == nil {
			templateIDs[t.ID] = true
		}
	}

	o.mu.Lock()
	var items []*Sandbox
	for _, e := range o.entries {
		r := &e.rec
		if r.State == StateCreating || r.State == StateKilling {
			continue
		}
		if len(states) > 0 && !states[r.State.Public()] {
			continue
		}
		if len(templateIDs) > 0 && !templateIDs[r.TemplateID] && (r.Alias == "" || !templateIDs[r.Alias]) {
			continue
		}
		if !f.StartedAfter.IsZero() && r.StartedAt.Before(f.StartedAfter) {
			continue
		}
		if !matchMetadata(r.Metadata, f.Metadata) {
			continue
		}
		items = append(items, e.clone())
	}
	o.mu.Unlock()

	slices.SortFunc(items, func(a, b *Sandbox) int {
		c := a.StartedAt.Compare(b.StartedAt)
		if c == 0 {
			c = strings.Compare(a.ID, b.ID)
		}
		if !f.Ascending {
			c = -c
		}
		return c
	})
	if cur != nil {
		i, _ := slices.BinarySearchFunc(items, *cur, func(s *Sandbox, c cursor) int {
			k := s.StartedAt.Compare(c.startedAt)
			if k == 0 {
				k = strings.Compare(s.ID, c.id)
			}
			if !f.Ascending {
				k = -k
			}
			return k
		})
		// The cursor is the last item already returned; start after it even if it was
		// killed since.
		if i < len(items) && items[i].ID == cur.id {
			i++
		}
		items = items[i:]
	}
	next := ""
	if len(items) > limit {
		items = items[:limit]
		last := items[limit-1]
		next = encodeCursor(cursor{startedAt: last.StartedAt, id: last.ID})
	}
	return items, next, nil
}

func matchMetadata(have, want map[string]string) bool {
	for k, v := range want {
		if hv, ok := have[k]; !ok || hv != v {
			return false
		}
	}
	return true
}

// cursor is the position after which the next page starts. The token is opaque to
// clients: base64url("<RFC3339Nano startedAt>__<id>"), infra's shape.
type cursor struct {
	startedAt time.Time
	id        string
}

func encodeCursor(c cursor) string {
	return base64.RawURLEncoding.EncodeToString([]byte(c.startedAt.UTC().Format(time.RFC3339Nano) + "__" + c.id))
}

func decodeCursor(tok string) (cursor, error) {
	bad := fmt.Errorf("%w: malformed nextToken", ErrInvalid)
	raw, err := base64.RawURLEncoding.DecodeString(strings.TrimRight(tok, "="))
	if err != nil {
		return cursor{}, bad
	}
	ts, id, ok := strings.Cut(string(raw), "__")
	if !ok || id == "" {
		return cursor{}, bad
	}
	t, err := time.Parse(time.RFC3339Nano, ts)
	if err != nil {
		return cursor{}, bad
	}
	return cursor{startedAt: t, id: id}, nil
}

// encodeRecord is the catalog representation of a sandbox record.
func encodeRecord(s *Sandbox) ([]byte, error) {
	raw, err := json.Marshal(s)
	if err != nil {
		return nil, fmt.Errorf("encode sandbox %s: %w", s.ID, err)
	}
	return raw, nil
}

func decodeRecord(raw []byte) (*Sandbox, error) {
	var s Sandbox
	if err := json.Unmarshal(raw, &s); err != nil {
		return nil, fmt.Errorf("decode sandbox record: %w", err)
	}
	if s.ID == "" {
		return nil, fmt.Errorf("decode sandbox record: empty id")
	}
	return &s, nil
}
