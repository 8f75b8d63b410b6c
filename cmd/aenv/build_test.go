package main

import (
	"archive/tar"
	"bytes"
	"errors"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

func TestTarContext(t *testing.T) {
	dir := t.TempDir()
	for p, body := range map[string]string{"a.txt": "a", "b.txt": "b", "sub/c": "c", "sub/deep/d": "d"} {
		os.MkdirAll(filepath.Join(dir, filepath.Dir(p)), 0o755)
		os.WriteFile(filepath.Join(dir, p), []byte(body), 0o644)
	}
	os.Symlink("a.txt", filepath.Join(dir, "link"))
	names := func(src string) ([]string, []byte, error) {
		var buf bytes.Buffer
		if _, err := tarContext(&buf, dir, src); err != nil {
			return nil, nil, err
		}
		tr := tar.NewReader(bytes.NewReader(buf.Bytes()))
		var out []string
		for {
			h, err := tr.Next()
			if errors.Is(err, io.EOF) {
				return out, buf.Bytes(), nil
			}
			if err != nil {
				return nil, nil, err
			}
			out = append(out, h.Name)
		}
	}
	tests := []struct {
		src  string
		want string
		err  string
	}{
		{"a.txt", "a.txt", ""},
		{"/a.txt", "a.txt", ""},
		{"*.txt", "a.txt b.txt", ""},
		{"sub", "sub/ sub/c sub/deep/ sub/deep/d", ""},
		{"link", "link", ""},
		{"nope", "", "no such file"},
		{"../x", "", "leaves the build context"},
	}
	for _, tt := range tests {
		got, _, err := names(tt.src)
		if tt.err != "" {
			if err == nil || !strings.Contains(err.Error(), tt.err) {
				t.Errorf("%s: err = %v, want %q", tt.src, err, tt.err)
			}
			continue
		}
		if err != nil || strings.Join(got, " ") != tt.want {
			t.Errorf("%s: %v, %v; want %s", tt.src, got, err, tt.want)
		}
	}
	// Same files, same archive: the hash that names an upload does not depend on mtimes.
	_, a, _ := names("sub")
	old := time.Unix(1e9, 0)
	os.Chtimes(filepath.Join(dir, "sub/c"), old, old)
	_, b, _ := names("sub")
	if !bytes.Equal(a, b) {
		t.Error("archive changed with an mtime")
	}
}
