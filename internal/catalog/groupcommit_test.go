package catalog

import (
	"errors"
	"fmt"
	"path/filepath"
	"sync"
	"testing"
	"time"

	bolt "go.etcd.io/bbolt"
)

// TestSandboxesConcurrentWrites: 64 writers at once, puts then deletes of half; every
// write is in the file once they return (read back after a reopen).
func TestSandboxesConcurrentWrites(t *testing.T) {
	path := filepath.Join(t.TempDir(), "aenv.db")
	c, err := Open(path)
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	for i := range 64 {
		wg.Go(func() {
			id := fmt.Sprintf("sbx-%d", i)
			if err := c.Sandboxes().Put(id, []byte(id)); err != nil {
				t.Error(err)
			}
			if i%2 == 1 {
				if err := c.Sandboxes().Delete(id); err != nil {
					t.Error(err)
				}
			}
		})
	}
	wg.Wait()
	if err := c.Close(); err != nil {
		t.Fatal(err)
	}
	if c, err = Open(path); err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	all, err := c.Sandboxes().All()
	if err != nil {
		t.Fatal(err)
	}
	if len(all) != 32 {
		t.Fatalf("%d records, want 32", len(all))
	}
	for i := 0; i < 64; i += 2 {
		if id := fmt.Sprintf("sbx-%d", i); string(all[id]) != id {
			t.Fatalf("record %s: %q", id, all[id])
		}
	}
}

// TestGroupCommit: writes that arrive while a transaction commits share the next one;
// a write that fails there fails alone, and the rest are committed without it.
func TestGroupCommit(t *testing.T) {
	c, err := Open(filepath.Join(t.TempDir(), "aenv.db"))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	g := &groupCommit{db: c.db}
	put := func(id string, txs *[]int, mu *sync.Mutex) func(*bolt.Tx) error {
		return func(tx *bolt.Tx) error {
			mu.Lock()
			*txs = append(*txs, tx.ID())
			mu.Unlock()
			return tx.Bucket(bucketSandboxes).Put([]byte(id), []byte(id))
		}
	}
	release := make(chan struct{})
	entered := make(chan struct{})
	first := make(chan error, 1)
	go func() {
		first <- g.do(func(tx *bolt.Tx) error {
			close(entered)
			<-release // holds the first transaction open while the others queue
			return tx.Bucket(bucketSandboxes).Put([]byte("first"), nil)
		})
	}()
	<-entered
	var mu sync.Mutex
	var txs []int
	errBad := errors.New("bad record")
	var wg sync.WaitGroup
	errs := make([]error, 8)
	for i := range 8 {
		wg.Go(func() {
			if i == 3 {
				errs[i] = g.do(func(*bolt.Tx) error { return errBad })
				return
			}
			errs[i] = g.do(put(fmt.Sprintf("w%d", i), &txs, &mu))
		})
	}
	for { // every writer queued behind the first transaction
		g.mu.Lock()
		n := len(g.pending)
		g.mu.Unlock()
		if n == 8 {
			break
		}
		time.Sleep(time.Millisecond)
	}
	close(release)
	wg.Wait()
	if err := <-first; err != nil {
		t.Fatal(err)
	}
	for i, err := range errs {
		if (i == 3) != errors.Is(err, errBad) || (i != 3 && err != nil) {
			t.Fatalf("write %d: %v", i, err)
		}
	}
	// The group ran once with the failing write (rolled back) and once without it, each
	// time in one transaction.
	seen := map[int]int{}
	for _, id := range txs {
		seen[id]++
	}
	if len(seen) > 2 {
		t.Fatalf("7 writes ran in %d transactions: %v", len(seen), txs)
	}
	all, err := c.Sandboxes().All()
	if err != nil {
		t.Fatal(err)
	}
	if len(all) != 8 { // first and the 7 good ones
		t.Fatalf("%d records, want 8: %v", len(all), all)
	}
}

// TestGroupCommitPanic: a write that panics fails its group, and later writes still run.
func TestGroupCommitPanic(t *testing.T) {
	c, err := Open(filepath.Join(t.TempDir(), "aenv.db"))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	g := &groupCommit{db: c.db}
	if err := g.do(func(*bolt.Tx) error { panic("boom") }); err == nil {
		t.Fatal("no error from a panicking write")
	}
	if err := c.Sandboxes().Put("after", []byte("x")); err != nil {
		t.Fatal(err)
	}
	if err := g.do(func(tx *bolt.Tx) error { return tx.Bucket(bucketSandboxes).Put([]byte("again"), nil) }); err != nil {
		t.Fatal(err)
	}
}
