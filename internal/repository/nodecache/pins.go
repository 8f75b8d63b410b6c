package nodecache

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"

	"github.com/aenv-dev/aenv/internal/repository"
)

// Pins are named sets of digests that eviction skips and that the node
// reports to GC. An owner is whatever holds the layers: a sandbox id (live
// or paused), "publish-<snapshot id>" for an upload in flight. Pin sets are
// persisted, so a paused sandbox keeps its layers across a restart; the
// node's startup reconciler unpins owners that no longer exist.
type pinFile struct {
	Digests []repository.Digest `json:"digests"`
}

// Pin replaces owner's pin set with digests (which need not be cached yet).
func (c *Cache) Pin(owner string, digests ...repository.Digest) error {
	if err := repository.ValidateID(owner); err != nil {
		return fmt.Errorf("nodecache: pin owner: %w", err)
	}
	for _, d := range digests {
		if err := d.Validate(); err != nil {
			return err
		}
	}
	set := slices.Clone(digests)
	slices.Sort(set)
	set = slices.Compact(set)
	b, _ := json.Marshal(pinFile{Digests: set})
	c.mu.Lock()
	defer c.mu.Unlock()
	if err := c.writePinLocked(owner, b); err != nil {
		return err
	}
	c.setPinsLocked(owner, set)
	return nil
}

// Unpin drops owner's pin set; unknown owners are not an error.
func (c *Cache) Unpin(owner string) error {
	if err := repository.ValidateID(owner); err != nil {
		return fmt.Errorf("nodecache: pin owner: %w", err)
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if err := os.Remove(c.path("pins", owner+".json")); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("nodecache: unpin %s: %w", owner, err)
	}
	c.setPinsLocked(owner, nil)
	c.evictLocked(c.highBytes())
	return nil
}

// Pinned is the union of every owner's pins, for repository.GCOptions.
func (c *Cache) Pinned() []repository.Digest {
	c.mu.Lock()
	defer c.mu.Unlock()
	out := make([]repository.Digest, 0, len(c.pinCount))
	for d := range c.pinCount {
		out = append(out, d)
	}
	slices.Sort(out)
	return out
}

// PinOwners lists the owners holding pins.
func (c *Cache) PinOwners() []string {
	c.mu.Lock()
	defer c.mu.Unlock()
	out := make([]string, 0, len(c.pins))
	for o := range c.pins {
		out = append(out, o)
	}
	sort.Strings(out)
	return out
}

func (c *Cache) setPinsLocked(owner string, set []repository.Digest) {
	for _, d := range c.pins[owner] {
		if c.pinCount[d]--; c.pinCount[d] <= 0 {
			delete(c.pinCount, d)
		}
	}
	delete(c.pins, owner)
	if len(set) == 0 {
		return
	}
	c.pins[owner] = set
	for _, d := range set {
		c.pinCount[d]++
	}
}

func (c *Cache) writePinLocked(owner string, b []byte) error {
	f, err := os.CreateTemp(c.path("tmp"), "pin-*")
	if err != nil {
		return fmt.Errorf("nodecache: %w", err)
	}
	_, err = f.Write(b)
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(f.Name(), c.path("pins", owner+".json"))
	}
	if err != nil {
		os.Remove(f.Name())
		return fmt.Errorf("nodecache: pin %s: %w", owner, err)
	}
	if d, err := os.Open(c.path("pins")); err == nil {
		_ = d.Sync()
		d.Close()
	}
	return nil
}

// loadPins reads the persisted pin sets; an unreadable one is an error
// rather than silently unpinned (its layers might be evicted).
func (c *Cache) loadPins() error {
	ents, err := os.ReadDir(c.path("pins"))
	if err != nil {
		return fmt.Errorf("nodecache: %w", err)
	}
	for _, e := range ents {
		owner, ok := strings.CutSuffix(e.Name(), ".json")
		if !ok || repository.ValidateID(owner) != nil {
			continue
		}
		b, err := os.ReadFile(filepath.Join(c.path("pins"), e.Name()))
		if err != nil {
			return fmt.Errorf("nodecache: pins of %s: %w", owner, err)
		}
		var pf pinFile
		if err := json.Unmarshal(b, &pf); err != nil {
			return fmt.Errorf("%w: nodecache pins of %s: %v", repository.ErrInvalid, owner, err)
		}
		for _, d := range pf.Digests {
			if err := d.Validate(); err != nil {
				return fmt.Errorf("nodecache: pins of %s: %w", owner, err)
			}
		}
		c.setPinsLocked(owner, pf.Digests)
	}
	return nil
}
