package build

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/aenv-dev/aenv/internal/catalog"
)

// DefaultTag is the tag a build gets when its request names none (E2B's default).
const DefaultTag = "default"

var tagName = regexp.MustCompile(`^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$`)

// Tag names one build of a template (GET /templates/{id}/tags).
type Tag struct {
	Tag       string    `json:"tag"`
	BuildID   string    `json:"buildID"`
	CreatedAt time.Time `json:"createdAt"`
}

// tagStore keeps the tags of every template in one JSON file: tags change rarely and
// the whole set is small, so it is rewritten (atomically) on each change.
type tagStore struct {
	path string
	mu   sync.Mutex
	tags map[string]map[string]Tag // template ID → tag → Tag
}

func openTagStore(path string) (*tagStore, error) {
	t := &tagStore{path: path, tags: map[string]map[string]Tag{}}
	raw, err := os.ReadFile(path)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return t, nil
	case err != nil:
		return nil, fmt.Errorf("template tags: %w", err)
	}
	if err := json.Unmarshal(raw, &t.tags); err != nil {
		return nil, fmt.Errorf("template tags %s: %w", path, err)
	}
	return t, nil
}

// saveLocked writes the tags; the caller holds mu.
func (t *tagStore) saveLocked() error {
	raw, err := json.Marshal(t.tags)
	if err != nil {
		return err
	}
	tmp := t.path + ".tmp"
	if err := os.WriteFile(tmp, raw, 0o600); err != nil {
		return fmt.Errorf("save template tags: %w", err)
	}
	if err := os.Rename(tmp, t.path); err != nil {
		os.Remove(tmp)
		return fmt.Errorf("save template tags: %w", err)
	}
	return nil
}

// assign points tags of a template at buildID, moving them from other builds.
func (t *tagStore) assign(templateID, buildID string, tags []string) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	m := t.tags[templateID]
	if m == nil {
		m = map[string]Tag{}
		t.tags[templateID] = m
	}
	now := time.Now().UTC()
	for _, tg := range tags {
		m[tg] = Tag{Tag: tg, BuildID: buildID, CreatedAt: now}
	}
	return t.saveLocked()
}

// remove drops tags of a template; all must exist, else nothing changes.
func (t *tagStore) remove(templateID string, tags []string) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	m := t.tags[templateID]
	for _, tg := range tags {
		if _, ok := m[tg]; !ok {
			return fmt.Errorf("tag %q of template %s: %w", tg, templateID, ErrNotFound)
		}
	}
	for _, tg := range tags {
		delete(m, tg)
	}
	if len(m) == 0 {
		delete(t.tags, templateID)
	}
	return t.saveLocked()
}

func (t *tagStore) get(templateID, tag string) (Tag, bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	tg, ok := t.tags[templateID][tag]
	return tg, ok
}

func (t *tagStore) list(templateID string) []Tag {
	t.mu.Lock()
	defer t.mu.Unlock()
	out := make([]Tag, 0, len(t.tags[templateID]))
	for _, tg := range t.tags[templateID] {
		out = append(out, tg)
	}
	slices.SortFunc(out, func(a, b Tag) int { return strings.Compare(a.Tag, b.Tag) })
	return out
}

func (t *tagStore) forget(templateID string) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	if _, ok := t.tags[templateID]; !ok {
		return nil
	}
	delete(t.tags, templateID)
	return t.saveLocked()
}

// validTags refuses a tag that is not a valid tag name.
func validTags(tags []string) error {
	for _, tg := range tags {
		if !tagName.MatchString(tg) {
			return fmt.Errorf("%w: tag %q (letters, digits, '.', '_', '-'; at most 128)", ErrInvalidSpec, tg)
		}
	}
	return nil
}

// requestTags splits E2B's "name:tag" and merges it with the request's tags; a request
// with none gets DefaultTag.
func requestTags(nameTag string, extra []string) (string, []string, error) {
	name, tag, hasTag := strings.Cut(nameTag, ":")
	var tags []string
	if hasTag {
		tags = append(tags, tag)
	}
	tags = append(tags, extra...)
	if len(tags) == 0 {
		tags = []string{DefaultTag}
	}
	if err := validTags(tags); err != nil {
		return "", nil, err
	}
	slices.Sort(tags)
	return name, slices.Compact(tags), nil
}

// tagBuild gives a build that became ready the tags its request asked for.
func (s *Service) tagBuild(r Record) {
	if len(r.Tags) == 0 {
		return
	}
	if err := s.tags.assign(r.TemplateID, r.ID, r.Tags); err != nil {
		s.log.Error("tag the build", "build", r.ID, "err", err)
		s.store.log(r.ID, "error", "could not record the build's tags: "+err.Error())
		return
	}
	s.store.log(r.ID, "info", "tagged "+strings.Join(r.Tags, ", "))
}

// AssignTags gives more tags to the build that target ("name:tag", or "name" for its
// default tag) names: POST /templates/tags. It returns that build's ID and the tags.
func (s *Service) AssignTags(target string, tags []string) (string, []string, error) {
	name, tag, hasTag := strings.Cut(target, ":")
	if !hasTag {
		tag = DefaultTag
	}
	if len(tags) == 0 {
		return "", nil, fmt.Errorf("%w: no tags given", ErrInvalidSpec)
	}
	if err := validTags(tags); err != nil {
		return "", nil, err
	}
	t, err := s.Resolve(name)
	if err != nil {
		return "", nil, err
	}
	cur, ok := s.tags.get(t.ID, tag)
	if !ok {
		return "", nil, fmt.Errorf("tag %q of template %s: %w", tag, name, ErrNotFound)
	}
	if err := s.tags.assign(t.ID, cur.BuildID, tags); err != nil {
		return "", nil, err
	}
	return cur.BuildID, tags, nil
}

// RemoveTags removes tags from the template called name: DELETE /templates/tags.
// Unknown tags are ErrNotFound and remove nothing.
func (s *Service) RemoveTags(name string, tags []string) error {
	if len(tags) == 0 {
		return fmt.Errorf("%w: no tags given", ErrInvalidSpec)
	}
	t, err := s.Resolve(name)
	if err != nil {
		return err
	}
	return s.tags.remove(t.ID, tags)
}

// Tags lists a template's tags by name (GET /templates/{id}/tags).
func (s *Service) Tags(idOrAlias string) ([]Tag, error) {
	t, err := s.Resolve(idOrAlias)
	if err != nil {
		return nil, err
	}
	return s.tags.list(t.ID), nil
}

// ResolveTag resolves "name:tag" to the template when it has that tag, and a name
// without a tag as Resolve does. Unknown names and tags are ErrNotFound.
func (s *Service) ResolveTag(nameTag string) (catalog.Template, error) {
	name, tag, hasTag := strings.Cut(nameTag, ":")
	t, err := s.Resolve(name)
	if err != nil || !hasTag {
		return t, err
	}
	tg, ok := s.tags.get(t.ID, tag)
	if !ok {
		return catalog.Template{}, fmt.Errorf("tag %q of template %s: %w", tag, name, ErrNotFound)
	}
	// A node keeps only a template's newest build; a tag left on an older one names
	// files that are gone.
	if cur := s.currentBuild(t.ID); cur != "" && cur != tg.BuildID {
		return catalog.Template{}, fmt.Errorf("tag %q of template %s names build %s, which a newer build replaced "+
			"(only the newest build runs; move the tag with POST /templates/tags): %w", tag, name, tg.BuildID, ErrNotFound)
	}
	return t, nil
}

// currentBuild is the ID of templateID's newest ready build, or "" when it has none
// (a template made by `aenv pull` or a snapshot).
func (s *Service) currentBuild(templateID string) string {
	var id string
	var at time.Time
	for _, r := range s.Builds(templateID) {
		if r.Status == StatusReady && !r.FinishedAt.Before(at) {
			id, at = r.ID, r.FinishedAt
		}
	}
	return id
}

// tagsPath is where a data directory keeps template tags (not *.json: the build
// record store owns those names).
func tagsPath(dataDir string) string { return filepath.Join(dataDir, "builds", "template-tags") }
