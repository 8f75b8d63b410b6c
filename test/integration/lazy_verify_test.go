package integration

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/aenv-dev/aenv/internal/bench"
	"github.com/aenv-dev/aenv/internal/repository"
	"github.com/aenv-dev/aenv/internal/repository/posixfs"
)

// TestLazyReadsVerified: a layer that node B reads lazily is corrupted in the shared
// repository after A published it. B's sandbox gets I/O errors for the corrupted chunks
// (never the wrong bytes), B counts the failures, and B keeps serving; once the bytes
// are restored the same sandbox reads the file intact, because nothing unverified was
// cached.
func TestLazyReadsVerified(t *testing.T) {
	p := startPair(t)
	a, b := p.a, p.b
	ctx, cancel := context.WithTimeout(context.Background(), 6*time.Minute)
	defer cancel()
	ca, cb := a.client(), b.client()

	src := a.create(ctx, ca)
	run(ctx, t, ca, src, "head -c 67108864 /dev/urandom > /home/user/big")
	want := run(ctx, t, ca, src, "sha256sum < /home/user/big")
	snap := takeSnapshot(ctx, t, a, src.ID, "")
	if !waitFor(3*time.Minute, func() bool { return b.listsSnapshot(ctx, t, snap) }) {
		t.Fatalf("node B never listed snapshot %s", snap)
	}

	// The snapshot's own layer (the last, holding the big file) is corrupted in three
	// places spread over its data.
	repo, err := posixfs.Open(p.repo, posixfs.Options{})
	if err != nil {
		t.Fatal(err)
	}
	rec, err := repo.GetRecord(ctx, repository.KindSnapshot, snap)
	if err != nil {
		t.Fatal(err)
	}
	top := rec.Layers[len(rec.Layers)-1]
	blob := filepath.Join(p.repo, "blobs", "sha256", top.Digest.Hex())
	orig, err := os.ReadFile(blob)
	if err != nil {
		t.Fatal(err)
	}
	bad := append([]byte(nil), orig...)
	for _, at := range []int{len(bad) / 4, len(bad) / 2, 3 * len(bad) / 4} {
		for i := at; i < at+4096 && i < len(bad); i++ {
			bad[i] ^= 0xff
		}
	}
	writeBlob := func(data []byte) {
		t.Helper()
		if err := os.WriteFile(blob, data, 0o444); err != nil {
			t.Fatal(err)
		}
	}
	writeBlob(bad)
	t.Cleanup(func() { writeBlob(orig) })

	before := b.metric(ctx, t, "aenv_repository_verify_failures_total")
	child, err := cb.Create(ctx, bench.CreateRequest{TemplateID: snap, Timeout: 300, Secure: true})
	if err != nil {
		t.Fatalf("create on B from the snapshot: %v", err)
	}
	b.observe()
	res, err := cb.Run(ctx, child, "sha256sum < /home/user/big")
	if err != nil {
		t.Fatalf("read the big file on B: %v", err)
	}
	if res.ExitCode == 0 {
		t.Fatalf("reading a corrupted layer succeeded (sha256 %s, want an I/O error; A wrote %s)", strings.TrimSpace(res.Stdout), want)
	}
	if !strings.Contains(res.Stderr, "error") {
		t.Errorf("the failed read says %q, want an I/O error", res.Stderr)
	}
	if got := b.metric(ctx, t, "aenv_repository_verify_failures_total"); got <= before {
		t.Errorf("verify failures %d → %d: the corruption was not counted", before, got)
	}
	// B keeps serving other sandboxes.
	other := b.create(ctx, cb)
	if got := run(ctx, t, cb, other, "echo ok"); got != "ok" {
		t.Fatalf("a base sandbox on B says %q", got)
	}

	writeBlob(orig)
	if got := run(ctx, t, cb, child, "sha256sum < /home/user/big"); got != want {
		t.Fatalf("after the repair B reads %s, A wrote %s", got, want)
	}
	killAll(ctx, t, ca)
	killAll(ctx, t, cb)
	a.stop()
	b.stop()
	requireNoLeftovers(t, a, nil)
	requireNoLeftovers(t, b, nil)
}
