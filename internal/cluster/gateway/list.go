package gateway

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sync/errgroup"
)

// listed is one item of a node's list answer with the keys it is ordered by.
type listed struct {
	raw json.RawMessage
	at  time.Time
	id  string
}

// page is one node's answer to a list call.
type page struct {
	items []listed
	more  bool // the node sent X-Next-Token
}

// listSchema names the JSON fields a list is ordered by: nodes order by (time, id),
// newest first unless asked otherwise, and their paging token is the last item's
// (time, id) — the same on every node, which is what makes a merged cursor possible.
type listSchema struct {
	timeField, idField string
}

var (
	sandboxList  = listSchema{"startedAt", "sandboxID"}
	snapshotList = listSchema{"createdAt", "snapshotID"}
)

func (g *Gateway) listSandboxes(w http.ResponseWriter, r *http.Request, paged bool) {
	asc := r.URL.Query().Get("order") == "asc"
	g.mergedList(w, r, sandboxList, paged, asc)
}

func (g *Gateway) listSnapshots(w http.ResponseWriter, r *http.Request) {
	g.mergedList(w, r, snapshotList, true, false)
}

// mergedList sends the list call, as it is, to every live node and merges the answers:
// every node returns its first `limit` items after the cursor, so the first `limit` of
// their union are the cluster's page, and the last of them is the next cursor. All or
// nothing: a live node that fails fails the list, so a page never silently lacks a node.
func (g *Gateway) mergedList(w http.ResponseWriter, r *http.Request, s listSchema, paged, asc bool) {
	limit := 100
	if v := r.URL.Query().Get("limit"); v != "" && paged {
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 || n > 100 {
			writeError(w, http.StatusBadRequest, "limit must be between 1 and 100, got %q", v)
			return
		}
		limit = n
	}
	nodes, err := g.liveNodes(r.Context())
	if err != nil {
		g.schedulerError(w, "list nodes", err)
		return
	}
	pages := make([]page, len(nodes))
	eg, ctx := errgroup.WithContext(r.Context())
	for i, t := range nodes {
		eg.Go(func() error {
			p, err := g.fetchPage(ctx, r, t, s)
			if err != nil {
				return err
			}
			pages[i] = p
			return nil
		})
	}
	if err := eg.Wait(); err != nil {
		if nodeErr := (*nodeAnswer)(nil); errors.As(err, &nodeErr) && nodeErr.status == http.StatusBadRequest {
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(nodeErr.status)
			_, _ = w.Write(nodeErr.body)
			return
		}
		writeError(w, http.StatusBadGateway, "list across the cluster: %v", err)
		return
	}
	items, more := merge(pages, limit, asc, paged)
	out := make([]json.RawMessage, len(items))
	for i, it := range items {
		out[i] = it.raw
	}
	if more && len(items) > 0 {
		last := items[len(items)-1]
		w.Header().Set("X-Next-Token", encodeCursor(last.at, last.id))
	}
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(out)
}

// merge orders the union of pages (duplicates, such as snapshots every node syncs from
// the repository, once), cuts it at limit when paged, and says whether more exist.
func merge(pages []page, limit int, asc, paged bool) ([]listed, bool) {
	seen := map[string]bool{}
	var all []listed
	more := false
	for _, p := range pages {
		more = more || p.more
		for _, it := range p.items {
			if !seen[it.id] {
				seen[it.id] = true
				all = append(all, it)
			}
		}
	}
	slices.SortFunc(all, func(a, b listed) int {
		c := a.at.Compare(b.at)
		if c == 0 {
			c = strings.Compare(a.id, b.id)
		}
		if !asc {
			c = -c
		}
		return c
	})
	if paged && len(all) > limit {
		return all[:limit], true
	}
	return all, paged && more
}

// nodeAnswer is a node's non-200 answer to a list call.
type nodeAnswer struct {
	node   string
	status int
	body   []byte
}

func (e *nodeAnswer) Error() string {
	return fmt.Sprintf("node %s answered %d: %s", e.node, e.status, strings.TrimSpace(string(e.body)))
}

func (g *Gateway) fetchPage(ctx context.Context, r *http.Request, t *target, s listSchema) (page, error) {
	u := *t.base
	u.Path, u.RawQuery = r.URL.Path, r.URL.RawQuery
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u.String(), nil)
	if err != nil {
		return page{}, err
	}
	req.Header.Set("X-API-Key", r.Header.Get("X-API-Key"))
	resp, err := g.client.Do(req)
	if err != nil {
		return page{}, fmt.Errorf("node %s: %w", t.node, err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, 64<<20))
	if err != nil {
		return page{}, fmt.Errorf("node %s: read the list: %w", t.node, err)
	}
	if resp.StatusCode != http.StatusOK {
		return page{}, &nodeAnswer{node: t.node, status: resp.StatusCode, body: body}
	}
	var raws []json.RawMessage
	if err := json.Unmarshal(body, &raws); err != nil {
		return page{}, fmt.Errorf("node %s: the list is not a JSON array: %w", t.node, err)
	}
	p := page{items: make([]listed, 0, len(raws)), more: resp.Header.Get("X-Next-Token") != ""}
	for _, raw := range raws {
		var keys map[string]any
		if err := json.Unmarshal(raw, &keys); err != nil {
			return page{}, fmt.Errorf("node %s: list item: %w", t.node, err)
		}
		id, _ := keys[s.idField].(string)
		ts, _ := keys[s.timeField].(string)
		at, err := time.Parse(time.RFC3339Nano, ts)
		if id == "" || err != nil {
			return page{}, fmt.Errorf("node %s: list item without %s and %s", t.node, s.idField, s.timeField)
		}
		p.items = append(p.items, listed{raw: raw, at: at, id: id})
	}
	return p, nil
}

// encodeCursor makes the nodes' paging token for the position after (at, id):
// base64url("<RFC3339Nano UTC>__<id>"), as internal/orchestrator's cursor.
func encodeCursor(at time.Time, id string) string {
	return base64.RawURLEncoding.EncodeToString([]byte(at.UTC().Format(time.RFC3339Nano) + "__" + id))
}
