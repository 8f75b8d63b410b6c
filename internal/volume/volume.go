// Package volume keeps the node's persistent named volumes (E2B's Volume API): one
// directory per volume under <data>/volumes/<id>/data, with its record next to it in
// volume.json. A volume outlives the sandboxes that mount it and the node's restarts;
// several sandboxes may mount it at once and then share one filesystem (the node's).
//
// Volumes are scoped to an owner (the API key that made them): another key neither sees
// nor mounts them. They are node-local: nothing is published to the repository, so a
// volume exists only on the node that made it.
package volume

import (
	"context"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
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
	ErrNotFound = errors.New("volume not found")       // 404
	ErrExists   = errors.New("volume already exists")  // 409
	ErrInvalid  = errors.New("invalid volume request") // 400
	ErrQuota    = errors.New("volume quota exceeded")  // 400 (nothing was created)
)

// DefaultMaxPerOwner is how many volumes one owner may hold when Options leave it zero.
const DefaultMaxPerOwner = 100

// nameRE is what a volume name may look like: it is used in mounts and paths, so it is
// short and plain.
var nameRE = regexp.MustCompile(`^[a-zA-Z0-9][a-zA-Z0-9._-]{0,62}$`)

// idRE is the shape of the ids this package makes.
var idRE = regexp.MustCompile(`^vol_[0-9a-f]{20}$`)

// Volume is one volume's record.
type Volume struct {
	ID        string    `json:"id"`
	Name      string    `json:"name"`
	Owner     string    `json:"owner"`
	CreatedAt time.Time `json:"createdAt"`
	// SizeMB is the volume's size quota: its own ext4 filesystem of that size (quota.go).
	// 0: a directory on the data dir's filesystem, bounded by nothing but it.
	SizeMB int `json:"sizeMB,omitempty"`
}

// Options tune a Store.
type Options struct {
	// MaxPerOwner caps the volumes of one owner (DefaultMaxPerOwner when zero).
	MaxPerOwner int
	// SizeMB is the size quota of volumes made from now on (0: none, else at least
	// MinSizeMB). Volumes keep the quota they were made with.
	SizeMB int
}

// Store holds the volumes of one node.
type Store struct {
	dir         string
	tokenKey    []byte
	maxPerOwner int
	sizeMB      int

	mu   sync.Mutex
	vols map[string]Volume // by id
}

// Open loads the volumes under dir (created when missing). Records that cannot be read
// are skipped with their error joined into the returned error only when nothing loads.
func Open(dir string, o Options) (*Store, error) {
	if o.SizeMB != 0 && o.SizeMB < MinSizeMB {
		return nil, fmt.Errorf("volume: a size quota of %d MB is below the minimum of %d MB", o.SizeMB, MinSizeMB)
	}
	if err := os.MkdirAll(dir, 0o711); err != nil {
		return nil, fmt.Errorf("volume: %w", err)
	}
	key, err := loadKey(filepath.Join(dir, "token.key"))
	if err != nil {
		return nil, err
	}
	s := &Store{dir: dir, tokenKey: key, maxPerOwner: o.MaxPerOwner, sizeMB: o.SizeMB, vols: map[string]Volume{}}
	if s.maxPerOwner <= 0 {
		s.maxPerOwner = DefaultMaxPerOwner
	}
	ents, err := os.ReadDir(dir)
	if err != nil {
		return nil, fmt.Errorf("volume: %w", err)
	}
	for _, e := range ents {
		if !e.IsDir() || !idRE.MatchString(e.Name()) {
			continue
		}
		raw, err := os.ReadFile(filepath.Join(dir, e.Name(), "volume.json"))
		if err != nil {
			// A volume whose creation crashed before its record was written: it was never
			// reported to anyone, so it goes.
			if errors.Is(err, os.ErrNotExist) {
				_ = s.unmountImage(e.Name())
				_ = os.RemoveAll(filepath.Join(dir, e.Name()))
				continue
			}
			return nil, fmt.Errorf("volume: %w", err)
		}
		var v Volume
		if err := json.Unmarshal(raw, &v); err != nil || v.ID != e.Name() {
			return nil, fmt.Errorf("volume: record %s is damaged: %v", e.Name(), err)
		}
		if v.SizeMB > 0 {
			// After a host reboot; a mount that outlived the node is kept (quota.go).
			ctx, cancel := context.WithTimeout(context.Background(), mkfsTimeout)
			err := s.mountImage(ctx, v.ID)
			cancel()
			if err != nil {
				return nil, fmt.Errorf("volume: %w", err)
			}
		}
		s.vols[v.ID] = v
	}
	return s, nil
}

// loadKey reads the token key at path, or makes one (mode 0600) on first use.
func loadKey(path string) ([]byte, error) {
	raw, err := os.ReadFile(path)
	if err == nil && len(raw) == 32 {
		return raw, nil
	}
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("volume: token key: %w", err)
	}
	if err == nil {
		return nil, fmt.Errorf("volume: token key %s has %d bytes, want 32", path, len(raw))
	}
	key := make([]byte, 32)
	rand.Read(key)
	if err := atomicfile.WriteFile(path, key, 0o600); err != nil {
		return nil, fmt.Errorf("volume: token key: %w", err)
	}
	return key, nil
}

// ValidName checks a volume name.
func ValidName(name string) error {
	if !nameRE.MatchString(name) {
		return fmt.Errorf("%w: volume name %q must be 1 to 63 letters, digits, '.', '_' or '-', starting with a letter or digit", ErrInvalid, name)
	}
	return nil
}

// Create makes an empty volume named name for owner.
func (s *Store) Create(owner, name string) (Volume, error) {
	if err := ValidName(name); err != nil {
		return Volume{}, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	n := 0
	for _, v := range s.vols {
		if v.Owner != owner {
			continue
		}
		if v.Name == name {
			return Volume{}, fmt.Errorf("%w: a volume named %q exists (%s)", ErrExists, name, v.ID)
		}
		n++
	}
	if n >= s.maxPerOwner {
		return Volume{}, fmt.Errorf("%w: %d volumes is the most one API key may hold on this node", ErrQuota, s.maxPerOwner)
	}
	b := make([]byte, 10)
	rand.Read(b)
	v := Volume{ID: "vol_" + hex.EncodeToString(b), Name: name, Owner: owner, CreatedAt: time.Now().UTC(), SizeMB: s.sizeMB}
	vdir := filepath.Join(s.dir, v.ID)
	if err := os.Mkdir(vdir, 0o711); err != nil {
		return Volume{}, fmt.Errorf("volume: %w", err)
	}
	// Every user of every sandbox may write at the volume's root, as on a fresh share
	// (chmod because the umask trims Mkdir's mode).
	var err error
	if v.SizeMB > 0 {
		err = s.makeImage(v.ID, v.SizeMB)
	} else if err = os.Mkdir(s.dirOf(v), 0o777); err == nil {
		err = os.Chmod(s.dirOf(v), 0o777)
	}
	if err == nil {
		raw, _ := json.Marshal(v)
		err = atomicfile.WriteFile(filepath.Join(vdir, "volume.json"), raw, 0o600)
	}
	if err != nil {
		_ = s.unmountImage(v.ID)
		_ = os.RemoveAll(vdir)
		return Volume{}, fmt.Errorf("volume: %w", err)
	}
	s.vols[v.ID] = v
	return v, nil
}

// List returns owner's volumes by name.
func (s *Store) List(owner string) []Volume {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []Volume
	for _, v := range s.vols {
		if v.Owner == owner {
			out = append(out, v)
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out
}

// Get finds owner's volume by id or name.
func (s *Store) Get(owner, idOrName string) (Volume, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if v, ok := s.vols[idOrName]; ok && v.Owner == owner {
		return v, nil
	}
	for _, v := range s.vols {
		if v.Owner == owner && v.Name == idOrName {
			return v, nil
		}
	}
	return Volume{}, fmt.Errorf("%w: %q", ErrNotFound, idOrName)
}

// ByID finds a volume by id whatever its owner (the content API authenticates with the
// volume's token instead of an API key).
func (s *Store) ByID(id string) (Volume, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if v, ok := s.vols[id]; ok {
		return v, nil
	}
	return Volume{}, fmt.Errorf("%w: %q", ErrNotFound, id)
}

// Delete removes owner's volume id and its content. The caller makes sure no sandbox
// mounts it.
func (s *Store) Delete(owner, id string) error {
	s.mu.Lock()
	v, ok := s.vols[id]
	if !ok || v.Owner != owner {
		s.mu.Unlock()
		return fmt.Errorf("%w: %q", ErrNotFound, id)
	}
	delete(s.vols, id)
	s.mu.Unlock()
	if err := s.unmountImage(id); err != nil {
		s.mu.Lock()
		s.vols[id] = v
		s.mu.Unlock()
		return err
	}
	// Rename first: the volume is gone at once even if removing a large tree takes long or
	// is interrupted (Open drops a directory without a record).
	vdir := filepath.Join(s.dir, v.ID)
	trash := filepath.Join(s.dir, ".deleted-"+v.ID)
	if err := os.Rename(vdir, trash); err != nil {
		s.mu.Lock()
		s.vols[id] = v
		s.mu.Unlock()
		return fmt.Errorf("volume: delete %s: %w", id, err)
	}
	return os.RemoveAll(trash)
}

// Dir is the host directory holding volume id's content.
func (s *Store) Dir(id string) string { return s.dataDir(id) }

func (s *Store) dataDir(id string) string {
	s.mu.Lock()
	v, ok := s.vols[id]
	s.mu.Unlock()
	if !ok {
		v = Volume{ID: id}
	}
	return s.dirOf(v)
}

// dirOf is where v's content is: in its own filesystem when it has a quota.
func (s *Store) dirOf(v Volume) string {
	if v.SizeMB > 0 {
		return filepath.Join(s.fsDir(v.ID), "data")
	}
	return filepath.Join(s.dir, v.ID, "data")
}

// Token is the bearer token of the volume content API for v: an HMAC of its id under the
// node's key, so it needs no storage and survives restarts.
func (s *Store) Token(v Volume) string {
	m := hmac.New(sha256.New, s.tokenKey)
	m.Write([]byte(v.ID))
	return "vtok_" + hex.EncodeToString(m.Sum(nil))
}

// CheckToken returns volume id when token is its content token.
func (s *Store) CheckToken(id, token string) (Volume, error) {
	v, err := s.ByID(id)
	if err != nil {
		return Volume{}, err
	}
	if subtle.ConstantTimeCompare([]byte(s.Token(v)), []byte(strings.TrimSpace(token))) != 1 {
		return Volume{}, fmt.Errorf("%w: %q", ErrNotFound, id)
	}
	return v, nil
}

// MountDir is the host directory of volume id for a sandbox of owner (the orchestrator's
// Volumes): another owner's volume is not found.
func (s *Store) MountDir(owner, id string) (string, error) {
	v, err := s.ByID(id)
	if err != nil {
		return "", err
	}
	if v.Owner != owner {
		return "", fmt.Errorf("%w: %q belongs to another API key", ErrNotFound, id)
	}
	return s.dirOf(v), nil
}
