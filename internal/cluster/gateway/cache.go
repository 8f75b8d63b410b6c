package gateway

import (
	"sync"
	"time"
)

// lookupTTL is how long the gateway reuses a sandbox's node without asking the scheduler:
// short enough that a node's death shows as "lost" within a moment, long enough that the
// many calls of one command (start, stream, input) cost one lookup.
const lookupTTL = time.Second

// routeCache remembers recent sandbox → node answers. It is soft state: losing it costs a
// lookup, and a forward that fails drops the entry.
type routeCache struct {
	mu sync.Mutex
	m  map[string]cachedRoute
}

type cachedRoute struct {
	t       *target
	expires time.Time
}

func (c *routeCache) get(id string, now time.Time) *target {
	c.mu.Lock()
	defer c.mu.Unlock()
	e, ok := c.m[id]
	if !ok || now.After(e.expires) {
		return nil
	}
	return e.t
}

func (c *routeCache) put(id string, t *target, now time.Time) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.m == nil || len(c.m) > 100_000 {
		c.m = map[string]cachedRoute{} // crude bound; entries live a second anyway
	}
	c.m[id] = cachedRoute{t: t, expires: now.Add(lookupTTL)}
}

func (c *routeCache) drop(id string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	delete(c.m, id)
}
