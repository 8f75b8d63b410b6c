package blob

import (
	"bytes"
	"os"
	"testing"
)

// FuzzOpen mutates the shipped vector: whatever the bytes, Open and reads
// return errors, never panic or hang.
func FuzzOpen(f *testing.F) {
	hw, err := os.ReadFile(hwLayer)
	if err != nil {
		f.Fatal(err)
	}
	for _, pos := range []int{150, 520, 1536 + 33, 1536 + 45, 1536 + 600, 1536 + 569127 + 8, 641027 - 512 + 41} {
		m := bytes.Clone(hw)
		m[pos] ^= 0x5a
		f.Add(m)
	}
	f.Add(hw[:100000])
	f.Fuzz(func(t *testing.T, b []byte) {
		l, err := Open(bytes.NewReader(b), int64(len(b)), "fuzz")
		if err != nil {
			return
		}
		defer l.Close()
		p := make([]byte, 1<<20)
		l.ReadAt(p, 0)
		l.ReadAt(p, 68589453312)
	})
}
