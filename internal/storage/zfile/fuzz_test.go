package zfile

import (
	"bytes"
	"testing"
)

func FuzzOpenRead(f *testing.F) {
	for _, o := range []WriterOptions{{Algo: AlgoLZ4}, {Algo: AlgoZstd}, {Algo: AlgoLZ4, NoVerify: true}} {
		z := build(f, sample(20000), o, false)
		f.Add(z)
		for _, pos := range []int{28, 40, 48, 56, 72, 76, HeaderSize + 3, len(z) - HeaderSize - 4, len(z) - 100} {
			m := bytes.Clone(z)
			m[pos] ^= 0x10
			f.Add(m)
		}
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		r, err := Open(bytes.NewReader(b), int64(len(b)), "fuzz")
		if err != nil {
			return
		}
		defer r.Close()
		if r.Size() > 1<<30 {
			return
		}
		p := make([]byte, 10000)
		r.ReadAt(p, 0)
		r.ReadAt(p, r.Size()/2)
	})
}
