package catalog

import (
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"sort"
	"strings"
	"time"

	bolt "go.etcd.io/bbolt"
)

// APIKeyPrefix starts every generated key; the E2B Python SDK checks keys against
// ^e2b_[0-9a-f]{40}$, so generated keys follow that format exactly.
const APIKeyPrefix = "e2b_"

// lastUsedGranularity bounds how often an authentication writes (and fsyncs) the
// last-used time: once a minute per key is plenty for an operator.
const lastUsedGranularity = time.Minute

// APIKey is a stored key. Only the SHA-256 of the secret is kept.
type APIKey struct {
	ID        string    `json:"id"`
	Name      string    `json:"name"`
	Hash      string    `json:"hash"` // lowercase hex SHA-256 of the full key
	Prefix    string    `json:"prefix"`
	CreatedAt time.Time `json:"createdAt"`
	LastUsed  time.Time `json:"lastUsed,omitzero"`
}

// HashAPIKey is the digest stored for a key and used for lookups.
func HashAPIKey(key string) string {
	sum := sha256.Sum256([]byte(key))
	return hex.EncodeToString(sum[:])
}

// GenerateAPIKey returns a new random key in the E2B format (e2b_ + 40 hex digits).
func GenerateAPIKey() (string, error) {
	b := make([]byte, 20)
	if _, err := rand.Read(b); err != nil {
		return "", fmt.Errorf("catalog: generate api key: %w", err)
	}
	return APIKeyPrefix + hex.EncodeToString(b), nil
}

// APIKeys stores API keys by id with an index by hash.
type APIKeys struct{ db *bolt.DB }

// Create generates a key named name, stores its hash and returns the plaintext key,
// which is never retrievable again.
func (s *APIKeys) Create(name string) (string, APIKey, error) {
	key, err := GenerateAPIKey()
	if err != nil {
		return "", APIKey{}, err
	}
	rec, err := s.Add(name, key)
	return key, rec, err
}

// Add stores an existing key (for example one set by AENV_API_KEY). Adding a key whose
// hash is already stored returns ErrExists and the stored record.
func (s *APIKeys) Add(name, key string) (APIKey, error) {
	if len(key) < 16 {
		return APIKey{}, fmt.Errorf("%w: api key must be at least 16 characters", ErrInvalid)
	}
	if strings.TrimSpace(name) == "" {
		return APIKey{}, fmt.Errorf("%w: api key name is empty", ErrInvalid)
	}
	idb := make([]byte, 8)
	if _, err := rand.Read(idb); err != nil {
		return APIKey{}, fmt.Errorf("catalog: generate key id: %w", err)
	}
	rec := APIKey{
		ID:        hex.EncodeToString(idb),
		Name:      name,
		Hash:      HashAPIKey(key),
		Prefix:    key[:min(len(key), len(APIKeyPrefix)+4)],
		CreatedAt: time.Now().UTC(),
	}
	err := s.db.Update(func(tx *bolt.Tx) error {
		hb := tx.Bucket(bucketAPIKeyHashes)
		if id := hb.Get([]byte(rec.Hash)); id != nil {
			existing, err := getKey(tx, string(id))
			if err != nil {
				return err
			}
			rec = existing
			return fmt.Errorf("key %q: %w", existing.Name, ErrExists)
		}
		if err := hb.Put([]byte(rec.Hash), []byte(rec.ID)); err != nil {
			return err
		}
		return putKey(tx, rec)
	})
	return rec, wrap("add api key", err)
}

// Lookup finds the key whose hash is hash, or ErrNotFound.
func (s *APIKeys) Lookup(hash string) (APIKey, error) {
	var rec APIKey
	err := s.db.View(func(tx *bolt.Tx) error {
		id := tx.Bucket(bucketAPIKeyHashes).Get([]byte(hash))
		if id == nil {
			return ErrNotFound
		}
		var err error
		rec, err = getKey(tx, string(id))
		return err
	})
	return rec, wrap("lookup api key", err)
}

// Authenticate checks a plaintext key and records its use (at most once a minute per
// key, so authentication does not turn every request into a disk write).
func (s *APIKeys) Authenticate(key string, now time.Time) (APIKey, error) {
	rec, err := s.Lookup(HashAPIKey(key))
	if err != nil || now.Sub(rec.LastUsed) < lastUsedGranularity {
		return rec, err
	}
	err = s.db.Update(func(tx *bolt.Tx) error {
		cur, err := getKey(tx, rec.ID)
		if err != nil {
			return err // revoked meanwhile
		}
		cur.LastUsed = now.UTC()
		rec = cur
		return putKey(tx, cur)
	})
	return rec, wrap("touch api key", err)
}

// List returns all keys, oldest first.
func (s *APIKeys) List() ([]APIKey, error) {
	var out []APIKey
	err := s.db.View(func(tx *bolt.Tx) error {
		return tx.Bucket(bucketAPIKeys).ForEach(func(k, v []byte) error {
			var rec APIKey
			if err := json.Unmarshal(v, &rec); err != nil {
				return fmt.Errorf("decode api key %q: %w", k, err)
			}
			out = append(out, rec)
			return nil
		})
	})
	sort.SliceStable(out, func(i, j int) bool { return out[i].CreatedAt.Before(out[j].CreatedAt) })
	return out, wrap("list api keys", err)
}

// Revoke deletes the key with this id or name; ErrNotFound when none matches. A name
// shared by several keys is refused (ErrInvalid) so a revoke never removes more than
// the caller meant.
func (s *APIKeys) Revoke(idOrName string) (APIKey, error) {
	var rec APIKey
	err := s.db.Update(func(tx *bolt.Tx) error {
		var matches []APIKey
		err := tx.Bucket(bucketAPIKeys).ForEach(func(k, v []byte) error {
			var r APIKey
			if err := json.Unmarshal(v, &r); err != nil {
				return fmt.Errorf("decode api key %q: %w", k, err)
			}
			if r.ID == idOrName {
				matches = []APIKey{r}
				return errStop
			}
			if r.Name == idOrName {
				matches = append(matches, r)
			}
			return nil
		})
		if err != nil && err != errStop {
			return err
		}
		switch len(matches) {
		case 0:
			return fmt.Errorf("api key %q: %w", idOrName, ErrNotFound)
		case 1:
		default:
			return fmt.Errorf("%w: %d keys are named %q; revoke by id", ErrInvalid, len(matches), idOrName)
		}
		rec = matches[0]
		if err := tx.Bucket(bucketAPIKeyHashes).Delete([]byte(rec.Hash)); err != nil {
			return err
		}
		return tx.Bucket(bucketAPIKeys).Delete([]byte(rec.ID))
	})
	return rec, wrap("revoke api key", err)
}

// errStop ends a ForEach early; never returned to callers.
var errStop = fmt.Errorf("stop iteration")

func getKey(tx *bolt.Tx, id string) (APIKey, error) {
	var rec APIKey
	v := tx.Bucket(bucketAPIKeys).Get([]byte(id))
	if v == nil {
		return rec, fmt.Errorf("api key %q: %w", id, ErrNotFound)
	}
	if err := json.Unmarshal(v, &rec); err != nil {
		return rec, fmt.Errorf("decode api key %q: %w", id, err)
	}
	return rec, nil
}

func putKey(tx *bolt.Tx, rec APIKey) error {
	raw, err := json.Marshal(rec)
	if err != nil {
		return err
	}
	return tx.Bucket(bucketAPIKeys).Put([]byte(rec.ID), raw)
}
