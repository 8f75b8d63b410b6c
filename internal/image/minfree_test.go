package image

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"runtime"
	"testing"

	"github.com/aenv-dev/aenv/internal/image/unpack"
)

// TestBuildTemplateMinFree: an image that would leave less than MinFree on the disk is
// refused with unpack.ErrNoSpace, and leaves no template directory.
func TestBuildTemplateMinFree(t *testing.T) {
	requireRoot(t)
	host := serveRegistry(t, nil)
	push(t, host+"/app:1", testImage(t, runtime.GOARCH))
	ctx := context.Background()
	img, err := Pull(ctx, host+"/app:1", Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer img.Close()
	store := &Store{Dir: t.TempDir()}
	dir := filepath.Join(t.TempDir(), "tpl")
	// More free space than any disk has.
	_, err = BuildTemplate(ctx, img, dir, BuildOptions{Store: store, MinFree: 1 << 60})
	if !errors.Is(err, unpack.ErrNoSpace) {
		t.Fatalf("err = %v, want ErrNoSpace", err)
	}
	if ents, _ := os.ReadDir(filepath.Dir(dir)); len(ents) != 0 {
		t.Errorf("left behind: %v", ents)
	}
	if _, err := BuildTemplate(ctx, img, dir, BuildOptions{Store: store, MinFree: -1}); err != nil {
		t.Fatalf("without the check: %v", err)
	}
}
