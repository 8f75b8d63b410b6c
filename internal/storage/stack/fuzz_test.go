package stack

import (
	"os"
	"path/filepath"
	"testing"
)

func FuzzLoadManifest(f *testing.F) {
	f.Add([]byte(`{"virtual_size":1048576,"lowers":[{"path":"a.commit"},{"digest":"sha256:00","size":5}],"upper":{"data":"u.data","index":"u.index"},"max_depth":4}`))
	f.Add([]byte(`{"lowers":[{}]}`))
	f.Add([]byte(`{"virtual_size":1000}`))
	f.Fuzz(func(t *testing.T, b []byte) {
		p := filepath.Join(t.TempDir(), "m.json")
		os.WriteFile(p, b, 0o644)
		m, err := LoadManifest(p)
		if err != nil {
			return
		}
		if m.VirtualSize%512 != 0 || len(m.Lowers) > maxLowers {
			t.Fatalf("invalid manifest accepted: %+v", m)
		}
	})
}
