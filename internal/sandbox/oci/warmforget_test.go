package oci

import (
	"context"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/aenv-dev/aenv/internal/sandbox"
)

// openFiles lists this process's open files whose path contains s (the FUSE server of a
// block root runs in the backend's process and holds its layer files open).
func openFiles(t *testing.T, s string) []string {
	t.Helper()
	fds, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, fd := range fds {
		if l, err := os.Readlink(filepath.Join("/proc/self/fd", fd.Name())); err == nil && strings.Contains(l, s) {
			out = append(out, l)
		}
	}
	return out
}

func copyFile(t *testing.T, src, dst string) {
	t.Helper()
	in, err := os.Open(src)
	if err != nil {
		t.Fatal(err)
	}
	defer in.Close()
	out, err := os.Create(dst)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := io.Copy(out, in); err != nil {
		t.Fatal(err)
	}
	if err := out.Close(); err != nil {
		t.Fatal(err)
	}
}

// warmKeys counts the templates wanted warm and their warm containers (blank ones hold no
// template: forgetting templates leaves them).
func warmKeys(b *Backend) int {
	b.warm.mu.Lock()
	defer b.warm.mu.Unlock()
	n := 0
	for k, q := range b.warm.ready {
		if k != blankKey {
			n += len(q)
		}
	}
	for _, k := range b.warm.wanted {
		if k != blankKey {
			n++
		}
	}
	return n
}

// TestForgetTemplate: a template replaced or deleted while warm containers of it wait in
// the pool has them stopped at once by ForgetTemplate: no warm container, mount, loop
// device or open file refers to the old version's layers afterwards, its deleted layer
// file is really freed, and other templates' warm containers stay.
func TestForgetTemplate(t *testing.T) {
	e := newTestBackend(t, func(c *Config) { c.WarmContainers = 2 })
	base := testLayered(t)
	ctx := context.Background()
	dir := t.TempDir()
	// Two versions of one template: the same content in distinct layer files, as a
	// rebuild makes.
	old := filepath.Join(dir, "v1.commit")
	copyFile(t, base.Layers[0].Path, old)
	v1 := base
	v1.Layers = []sandbox.LayerRef{base.Layers[0]}
	v1.Layers[0].Path = old
	cur := filepath.Join(dir, "v2.commit")
	copyFile(t, base.Layers[0].Path, cur)
	v2 := base
	v2.Layers = []sandbox.LayerRef{base.Layers[0]}
	v2.Layers[0].Path = cur

	s1 := e.launchBlock(t, "fg1", v1, sandbox.Resources{})
	waitWarm(t, e.b, blockKey(layerRefs(v1.Layers), nil, v1.VirtualSize), 2)
	s2 := e.launchBlock(t, "fg2", v2, sandbox.Resources{})
	waitWarm(t, e.b, blockKey(layerRefs(v2.Layers), nil, v2.VirtualSize), 2)
	for _, i := range []*Instance{s1, s2} {
		if err := i.Stop(ctx); err != nil {
			t.Fatal(err)
		}
	}
	if len(openFiles(t, old)) == 0 {
		t.Fatal("no warm container holds the old layer open: the test proves nothing")
	}
	// Replaced: the old version's layer file is deleted, then its warm roots forgotten.
	if err := os.Remove(old); err != nil {
		t.Fatal(err)
	}
	if err := e.b.ForgetTemplate(ctx, v1); err != nil {
		t.Fatal(err)
	}
	if f := openFiles(t, old); len(f) > 0 {
		t.Fatalf("old layer still open after ForgetTemplate: %v", f)
	}
	e.b.warm.mu.Lock()
	oldLeft := len(e.b.warm.ready[blockKey(layerRefs(v1.Layers), nil, v1.VirtualSize)])
	e.b.warm.mu.Unlock()
	if oldLeft > 0 {
		t.Fatalf("%d warm containers of the old version left", oldLeft)
	}
	for _, l := range blockLeftovers(t, old) {
		t.Errorf("left behind for the old version: %s", l)
	}
	// The current version stays warm, and a launch of it takes a warm container.
	waitWarm(t, e.b, blockKey(layerRefs(v2.Layers), nil, v2.VirtualSize), 2)
	s3 := e.launchBlock(t, "fg3", v2, sandbox.Resources{})
	if !strings.HasPrefix(s3.cid, "warm.") {
		t.Fatalf("launch of the kept template: cid %s, want a warm container", s3.cid)
	}
	if err := s3.Stop(ctx); err != nil {
		t.Fatal(err)
	}

	// Deleted: forgetting the current version leaves nothing warm at all.
	if err := e.b.ForgetTemplate(ctx, v2); err != nil {
		t.Fatal(err)
	}
	if n := warmKeys(e.b); n != 0 {
		t.Fatalf("%d warm entries left after the last template was forgotten", n)
	}
	if f := openFiles(t, dir); len(f) > 0 {
		t.Fatalf("layers still open: %v", f)
	}
	if left := blockLeftovers(t, e.cfg.DataDir); len(left) > 0 {
		t.Fatalf("left behind: %v", left)
	}
}

// TestForgetTemplateDir: the warm containers of a directory template go when it is
// forgotten (its retired rootfs can then be removed), those of another template stay.
func TestForgetTemplateDir(t *testing.T) {
	needRuntime(t)
	e := newTestBackend(t, func(c *Config) { c.WarmContainers = 1 })
	ctx := context.Background()
	i := e.launch(t, "fd1", sandbox.Resources{})
	waitWarm(t, e.b, e.template, 1)
	if err := i.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	// Another directory is not this template.
	if err := e.b.ForgetTemplate(ctx, sandbox.RootFS{LowerDir: t.TempDir()}); err != nil {
		t.Fatal(err)
	}
	waitWarm(t, e.b, e.template, 1)
	if err := e.b.ForgetTemplate(ctx, sandbox.RootFS{LowerDir: e.template}); err != nil {
		t.Fatal(err)
	}
	if n := warmKeys(e.b); n != 0 {
		t.Fatalf("%d warm entries left", n)
	}
	if left := blockLeftovers(t, filepath.Join(e.cfg.DataDir, "sandboxes", "warm.")); len(left) > 0 {
		t.Fatalf("warm container mounts left: %v", left)
	}
}
