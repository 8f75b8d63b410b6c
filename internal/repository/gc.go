package repository

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"
)

// DefaultGrace is how long a blob stays collectable-proof after it was last
// put: long enough for a publisher to upload its blobs and write its record.
const DefaultGrace = 15 * time.Minute

// GCOptions tune GC.
type GCOptions struct {
	// Pinned digests are kept even when no record names them (layers of live
	// or paused sandboxes, uploads in flight on this node).
	Pinned []Digest
	// Grace keeps blobs put or deduplicated within this long; 0 means
	// DefaultGrace, a negative value none (tests).
	Grace  time.Duration
	DryRun bool
	Logger *slog.Logger
}

// GCResult counts what GC saw and did.
type GCResult struct {
	Blobs        int      // blobs in the repository
	Referenced   int      // distinct digests named by records or pins
	Deleted      []Digest // removed (or, on a dry run, would be)
	DeletedBytes int64
	InUse        int // unreferenced but used within the grace period
	// AbortedUploads counts interrupted uploads GC aborted (S3 multipart
	// uploads a killed publisher left, which hold storage but no blob).
	AbortedUploads int
}

// UploadReclaimer is a repository whose interrupted uploads keep storage
// that no blob accounts for (S3 multipart uploads). GC calls it; its
// implementation decides what is stale.
type UploadReclaimer interface {
	AbortStaleUploads(ctx context.Context) (int, error)
}

// GC deletes blobs that no record of any kind (pending ones included) and no
// pin references. It scans the blobs first and the records second: a record
// published after the record scan can only name a blob that its publisher
// put (refreshing LastUsed) after the blob scan, or a new one, and either
// way the conditional delete keeps it. Any error while listing records stops
// GC before it deletes anything, because references it cannot read might
// name any blob.
func GC(ctx context.Context, repo Repository, o GCOptions) (GCResult, error) {
	log := o.Logger
	if log == nil {
		log = slog.Default()
	}
	grace := o.Grace
	if grace == 0 {
		grace = DefaultGrace
	} else if grace < 0 {
		grace = 0
	}
	cutoff := time.Now().Add(-grace)

	var res GCResult
	var candidates []BlobInfo
	err := repo.WalkBlobs(ctx, func(b BlobInfo) error {
		res.Blobs++
		candidates = append(candidates, b)
		return nil
	})
	if err != nil {
		return res, fmt.Errorf("gc: list blobs: %w", err)
	}

	keep := map[Digest]bool{}
	for _, d := range o.Pinned {
		keep[d] = true
	}
	for _, kind := range Kinds() {
		page := Page{Next: ""}
		for first := true; first || page.Next != ""; first = false {
			page, err = repo.ListRecords(ctx, kind, ListOptions{After: page.Next, Limit: MaxListLimit})
			if err != nil {
				return res, fmt.Errorf("gc: list %s records: %w", kind, err)
			}
			for _, r := range page.Records {
				for _, d := range r.BlobDigests() {
					keep[d] = true
				}
			}
		}
	}
	res.Referenced = len(keep)

	for _, b := range candidates {
		if keep[b.Digest] {
			continue
		}
		if !b.LastUsed.Before(cutoff) {
			res.InUse++
			continue
		}
		if o.DryRun {
			res.Deleted = append(res.Deleted, b.Digest)
			res.DeletedBytes += b.Size
			continue
		}
		switch err := repo.DeleteBlobIfUnused(ctx, b.Digest, cutoff); {
		case err == nil:
			res.Deleted = append(res.Deleted, b.Digest)
			res.DeletedBytes += b.Size
			log.Debug("gc: deleted blob", "digest", b.Digest, "size", b.Size)
		case errors.Is(err, ErrInUse):
			res.InUse++
		case errors.Is(err, ErrNotFound):
		default:
			return res, fmt.Errorf("gc: delete %s: %w", b.Digest, err)
		}
	}
	if ur, ok := repo.(UploadReclaimer); ok && !o.DryRun {
		// Not a reason to fail GC: the blobs are collected, and the next run
		// (or the bucket's lifecycle rule) retries.
		n, err := ur.AbortStaleUploads(ctx)
		res.AbortedUploads = n
		if err != nil {
			log.Warn("repository gc: abort stale uploads", "err", err)
		}
	}
	log.Info("repository gc", "blobs", res.Blobs, "referenced", res.Referenced,
		"deleted", len(res.Deleted), "deleted_bytes", res.DeletedBytes, "in_use", res.InUse,
		"aborted_uploads", res.AbortedUploads, "dry_run", o.DryRun)
	return res, nil
}
