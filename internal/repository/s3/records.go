package s3

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"time"

	"github.com/minio/minio-go/v7"

	"github.com/aenv-dev/aenv/internal/repository"
)

func (r *Repo) recordKey(kind repository.Kind, id string) string {
	return r.prefix + "records/" + string(kind) + "/" + id
}

func checkName(kind repository.Kind, id string) error {
	if err := kind.Validate(); err != nil {
		return err
	}
	return repository.ValidateID(id)
}

// GetRecord implements repository.Repository.
func (r *Repo) GetRecord(ctx context.Context, kind repository.Kind, id string) (repository.Record, error) {
	if err := checkName(kind, id); err != nil {
		return repository.Record{}, err
	}
	rec, _, _, err := r.readRecord(ctx, kind, id)
	return rec, err
}

// readRecord returns the record, its raw bytes and its ETag.
func (r *Repo) readRecord(ctx context.Context, kind repository.Kind, id string) (repository.Record, []byte, string, error) {
	key := r.recordKey(kind, id)
	body, info, err := r.getObject(ctx, key, minio.GetObjectOptions{})
	if err != nil {
		if errors.Is(err, repository.ErrNotFound) {
			return repository.Record{}, nil, "", fmt.Errorf("%w: %s %s", repository.ErrNotFound, kind, id)
		}
		return repository.Record{}, nil, "", err
	}
	defer body.Close()
	b, err := io.ReadAll(io.LimitReader(body, 1<<20+1))
	if err != nil {
		return repository.Record{}, nil, "", fmt.Errorf("s3: read %s: %w", key, err)
	}
	rec, err := repository.DecodeRecord(b)
	if err != nil {
		return repository.Record{}, nil, "", fmt.Errorf("s3: %s %s: %w", kind, id, err)
	}
	if rec.Kind != kind || rec.ID != id {
		return repository.Record{}, nil, "", fmt.Errorf("%w: object for %s %s holds %s %s", repository.ErrInvalid, kind, id, rec.Kind, rec.ID)
	}
	return rec, b, info.ETag, nil
}

// PutRecord implements repository.Repository with a conditional PUT and a
// read-back (see the package comment).
func (r *Repo) PutRecord(ctx context.Context, rec repository.Record) (repository.Record, error) {
	if err := checkName(rec.Kind, rec.ID); err != nil {
		return repository.Record{}, err
	}
	var stored *repository.Record
	cur, _, etag, err := r.readRecord(ctx, rec.Kind, rec.ID)
	switch {
	case err == nil:
		stored = &cur
	case !errors.Is(err, repository.ErrNotFound):
		return repository.Record{}, err
	}
	next, err := repository.PrepareRecord(rec, stored, time.Now())
	if err != nil {
		return repository.Record{}, err
	}
	b, err := repository.EncodeRecord(next)
	if err != nil {
		return repository.Record{}, err
	}
	opts := minio.PutObjectOptions{ContentType: "application/json", DisableMultipart: true}
	if stored == nil {
		opts.SetMatchETagExcept("*")
	} else {
		opts.SetMatchETag(etag)
	}
	key := r.recordKey(rec.Kind, rec.ID)
	if _, err := r.c.PutObject(ctx, r.bucket, key, bytes.NewReader(b), int64(len(b)), opts); err != nil {
		resp := minio.ToErrorResponse(err)
		switch {
		case resp.StatusCode == http.StatusPreconditionFailed && stored == nil:
			return repository.Record{}, fmt.Errorf("%w: %s %s (created concurrently)", repository.ErrExists, rec.Kind, rec.ID)
		case resp.StatusCode == http.StatusPreconditionFailed, resp.StatusCode == http.StatusConflict:
			return repository.Record{}, fmt.Errorf("%w: %s %s changed since revision %d", repository.ErrConflict, rec.Kind, rec.ID, rec.Revision)
		}
		return repository.Record{}, fmt.Errorf("s3: put %s: %w", key, err)
	}
	// Read back: a later revision means a writer built on ours (ours
	// committed); the same revision with other bytes means a writer that did
	// not see ours replaced it, which only a server ignoring the conditions
	// allows.
	backRec, back, _, err := r.readRecord(ctx, rec.Kind, rec.ID)
	switch {
	case errors.Is(err, repository.ErrNotFound):
		return repository.Record{}, fmt.Errorf("%w: %s %s was deleted concurrently", repository.ErrConflict, rec.Kind, rec.ID)
	case err != nil:
		return repository.Record{}, fmt.Errorf("s3: read back %s: %w", key, err)
	case backRec.Revision > next.Revision, bytes.Equal(back, b):
		return next, nil
	}
	return repository.Record{}, fmt.Errorf("%w: %s %s was overwritten by a concurrent writer", repository.ErrConflict, rec.Kind, rec.ID)
}

// DeleteRecord implements repository.Repository.
func (r *Repo) DeleteRecord(ctx context.Context, kind repository.Kind, id string) error {
	if err := checkName(kind, id); err != nil {
		return err
	}
	if err := r.c.RemoveObject(ctx, r.bucket, r.recordKey(kind, id), minio.RemoveObjectOptions{}); err != nil && !isNotFound(err) {
		return fmt.Errorf("s3: delete %s %s: %w", kind, id, err)
	}
	return nil
}

// ListRecords implements repository.Repository. Keys sort as ids do, so a
// page is one S3 listing from StartAfter, stopped once Limit+1 ids are seen.
func (r *Repo) ListRecords(ctx context.Context, kind repository.Kind, o repository.ListOptions) (repository.Page, error) {
	o, err := repository.NormalizeList(kind, o)
	if err != nil {
		return repository.Page{}, err
	}
	base := r.recordKey(kind, "")
	var page repository.Page
	after := o.After
	for {
		ids, more, err := r.listIDs(ctx, base, o.Prefix, after, o.Limit-len(page.Records))
		if err != nil {
			return repository.Page{}, err
		}
		for _, id := range ids {
			rec, _, _, err := r.readRecord(ctx, kind, id)
			if errors.Is(err, repository.ErrNotFound) {
				continue // deleted since the listing
			}
			if err != nil {
				return repository.Page{}, err
			}
			page.Records = append(page.Records, rec)
		}
		page.Next = ""
		if more && len(ids) > 0 {
			page.Next = ids[len(ids)-1]
		}
		if page.Next == "" || len(page.Records) == o.Limit {
			return page, nil
		}
		after = page.Next
	}
}

// listIDs returns up to limit ids after `after` with the prefix, and whether
// more follow.
func (r *Repo) listIDs(ctx context.Context, base, prefix, after string, limit int) ([]string, bool, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel() // stops the listing goroutine when we stop early
	lo := minio.ListObjectsOptions{Prefix: base + prefix, Recursive: true, MaxKeys: min(limit+1, 1000)}
	if after != "" {
		lo.StartAfter = base + after
	}
	var ids []string
	for obj := range r.c.ListObjectsIter(ctx, r.bucket, lo) {
		if obj.Err != nil {
			return nil, false, fmt.Errorf("s3: list %s: %w", base, obj.Err)
		}
		id := strings.TrimPrefix(obj.Key, base)
		if repository.ValidateID(id) != nil || (after != "" && id <= after) {
			continue
		}
		if len(ids) == limit {
			return ids, true, nil
		}
		ids = append(ids, id)
	}
	return ids, false, nil
}
