package posixfs

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"sort"
	"strings"
	"time"

	"github.com/aenv-dev/aenv/internal/repository"
)

func (r *Repo) recordPath(kind repository.Kind, id string) string {
	return r.path("records", string(kind), id+".json")
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
	return r.readRecord(kind, id)
}

func (r *Repo) readRecord(kind repository.Kind, id string) (repository.Record, error) {
	f, err := os.Open(r.recordPath(kind, id))
	if errors.Is(err, os.ErrNotExist) {
		return repository.Record{}, fmt.Errorf("%w: %s %s", repository.ErrNotFound, kind, id)
	}
	if err != nil {
		return repository.Record{}, fmt.Errorf("posixfs: %w", err)
	}
	defer f.Close()
	b, err := io.ReadAll(io.LimitReader(f, 1<<20+1))
	if err != nil {
		return repository.Record{}, fmt.Errorf("posixfs: read %s %s: %w", kind, id, err)
	}
	rec, err := repository.DecodeRecord(b)
	if err != nil {
		return repository.Record{}, fmt.Errorf("posixfs: %s %s: %w", kind, id, err)
	}
	if rec.Kind != kind || rec.ID != id {
		return repository.Record{}, fmt.Errorf("%w: file for %s %s holds %s %s", repository.ErrInvalid, kind, id, rec.Kind, rec.ID)
	}
	return rec, nil
}

// PutRecord implements repository.Repository: under the record's lock it
// reads the stored revision, checks it, and replaces the file atomically.
func (r *Repo) PutRecord(ctx context.Context, rec repository.Record) (repository.Record, error) {
	if err := checkName(rec.Kind, rec.ID); err != nil {
		return repository.Record{}, err
	}
	l, err := r.lock(ctx, r.path("records", string(rec.Kind), rec.ID+".lock"))
	if err != nil {
		return repository.Record{}, err
	}
	defer r.unlock(l)
	var stored *repository.Record
	switch cur, err := r.readRecord(rec.Kind, rec.ID); {
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
	if err := r.writeFileAtomic(r.recordPath(rec.Kind, rec.ID), b); err != nil {
		return repository.Record{}, err
	}
	return next, nil
}

// DeleteRecord implements repository.Repository.
func (r *Repo) DeleteRecord(ctx context.Context, kind repository.Kind, id string) error {
	if err := checkName(kind, id); err != nil {
		return err
	}
	l, err := r.lock(ctx, r.path("records", string(kind), id+".lock"))
	if err != nil {
		return err
	}
	defer r.unlock(l)
	if err := os.Remove(r.recordPath(kind, id)); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("posixfs: %w", err)
	}
	return syncDir(r.path("records", string(kind)))
}

// ListRecords implements repository.Repository. A record deleted between
// the directory scan and its read is skipped; a corrupt one is an error, as
// GC must not run on a partial view of references.
func (r *Repo) ListRecords(ctx context.Context, kind repository.Kind, o repository.ListOptions) (repository.Page, error) {
	o, err := repository.NormalizeList(kind, o)
	if err != nil {
		return repository.Page{}, err
	}
	ents, err := os.ReadDir(r.path("records", string(kind)))
	if err != nil {
		return repository.Page{}, fmt.Errorf("posixfs: %w", err)
	}
	ids := make([]string, 0, len(ents))
	for _, e := range ents {
		id, ok := strings.CutSuffix(e.Name(), ".json")
		if ok && repository.ValidateID(id) == nil {
			ids = append(ids, id)
		}
	}
	sort.Strings(ids)
	var page repository.Page
	want, after := o.Limit, o.After
	for {
		var sel []string
		sel, page.Next = repository.FilterIDs(ids, repository.ListOptions{Prefix: o.Prefix, After: after, Limit: want - len(page.Records)})
		for _, id := range sel {
			if err := ctx.Err(); err != nil {
				return repository.Page{}, err
			}
			rec, err := r.readRecord(kind, id)
			if errors.Is(err, repository.ErrNotFound) {
				continue
			}
			if err != nil {
				return repository.Page{}, err
			}
			page.Records = append(page.Records, rec)
		}
		// Refill a page thinned by concurrent deletes so that a short page
		// only ever means the last one.
		if page.Next == "" || len(page.Records) == want {
			return page, nil
		}
		after = page.Next
	}
}
