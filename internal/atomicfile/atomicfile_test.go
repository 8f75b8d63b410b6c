package atomicfile

import (
	"errors"
	"os"
	"path/filepath"
	"testing"
)

func TestWriteFile(t *testing.T) {
	dir := t.TempDir()
	p := filepath.Join(dir, "f.json")
	for _, content := range []string{"first", "second, longer than the first"} {
		if err := WriteFile(p, []byte(content), 0o600); err != nil {
			t.Fatal(err)
		}
		got, err := os.ReadFile(p)
		if err != nil || string(got) != content {
			t.Fatalf("read back %q, %v; want %q", got, err, content)
		}
	}
	if fi, err := os.Stat(p); err != nil || fi.Mode().Perm() != 0o600 {
		t.Fatalf("mode = %v, %v", fi.Mode(), err)
	}
	if _, err := os.Stat(p + ".tmp"); !os.IsNotExist(err) {
		t.Fatalf("temporary file left behind: %v", err)
	}
}

func TestWriteFileFailureLeavesTargetAlone(t *testing.T) {
	dir := t.TempDir()
	p := filepath.Join(dir, "f")
	if err := WriteFile(p, []byte("kept"), 0o644); err != nil {
		t.Fatal(err)
	}
	// A directory where the temporary file must go makes the write fail.
	if err := os.Mkdir(p+".tmp", 0o755); err != nil {
		t.Fatal(err)
	}
	if err := WriteFile(p, []byte("lost"), 0o644); err == nil {
		t.Fatal("write through a blocked temporary path succeeded")
	}
	if got, _ := os.ReadFile(p); string(got) != "kept" {
		t.Fatalf("target changed to %q", got)
	}
}

func TestFill(t *testing.T) {
	boom := errors.New("boom")
	tests := []struct {
		name    string
		fill    func(f *os.File) error
		wantErr error
		want    string // content at the path afterwards ("" = absent)
	}{
		{"writes", func(f *os.File) error { _, err := f.WriteString("layer bytes"); return err }, nil, "layer bytes"},
		{"fill fails", func(f *os.File) error { f.WriteString("partial"); return boom }, boom, ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			dir := t.TempDir()
			p := filepath.Join(dir, "blob")
			err := Fill(p, ".fetch-", 0o444, tt.fill)
			if !errors.Is(err, tt.wantErr) {
				t.Fatalf("err = %v, want %v", err, tt.wantErr)
			}
			got, rerr := os.ReadFile(p)
			switch {
			case tt.want == "" && !os.IsNotExist(rerr):
				t.Fatalf("path exists after a failed fill: %q, %v", got, rerr)
			case tt.want != "" && string(got) != tt.want:
				t.Fatalf("read back %q, %v; want %q", got, rerr, tt.want)
			}
			if tt.want != "" {
				if fi, _ := os.Stat(p); fi.Mode().Perm() != 0o444 {
					t.Fatalf("mode = %v, want 0444", fi.Mode())
				}
			}
			if left, _ := filepath.Glob(filepath.Join(dir, ".fetch-*")); len(left) != 0 {
				t.Fatalf("temporary files left behind: %v", left)
			}
		})
	}
}
