// Package repository defines the shared store of templates and snapshots:
// content-addressed blobs (sealed layers, memory images, VM state) and small
// JSON records (template and snapshot manifests) that every node sharing the
// repository sees. Implementations live in posixfs (a shared directory, NFS
// included) and s3 (S3-compatible object storage); nodecache puts a bounded
// node-local copy of blobs in front of either; layers opens stack lowers from
// any of them through the storage block cache; repositorytest is the
// conformance suite every implementation passes.
//
// Publication protocol, which GC relies on: a publisher first creates the
// record in state pending (listing every blob digest it will reference), then
// puts the blobs, then replaces the record with state complete. Other nodes use
// a record only once it is complete. A blob that a record names is never
// collected, whatever the record's state.
package repository

import (
	"context"
	"errors"
	"io"
	"time"
)

// Sentinel errors callers branch on; implementations wrap them with %w.
var (
	// ErrNotFound: no blob or record under that name.
	ErrNotFound = errors.New("repository: not found")
	// ErrDigestMismatch: the bytes offered or read do not hash to the digest.
	ErrDigestMismatch = errors.New("repository: digest mismatch")
	// ErrInvalid: malformed digest, id, kind or record.
	ErrInvalid = errors.New("repository: invalid argument")
	// ErrExists: a create-only record publication found a record there.
	ErrExists = errors.New("repository: record exists")
	// ErrConflict: the stored record's revision is not the one the update
	// was based on (a concurrent writer won).
	ErrConflict = errors.New("repository: revision conflict")
	// ErrInUse: a conditional blob delete found the blob used since the cutoff.
	ErrInUse = errors.New("repository: blob in use")
	// ErrLocked: a lock could not be taken before the timeout.
	ErrLocked = errors.New("repository: locked")
)

// BlobInfo describes a stored blob.
type BlobInfo struct {
	Digest Digest
	Size   int64
	// LastUsed is when the blob was last written or deduplicated by a Put;
	// GC keeps blobs used within its grace period.
	LastUsed time.Time
}

// BlobReader reads ranges of one blob lazily. It satisfies the storage
// block cache's Source (ReadAt with a context, Size), so a repository blob can
// back a sealed layer that is fetched only where it is read. ReadAt fills p
// completely unless the range passes Size, in which case it returns io.EOF.
type BlobReader interface {
	ReadAt(ctx context.Context, p []byte, off int64) (int, error)
	Size() int64
	Close() error
}

// ListOptions select a page of records of one kind, ordered by id.
type ListOptions struct {
	Prefix string // only ids starting with Prefix
	After  string // only ids after this one (the previous page's Next)
	Limit  int    // at most this many; 0 means DefaultListLimit
}

// DefaultListLimit and MaxListLimit bound one page of ListRecords.
const (
	DefaultListLimit = 100
	MaxListLimit     = 1000
)

// Page is one page of records; Next is empty on the last page, otherwise it
// is the After of the following page.
type Page struct {
	Records []Record
	Next    string
}

// Repository is a store of blobs and records. Every method is safe for
// concurrent use, including by other processes and nodes sharing the store.
type Repository interface {
	// PutBlob stores the bytes of r under d, verifying the digest (and size,
	// when size ≥ 0) while streaming; on a mismatch nothing is stored and the
	// error wraps ErrDigestMismatch. A blob already present is not uploaded
	// again (r is not read) but its LastUsed is refreshed.
	PutBlob(ctx context.Context, d Digest, size int64, r io.Reader) (BlobInfo, error)
	// GetBlob returns the whole blob. The reader verifies the digest at the
	// end and returns an error wrapping ErrDigestMismatch instead of io.EOF
	// when the stored bytes are corrupt.
	GetBlob(ctx context.Context, d Digest) (io.ReadCloser, error)
	// OpenBlob opens the blob for ranged reads; nothing is fetched up front
	// beyond its size.
	OpenBlob(ctx context.Context, d Digest) (BlobReader, error)
	StatBlob(ctx context.Context, d Digest) (BlobInfo, error)
	// DeleteBlob removes the blob; removing a missing blob is not an error.
	DeleteBlob(ctx context.Context, d Digest) error
	// DeleteBlobIfUnused removes the blob only when its LastUsed is before
	// cutoff, otherwise it returns ErrInUse; used by GC to lose races with
	// publishers safely.
	DeleteBlobIfUnused(ctx context.Context, d Digest, cutoff time.Time) error
	// WalkBlobs calls fn for every stored blob, in no particular order.
	WalkBlobs(ctx context.Context, fn func(BlobInfo) error) error

	// PutRecord publishes rec atomically (readers see the old or the new
	// document, never a part). With rec.Revision 0 it creates the record and
	// fails with ErrExists when one is there; otherwise it replaces the record
	// only if the stored revision equals rec.Revision, failing with
	// ErrConflict. It returns the record as stored, with Revision incremented
	// and UpdatedAt (and CreatedAt on create) set.
	PutRecord(ctx context.Context, rec Record) (Record, error)
	GetRecord(ctx context.Context, kind Kind, id string) (Record, error)
	ListRecords(ctx context.Context, kind Kind, o ListOptions) (Page, error)
	// DeleteRecord removes the record; removing a missing one is not an error.
	DeleteRecord(ctx context.Context, kind Kind, id string) error
}

// NormalizeList checks and defaults list options.
func NormalizeList(kind Kind, o ListOptions) (ListOptions, error) {
	if err := kind.Validate(); err != nil {
		return o, err
	}
	if o.Limit < 0 || o.Limit > MaxListLimit {
		return o, errorf(ErrInvalid, "list limit %d outside 0..%d", o.Limit, MaxListLimit)
	}
	if o.Limit == 0 {
		o.Limit = DefaultListLimit
	}
	return o, nil
}

// ReadAll reads a blob through GetBlob into memory; for small blobs and tests.
func ReadAll(ctx context.Context, r Repository, d Digest) ([]byte, error) {
	rc, err := r.GetBlob(ctx, d)
	if err != nil {
		return nil, err
	}
	defer rc.Close()
	return io.ReadAll(rc)
}
