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
		if _, err := tarContext(&buf, dir, src, nil); err != nil {
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
	// COPY keeps modification times: they travel in the archive (and so name it).
	old := time.Unix(1e9, 0)
	_, a, _ := names("sub")
	os.Chtimes(filepath.Join(dir, "sub/c"), old, old)
	_, b, _ := names("sub")
	if bytes.Equal(a, b) {
		t.Error("archive did not change with an mtime")
	}
	tr := tar.NewReader(bytes.NewReader(b))
	for {
		h, err := tr.Next()
		if err != nil {
			t.Fatal("sub/c not in the archive")
		}
		if h.Name == "sub/c" {
			if !h.ModTime.Equal(old) {
				t.Errorf("sub/c mtime %v, want %v", h.ModTime, old)
			}
			break
		}
	}
}

func TestDockerignore(t *testing.T) {
	tests := []struct {
		name, ignore string
		excluded     []string
		included     []string
	}{
		{"plain names and dirs", "secret.txt\nnode_modules\n# comment\n\n",
			[]string{"secret.txt", "node_modules", "node_modules/x/y.js"}, []string{"a/secret.txt", "src/node_modules"}},
		{"star stays in one dir", "*.log\n*/tmp\n",
			[]string{"a.log", "x/tmp", "x/tmp/f"}, []string{"d/a.log", "x/y/tmp"}},
		{"double star crosses dirs", "**/*.log\nbuild/**\n",
			[]string{"a.log", "d/e/a.log", "build/x", "build/x/y"}, []string{"a.txt"}},
		{"exceptions, last line wins", "*.md\n!README.md\nREADME.md\n!docs/keep.md\n",
			[]string{"x.md", "README.md"}, []string{"docs/keep.md", "x.txt"}},
		{"exception inside an excluded dir", "vendor\n!vendor/keep\n",
			[]string{"vendor/a", "vendor"}, []string{"vendor/keep", "vendor/keep/f"}},
		{"cleaned, leading slash, question mark, class", "/./a/../b?.txt\n[xy].c\n",
			[]string{"b1.txt", "x.c", "y.c"}, []string{"b12.txt", "z.c", "a/b1.txt"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			di, err := parseDockerignore(strings.NewReader(tt.ignore))
			if err != nil {
				t.Fatal(err)
			}
			for _, p := range tt.excluded {
				if !di.excluded(p) {
					t.Errorf("%s is not excluded", p)
				}
			}
			for _, p := range tt.included {
				if di.excluded(p) {
					t.Errorf("%s is excluded", p)
				}
			}
		})
	}
	if _, err := parseDockerignore(strings.NewReader("ok\n!\n")); err == nil || !strings.Contains(err.Error(), "line 2") {
		t.Errorf("a bare '!' parsed: %v", err)
	}
}

// TestTarContextDockerignore: files .dockerignore excludes never reach the archive, a
// source it excludes entirely is an error, and a Dockerfile-specific ignore file wins.
func TestTarContextDockerignore(t *testing.T) {
	dir := t.TempDir()
	for _, p := range []string{"app/main.go", "app/.env", "app/node_modules/m/x.js", "app/node_modules/keep/k.js", "secret.key"} {
		os.MkdirAll(filepath.Join(dir, filepath.Dir(p)), 0o755)
		os.WriteFile(filepath.Join(dir, p), []byte(p), 0o644)
	}
	os.WriteFile(filepath.Join(dir, ".dockerignore"), []byte("**/.env\napp/node_modules\n!app/node_modules/keep\n*.key\n"), 0o644)
	di, from, err := loadDockerignore(dir, filepath.Join(dir, "Dockerfile"))
	if err != nil || from != filepath.Join(dir, ".dockerignore") {
		t.Fatal(from, err)
	}
	var buf bytes.Buffer
	if _, err := tarContext(&buf, dir, ".", di); err != nil {
		t.Fatal(err)
	}
	var got []string
	tr := tar.NewReader(&buf)
	for {
		h, err := tr.Next()
		if err != nil {
			break
		}
		if h.Typeflag == tar.TypeReg {
			got = append(got, h.Name)
		}
	}
	if strings.Join(got, " ") != ".dockerignore app/main.go app/node_modules/keep/k.js" {
		t.Errorf("archive holds %q", got)
	}
	if _, err := tarContext(io.Discard, dir, "secret.key", di); err == nil || !strings.Contains(err.Error(), ".dockerignore") {
		t.Errorf("COPY of an ignored file: %v", err)
	}
	os.WriteFile(filepath.Join(dir, "Dockerfile.dockerignore"), []byte("app\n"), 0o644)
	if _, from, _ := loadDockerignore(dir, filepath.Join(dir, "Dockerfile")); from != filepath.Join(dir, "Dockerfile.dockerignore") {
		t.Errorf("ignore file = %s", from)
	}
}
