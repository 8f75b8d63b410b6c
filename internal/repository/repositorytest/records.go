package repositorytest

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sort"
	"sync"
	"testing"
	"time"

	"github.com/aenv-dev/aenv/internal/repository"
)

// Record returns a valid pending record naming the digests as rootfs layers.
func Record(kind repository.Kind, id string, digests ...repository.Digest) repository.Record {
	rec := repository.Record{
		Kind: kind, ID: id, State: repository.StatePending,
		Resources:   repository.Resources{CPUCount: 2, MemoryMB: 512},
		Config:      json.RawMessage(`{"env":{"A":"1"},"start_cmd":"sleep 1"}`),
		EnvdVersion: "0.1.0", Backend: "oci", SourceSandboxID: "sbx-1",
	}
	for _, d := range digests {
		rec.Layers = append(rec.Layers, repository.Layer{Role: "rootfs", Digest: d, Size: 1})
	}
	return rec
}

func testRecords(t *testing.T, r repository.Repository) {
	ctx := context.Background()
	_, d := Blob(60, 10)
	rec := Record(repository.KindSnapshot, "snap-1", d)
	rec.ParentSnapshotID = "snap-0"
	rec.Name = "my-snap"

	created, err := r.PutRecord(ctx, rec)
	if err != nil {
		t.Fatalf("create: %v", err)
	}
	if created.Revision != 1 || created.Version != repository.RecordVersion || created.CreatedAt.IsZero() || created.UpdatedAt.IsZero() {
		t.Fatalf("created = %+v", created)
	}
	got, err := r.GetRecord(ctx, repository.KindSnapshot, "snap-1")
	if err != nil {
		t.Fatal(err)
	}
	if !sameRecord(got, created) {
		t.Fatalf("GetRecord = %+v\nwant %+v", got, created)
	}
	// Kinds are separate namespaces.
	if _, err := r.GetRecord(ctx, repository.KindTemplate, "snap-1"); !errors.Is(err, repository.ErrNotFound) {
		t.Fatalf("template snap-1: %v, want ErrNotFound", err)
	}
	if _, err := r.PutRecord(ctx, rec); !errors.Is(err, repository.ErrExists) {
		t.Fatalf("second create: %v, want ErrExists", err)
	}

	upd := created
	upd.State = repository.StateComplete
	updated, err := r.PutRecord(ctx, upd)
	if err != nil {
		t.Fatalf("update: %v", err)
	}
	if updated.Revision != 2 || !updated.CreatedAt.Equal(created.CreatedAt) || updated.State != repository.StateComplete {
		t.Fatalf("updated = %+v", updated)
	}
	if _, err := r.PutRecord(ctx, upd); !errors.Is(err, repository.ErrConflict) {
		t.Fatalf("stale update: %v, want ErrConflict", err)
	}

	// Bad records are refused and change nothing.
	for name, mutate := range map[string]func(*repository.Record){
		"bad state":        func(r *repository.Record) { r.State = "done" },
		"bad layer digest": func(r *repository.Record) { r.Layers[0].Digest = "sha256:xyz" },
		"negative size":    func(r *repository.Record) { r.Layers[0].Size = -1 },
		"bad parent":       func(r *repository.Record) { r.ParentSnapshotID = "../x" },
		"bad config":       func(r *repository.Record) { r.Config = json.RawMessage(`{`) },
		"future version":   func(r *repository.Record) { r.Version = repository.RecordVersion + 1 },
		"negative cpu":     func(r *repository.Record) { r.Resources.CPUCount = -1 },
	} {
		bad := updated
		bad.Layers = slices.Clone(updated.Layers)
		mutate(&bad)
		if _, err := r.PutRecord(ctx, bad); !errors.Is(err, repository.ErrInvalid) {
			t.Errorf("%s: %v, want ErrInvalid", name, err)
		}
	}
	if got, err := r.GetRecord(ctx, repository.KindSnapshot, "snap-1"); err != nil || !sameRecord(got, updated) {
		t.Fatalf("after refused writes: %+v, %v", got, err)
	}

	missing := Record(repository.KindTemplate, "ghost")
	missing.Revision = 3
	if _, err := r.PutRecord(ctx, missing); !errors.Is(err, repository.ErrNotFound) {
		t.Fatalf("update of a missing record: %v, want ErrNotFound", err)
	}
	if err := r.DeleteRecord(ctx, repository.KindSnapshot, "snap-1"); err != nil {
		t.Fatal(err)
	}
	if _, err := r.GetRecord(ctx, repository.KindSnapshot, "snap-1"); !errors.Is(err, repository.ErrNotFound) {
		t.Fatalf("after delete: %v", err)
	}
	if err := r.DeleteRecord(ctx, repository.KindSnapshot, "snap-1"); err != nil {
		t.Fatalf("deleting a missing record: %v", err)
	}
	if _, err := r.PutRecord(ctx, rec); err != nil {
		t.Fatalf("re-create after delete: %v", err)
	}
}

func sameRecord(a, b repository.Record) bool {
	ja, _ := repository.EncodeRecord(a)
	jb, _ := repository.EncodeRecord(b)
	return bytes.Equal(ja, jb)
}

func testListPaging(t *testing.T, r repository.Repository) {
	ctx := context.Background()
	// Ids that sort differently from their names with a suffix appended
	// ("a" < "a-b" but "a.json" > "a-b.json") catch key-order paging bugs.
	ids := []string{"a", "a-b", "a.b", "a_b", "a0", "b", "B", "snap-01", "snap-02", "snap-10", "z"}
	for i := range 14 {
		ids = append(ids, fmt.Sprintf("tpl-%03d", i))
	}
	for _, id := range ids {
		if _, err := r.PutRecord(ctx, Record(repository.KindTemplate, id)); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := r.PutRecord(ctx, Record(repository.KindSnapshot, "other-kind")); err != nil {
		t.Fatal(err)
	}
	sort.Strings(ids)
	for _, tc := range []struct {
		prefix string
		limit  int
	}{{"", 7}, {"", 1}, {"", 1000}, {"", 0}, {"tpl-", 4}, {"a", 2}, {"snap-0", 5}, {"nomatch", 3}} {
		t.Run(fmt.Sprintf("prefix=%q,limit=%d", tc.prefix, tc.limit), func(t *testing.T) {
			var want, got []string
			for _, id := range ids {
				if len(id) >= len(tc.prefix) && id[:len(tc.prefix)] == tc.prefix {
					want = append(want, id)
				}
			}
			o := repository.ListOptions{Prefix: tc.prefix, Limit: tc.limit}
			for pages := 0; ; pages++ {
				if pages > len(ids)+1 {
					t.Fatal("paging does not end")
				}
				p, err := r.ListRecords(ctx, repository.KindTemplate, o)
				if err != nil {
					t.Fatal(err)
				}
				if tc.limit > 0 && len(p.Records) > tc.limit {
					t.Fatalf("page of %d records, limit %d", len(p.Records), tc.limit)
				}
				for _, rec := range p.Records {
					got = append(got, rec.ID)
				}
				if p.Next == "" {
					break
				}
				o.After = p.Next
			}
			if !slices.Equal(got, want) {
				t.Fatalf("listed %v\nwant   %v", got, want)
			}
		})
	}
	if _, err := r.ListRecords(ctx, repository.KindTemplate, repository.ListOptions{Limit: repository.MaxListLimit + 1}); !errors.Is(err, repository.ErrInvalid) {
		t.Fatalf("oversized limit: %v", err)
	}
}

func testConcurrentBlobs(t *testing.T, r repository.Repository) {
	ctx := context.Background()
	b, d := Blob(70, 2<<20)
	var wg sync.WaitGroup
	errs := make([]error, 6)
	for i := range errs {
		wg.Go(func() {
			_, errs[i] = r.PutBlob(ctx, d, int64(len(b)), bytes.NewReader(b))
		})
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Errorf("writer %d: %v", i, err)
		}
	}
	if got := mustGet(t, r, d); !bytes.Equal(got, b) {
		t.Fatal("blob written concurrently differs")
	}
}

// testConcurrentRecords: writers racing on one record never lose an update
// (each increments a counter with compare-and-swap retries), and of racing
// creators exactly one wins.
func testConcurrentRecords(t *testing.T, r repository.Repository) {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	const writers, each = 4, 5
	if _, err := r.PutRecord(ctx, withCounter(Record(repository.KindTemplate, "counter"), 0)); err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	errs := make(chan error, writers)
	for range writers {
		wg.Go(func() {
			for range each {
				for {
					cur, err := r.GetRecord(ctx, repository.KindTemplate, "counter")
					if err != nil {
						errs <- err
						return
					}
					_, err = r.PutRecord(ctx, withCounter(cur, counter(cur)+1))
					if err == nil {
						break
					}
					if !errors.Is(err, repository.ErrConflict) && !errors.Is(err, repository.ErrLocked) {
						errs <- err
						return
					}
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	final, err := r.GetRecord(ctx, repository.KindTemplate, "counter")
	if err != nil {
		t.Fatal(err)
	}
	if counter(final) != writers*each || final.Revision != writers*each+1 {
		t.Fatalf("counter %d revision %d, want %d and %d: updates were lost", counter(final), final.Revision, writers*each, writers*each+1)
	}

	var wins sync.WaitGroup
	results := make([]error, 6)
	for i := range results {
		wins.Go(func() {
			_, results[i] = r.PutRecord(ctx, withCounter(Record(repository.KindSnapshot, "race"), i))
		})
	}
	wins.Wait()
	won := 0
	for _, err := range results {
		switch {
		case err == nil:
			won++
		case errors.Is(err, repository.ErrExists), errors.Is(err, repository.ErrConflict), errors.Is(err, repository.ErrLocked):
		default:
			t.Errorf("racing create: %v", err)
		}
	}
	if won != 1 {
		t.Fatalf("%d racing creates succeeded, want exactly 1", won)
	}
}

func withCounter(rec repository.Record, n int) repository.Record {
	rec.Config = json.RawMessage(fmt.Sprintf(`{"n":%d}`, n))
	return rec
}

func counter(rec repository.Record) int {
	var c struct{ N int }
	_ = json.Unmarshal(rec.Config, &c)
	return c.N
}

func testGC(t *testing.T, r repository.Repository) {
	ctx := context.Background()
	var ds []repository.Digest
	for i := range 6 {
		b, _ := Blob(uint64(80+i), 1000+i)
		ds = append(ds, put(t, r, b))
	}
	tpl, snap, pinned, pendingOnly, orphan, orphan2 := ds[0], ds[1], ds[2], ds[3], ds[4], ds[5]
	c := Record(repository.KindTemplate, "tpl", tpl)
	c.State = repository.StateComplete
	mustPut(t, r, c)
	mustPut(t, r, Record(repository.KindSnapshot, "snap", snap, tpl))
	// A publication in progress: its record is pending and names a blob
	// that is already uploaded.
	mustPut(t, r, Record(repository.KindSnapshot, "publishing", pendingOnly))

	// Within the grace period nothing unreferenced goes.
	res, err := repository.GC(ctx, r, repository.GCOptions{Logger: quiet(), Pinned: []repository.Digest{pinned}, Grace: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	if len(res.Deleted) != 0 || res.InUse != 2 || res.Blobs != 6 {
		t.Fatalf("GC with grace = %+v, want nothing deleted, 2 in use", res)
	}
	dry, err := repository.GC(ctx, r, repository.GCOptions{Logger: quiet(), Pinned: []repository.Digest{pinned}, Grace: -1, DryRun: true})
	if err != nil || len(dry.Deleted) != 2 {
		t.Fatalf("dry run = %+v, %v", dry, err)
	}
	if _, err := r.StatBlob(ctx, orphan); err != nil {
		t.Fatalf("dry run deleted: %v", err)
	}
	res, err = repository.GC(ctx, r, repository.GCOptions{Logger: quiet(), Pinned: []repository.Digest{pinned}, Grace: -1})
	if err != nil {
		t.Fatal(err)
	}
	slices.Sort(res.Deleted)
	want := []repository.Digest{orphan, orphan2}
	slices.Sort(want)
	if !slices.Equal(res.Deleted, want) || res.DeletedBytes != 1004+1005 {
		t.Fatalf("GC deleted %v (%d bytes), want %v", res.Deleted, res.DeletedBytes, want)
	}
	for _, d := range []repository.Digest{tpl, snap, pinned, pendingOnly} {
		if _, err := r.StatBlob(ctx, d); err != nil {
			t.Errorf("referenced blob %s: %v", d, err)
		}
	}
	for _, d := range want {
		if _, err := r.StatBlob(ctx, d); !errors.Is(err, repository.ErrNotFound) {
			t.Errorf("orphan %s after GC: %v", d, err)
		}
	}

	// Deleting a snapshot frees only the layers nobody else references.
	if err := r.DeleteRecord(ctx, repository.KindSnapshot, "snap"); err != nil {
		t.Fatal(err)
	}
	res, err = repository.GC(ctx, r, repository.GCOptions{Logger: quiet(), Grace: -1})
	if err != nil {
		t.Fatal(err)
	}
	slices.Sort(res.Deleted)
	want = []repository.Digest{snap, pinned}
	slices.Sort(want)
	if !slices.Equal(res.Deleted, want) {
		t.Fatalf("GC after deleting snap removed %v, want %v", res.Deleted, want)
	}

	// The conditional delete keeps a blob used after the cutoff.
	b, d := Blob(90, 2000)
	put(t, r, b)
	if err := r.DeleteBlobIfUnused(ctx, d, time.Now().Add(-time.Hour)); !errors.Is(err, repository.ErrInUse) {
		t.Fatalf("DeleteBlobIfUnused of a fresh blob: %v, want ErrInUse", err)
	}
	if _, err := r.StatBlob(ctx, d); err != nil {
		t.Fatalf("blob kept in use is gone: %v", err)
	}
	if err := r.DeleteBlobIfUnused(ctx, d, time.Now().Add(time.Hour)); err != nil {
		t.Fatalf("DeleteBlobIfUnused past its use: %v", err)
	}
	if _, err := r.StatBlob(ctx, d); !errors.Is(err, repository.ErrNotFound) {
		t.Fatalf("conditionally deleted blob still there: %v", err)
	}
}

func mustPut(t *testing.T, r repository.Repository, rec repository.Record) repository.Record {
	t.Helper()
	out, err := r.PutRecord(context.Background(), rec)
	if err != nil {
		t.Fatalf("PutRecord %s %s: %v", rec.Kind, rec.ID, err)
	}
	return out
}

func quiet() *slog.Logger { return slog.New(slog.DiscardHandler) }
