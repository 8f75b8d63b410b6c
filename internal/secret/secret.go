// Package secret keeps the node's secrets (E2B's Secret API): named values, write-only
// through the API, stored encrypted at rest with AES-256-GCM under a node key (a 0600 file
// made on first use), scoped to an owner (the API key that made them), and injected into
// sandboxes by expanding ${e2b.secrets.<name>} placeholders (Expand).
//
// A value never leaves this package except through Expand and Value, whose callers hand
// it to a sandbox; it is never logged and never part of an error.
package secret

import (
	"crypto/aes"
	"crypto/cipher"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/aenv-dev/aenv/internal/atomicfile"
)

// Errors the API maps to statuses.
var (
	ErrNotFound = errors.New("secret not found")       // 404
	ErrExists   = errors.New("secret already exists")  // 409
	ErrInvalid  = errors.New("invalid secret request") // 400
)

// Limits (E2B's documented metadata limits; the value limit is aenv's).
const (
	MaxValueBytes       = 64 << 10
	MaxMetadataEntries  = 32
	MaxMetadataKeyBytes = 128
	MaxMetadataValBytes = 1024
	MaxMetadataBytes    = 8192
	MaxPerOwner         = 1000
	MaxListLimit        = 1000
	DefaultListLimit    = 100
)

var (
	nameRE        = regexp.MustCompile(`^[a-z0-9][a-z0-9._-]{0,127}$`)
	placeholderRE = regexp.MustCompile(`\$\{e2b\.secrets\.([^{}]*)\}`)
)

// Info is a secret's metadata: everything but its value.
type Info struct {
	ID        string            `json:"id"`
	Name      string            `json:"name"`
	Owner     string            `json:"owner"`
	Version   int64             `json:"version"`
	Metadata  map[string]string `json:"metadata"`
	CreatedAt time.Time         `json:"createdAt"`
	UpdatedAt time.Time         `json:"updatedAt"`
}

type record struct {
	Info
	// Sealed is nonce || AES-GCM(value), authenticated with the owner, id and version.
	Sealed []byte `json:"sealed"`
}

// Store holds the secrets of one node in one encrypted file.
type Store struct {
	path string
	aead cipher.AEAD

	mu   sync.Mutex
	recs map[string]*record // by id
}

// Open loads the store kept in dir (created when missing), making the node key
// dir/node.key on first use.
func Open(dir string) (*Store, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("secret: %w", err)
	}
	key, err := loadKey(filepath.Join(dir, "node.key"))
	if err != nil {
		return nil, err
	}
	blk, err := aes.NewCipher(key)
	if err != nil {
		return nil, fmt.Errorf("secret: %w", err)
	}
	aead, err := cipher.NewGCM(blk)
	if err != nil {
		return nil, fmt.Errorf("secret: %w", err)
	}
	s := &Store{path: filepath.Join(dir, "secrets.json"), aead: aead, recs: map[string]*record{}}
	raw, err := os.ReadFile(s.path)
	if errors.Is(err, os.ErrNotExist) {
		return s, nil
	}
	if err != nil {
		return nil, fmt.Errorf("secret: %w", err)
	}
	var recs []*record
	if err := json.Unmarshal(raw, &recs); err != nil {
		return nil, fmt.Errorf("secret: %s is damaged: %w", s.path, err)
	}
	for _, r := range recs {
		s.recs[r.ID] = r
	}
	return s, nil
}

// loadKey reads the 32-byte key at path or writes a new one with mode 0600.
func loadKey(path string) ([]byte, error) {
	raw, err := os.ReadFile(path)
	switch {
	case err == nil && len(raw) == 32:
		return raw, nil
	case err == nil:
		return nil, fmt.Errorf("secret: node key %s has %d bytes, want 32", path, len(raw))
	case !errors.Is(err, os.ErrNotExist):
		return nil, fmt.Errorf("secret: node key: %w", err)
	}
	key := make([]byte, 32)
	rand.Read(key)
	if err := atomicfile.WriteFile(path, key, 0o600); err != nil {
		return nil, fmt.Errorf("secret: node key: %w", err)
	}
	return key, nil
}

// CanonicalName lower-cases name and checks it.
func CanonicalName(name string) (string, error) {
	n := strings.ToLower(strings.TrimSpace(name))
	if strings.HasPrefix(n, "sec_") {
		return "", fmt.Errorf("%w: the sec_ prefix is reserved for secret ids", ErrInvalid)
	}
	if !nameRE.MatchString(n) {
		return "", fmt.Errorf("%w: secret name %q must be 1 to 128 lowercase letters, digits, '.', '_' or '-', starting with a letter or digit", ErrInvalid, name)
	}
	return n, nil
}

func checkValue(v string) error {
	if v == "" {
		return fmt.Errorf("%w: value is required", ErrInvalid)
	}
	if len(v) > MaxValueBytes {
		return fmt.Errorf("%w: value is %d bytes; the limit is %d", ErrInvalid, len(v), MaxValueBytes)
	}
	if strings.ContainsRune(v, 0) {
		return fmt.Errorf("%w: value must not contain NUL (it may become an environment variable)", ErrInvalid)
	}
	return nil
}

// CheckMetadata applies E2B's metadata limits.
func CheckMetadata(m map[string]string) error {
	if len(m) > MaxMetadataEntries {
		return fmt.Errorf("%w: metadata has %d entries; the limit is %d", ErrInvalid, len(m), MaxMetadataEntries)
	}
	total := 0
	for k, v := range m {
		if k == "" || len(k) > MaxMetadataKeyBytes {
			return fmt.Errorf("%w: metadata keys must be 1 to %d bytes", ErrInvalid, MaxMetadataKeyBytes)
		}
		if len(v) > MaxMetadataValBytes {
			return fmt.Errorf("%w: metadata value of %q is %d bytes; the limit is %d", ErrInvalid, k, len(v), MaxMetadataValBytes)
		}
		total += len(k) + len(v)
	}
	if total > MaxMetadataBytes {
		return fmt.Errorf("%w: metadata is %d bytes; the limit is %d", ErrInvalid, total, MaxMetadataBytes)
	}
	return nil
}

func aad(owner, id string, version int64) []byte {
	return fmt.Appendf(nil, "%s\x00%s\x00%d", owner, id, version)
}

func (s *Store) seal(owner, id string, version int64, value string) []byte {
	nonce := make([]byte, s.aead.NonceSize())
	rand.Read(nonce)
	return s.aead.Seal(nonce, nonce, []byte(value), aad(owner, id, version))
}

func (s *Store) open(r *record) (string, error) {
	n := s.aead.NonceSize()
	if len(r.Sealed) < n {
		return "", fmt.Errorf("secret %s: stored value is damaged", r.ID)
	}
	pt, err := s.aead.Open(nil, r.Sealed[:n], r.Sealed[n:], aad(r.Owner, r.ID, r.Version))
	if err != nil {
		return "", fmt.Errorf("secret %s: stored value does not decrypt with this node's key", r.ID)
	}
	return string(pt), nil
}

// saveLocked writes every record; on failure the caller restores its in-memory change.
func (s *Store) saveLocked() error {
	recs := make([]*record, 0, len(s.recs))
	for _, r := range s.recs {
		recs = append(recs, r)
	}
	sort.Slice(recs, func(i, j int) bool { return recs[i].ID < recs[j].ID })
	raw, err := json.Marshal(recs)
	if err != nil {
		return fmt.Errorf("secret: %w", err)
	}
	if err := atomicfile.WriteFile(s.path, raw, 0o600); err != nil {
		return fmt.Errorf("secret: %w", err)
	}
	return nil
}

func (s *Store) findLocked(owner, idOrName string) *record {
	if r, ok := s.recs[idOrName]; ok && r.Owner == owner {
		return r
	}
	n := strings.ToLower(idOrName)
	for _, r := range s.recs {
		if r.Owner == owner && r.Name == n {
			return r
		}
	}
	return nil
}

func (r *record) info() Info {
	i := r.Info
	i.Metadata = maps.Clone(r.Metadata)
	if i.Metadata == nil {
		i.Metadata = map[string]string{}
	}
	return i
}

// Create stores a new secret for owner.
func (s *Store) Create(owner, name, value string, metadata map[string]string) (Info, error) {
	n, err := CanonicalName(name)
	if err != nil {
		return Info{}, err
	}
	if err := checkValue(value); err != nil {
		return Info{}, err
	}
	if err := CheckMetadata(metadata); err != nil {
		return Info{}, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	count := 0
	for _, r := range s.recs {
		if r.Owner != owner {
			continue
		}
		if r.Name == n {
			return Info{}, fmt.Errorf("%w: %q", ErrExists, n)
		}
		count++
	}
	if count >= MaxPerOwner {
		return Info{}, fmt.Errorf("%w: %d secrets is the most one API key may hold", ErrInvalid, MaxPerOwner)
	}
	b := make([]byte, 10)
	rand.Read(b)
	now := time.Now().UTC()
	r := &record{Info: Info{ID: "sec_" + hex.EncodeToString(b), Name: n, Owner: owner, Version: 1,
		Metadata: maps.Clone(metadata), CreatedAt: now, UpdatedAt: now}}
	r.Sealed = s.seal(owner, r.ID, r.Version, value)
	s.recs[r.ID] = r
	if err := s.saveLocked(); err != nil {
		delete(s.recs, r.ID)
		return Info{}, err
	}
	return r.info(), nil
}

// Update stores value as a new version of owner's secret; metadata, when not nil,
// replaces the stored metadata.
func (s *Store) Update(owner, idOrName, value string, metadata map[string]string) (Info, error) {
	if err := checkValue(value); err != nil {
		return Info{}, err
	}
	if err := CheckMetadata(metadata); err != nil {
		return Info{}, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	r := s.findLocked(owner, idOrName)
	if r == nil {
		return Info{}, fmt.Errorf("%w: %q", ErrNotFound, idOrName)
	}
	old := *r
	r.Version++
	r.UpdatedAt = time.Now().UTC()
	if metadata != nil {
		r.Metadata = maps.Clone(metadata)
	}
	r.Sealed = s.seal(owner, r.ID, r.Version, value)
	if err := s.saveLocked(); err != nil {
		*r = old
		return Info{}, err
	}
	return r.info(), nil
}

// Get returns owner's secret by id or name.
func (s *Store) Get(owner, idOrName string) (Info, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	r := s.findLocked(owner, idOrName)
	if r == nil {
		return Info{}, fmt.Errorf("%w: %q", ErrNotFound, idOrName)
	}
	return r.info(), nil
}

// List returns a page of owner's secrets by name, after the name nextToken.
func (s *Store) List(owner string, limit int, nextToken string) ([]Info, string, error) {
	if limit == 0 {
		limit = DefaultListLimit
	}
	if limit < 1 || limit > MaxListLimit {
		return nil, "", fmt.Errorf("%w: limit must be between 1 and %d", ErrInvalid, MaxListLimit)
	}
	s.mu.Lock()
	var all []Info
	for _, r := range s.recs {
		if r.Owner == owner && r.Name > nextToken {
			all = append(all, r.info())
		}
	}
	s.mu.Unlock()
	sort.Slice(all, func(i, j int) bool { return all[i].Name < all[j].Name })
	if len(all) > limit {
		return all[:limit], all[limit-1].Name, nil
	}
	return all, "", nil
}

// Delete removes owner's secret and every version of its value.
func (s *Store) Delete(owner, idOrName string) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	r := s.findLocked(owner, idOrName)
	if r == nil {
		return fmt.Errorf("%w: %q", ErrNotFound, idOrName)
	}
	delete(s.recs, r.ID)
	if err := s.saveLocked(); err != nil {
		s.recs[r.ID] = r
		return err
	}
	return nil
}

// Value is the current value of owner's secret name.
func (s *Store) Value(owner, name string) (string, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	r := s.findLocked(owner, name)
	if r == nil {
		return "", fmt.Errorf("%w: %q", ErrNotFound, name)
	}
	return s.open(r)
}

// HasPlaceholder reports whether v refers to a secret.
func HasPlaceholder(v string) bool { return placeholderRE.MatchString(v) }

// Names are the secret names v refers to.
func Names(v string) []string {
	var out []string
	for _, m := range placeholderRE.FindAllStringSubmatch(v, -1) {
		out = append(out, m[1])
	}
	return out
}

// Expand replaces each ${e2b.secrets.<name>} in v with owner's secret's value. An unknown
// name is an error naming it (never a value).
func (s *Store) Expand(owner, v string) (string, error) {
	var firstErr error
	out := placeholderRE.ReplaceAllStringFunc(v, func(m string) string {
		name := placeholderRE.FindStringSubmatch(m)[1]
		val, err := s.Value(owner, name)
		if err != nil && firstErr == nil {
			firstErr = err
		}
		return val
	})
	if firstErr != nil {
		return "", firstErr
	}
	return out, nil
}
