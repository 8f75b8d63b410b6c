package snapshot

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/aenv-dev/aenv/internal/repository"
)

// convertLayerExt and sidecarExt follow internal/image/convert, which writes
// "<name>.sha256" next to each "<name>.zfile" it converts; reading those
// sidecars spares hashing template layers again.
const (
	convertLayerExt = ".zfile"
	sidecarExt      = ".sha256"
)

// knownDigest is what the digest cache remembers about one layer file.
// Sealed layers are immutable, so path + uuid + size + mtime identify the
// bytes well enough to skip a rehash; a stale entry would still be caught,
// because every Put verifies the digest while it streams.
type knownDigest struct {
	Path    string            `json:"path"`
	UUID    string            `json:"uuid"`
	Size    int64             `json:"size"`
	ModTime time.Time         `json:"mod_time"`
	Digest  repository.Digest `json:"digest"`
}

// digester hashes layer files once and remembers the result under dir.
type digester struct{ dir string }

func (d digester) entryPath(path string) string {
	h := sha256.Sum256([]byte(path))
	return filepath.Join(d.dir, hex.EncodeToString(h[:16])+".json")
}

// digest returns the sha256 of the file at l.Path, from the convert
// sidecar, the digest cache or by streaming the file.
func (d digester) digest(l LayerFile) (repository.Digest, int64, error) {
	st, err := os.Stat(l.Path)
	if err != nil {
		return "", 0, fmt.Errorf("snapshot: layer %s: %w", l.Path, err)
	}
	if l.Size > 0 && st.Size() != l.Size {
		return "", 0, fmt.Errorf("%w: layer %s is %d bytes, manifest says %d", ErrInvalid, l.Path, st.Size(), l.Size)
	}
	if strings.HasSuffix(l.Path, convertLayerExt) {
		if b, err := os.ReadFile(strings.TrimSuffix(l.Path, convertLayerExt) + sidecarExt); err == nil {
			if dg, err := repository.ParseDigest(strings.TrimSpace(string(b))); err == nil {
				return dg, st.Size(), nil
			}
		}
	}
	if b, err := os.ReadFile(d.entryPath(l.Path)); err == nil {
		var k knownDigest
		if json.Unmarshal(b, &k) == nil && k.Path == l.Path && k.UUID == l.UUID && k.Size == st.Size() &&
			k.ModTime.Equal(st.ModTime()) && k.Digest.Validate() == nil {
			return k.Digest, st.Size(), nil
		}
	}
	dg, n, err := hashFile(l.Path)
	if err != nil {
		return "", 0, err
	}
	if n != st.Size() {
		return "", 0, fmt.Errorf("snapshot: layer %s changed while it was hashed", l.Path)
	}
	b, _ := json.Marshal(knownDigest{Path: l.Path, UUID: l.UUID, Size: n, ModTime: st.ModTime(), Digest: dg})
	// Best effort: without the entry the next publication hashes again.
	_ = writeFileAtomic(d.entryPath(l.Path), b)
	return dg, n, nil
}

// forget drops a cache entry found to be wrong.
func (d digester) forget(path string) { os.Remove(d.entryPath(path)) }

func hashFile(path string) (repository.Digest, int64, error) {
	f, err := os.Open(path)
	if err != nil {
		return "", 0, fmt.Errorf("snapshot: %w", err)
	}
	defer f.Close()
	h := sha256.New()
	n, err := io.Copy(h, f)
	if err != nil {
		return "", 0, fmt.Errorf("snapshot: hash %s: %w", path, err)
	}
	return repository.Digest("sha256:" + hex.EncodeToString(h.Sum(nil))), n, nil
}

// writeFileAtomic writes b to path through a synced temp file and a rename,
// so a crash leaves the old content or the new.
func writeFileAtomic(path string, b []byte) error {
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return err
	}
	f, err := os.CreateTemp(filepath.Dir(path), ".tmp-*")
	if err != nil {
		return err
	}
	_, err = f.Write(b)
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(f.Name(), path)
	}
	if err != nil {
		os.Remove(f.Name())
	}
	return err
}
