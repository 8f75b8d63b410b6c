package catalog

import (
	"fmt"
	"path/filepath"
	"sync/atomic"
	"testing"
)

// BenchmarkSandboxesPut measures a durable sandbox record write (what each create and
// kill does) alone and from 16 writers at once, as in a burst of creates.
func BenchmarkSandboxesPut(b *testing.B) {
	for _, writers := range []int{1, 16} {
		b.Run(fmt.Sprintf("writers=%d", writers), func(b *testing.B) {
			c, err := Open(filepath.Join(b.TempDir(), "aenv.db"))
			if err != nil {
				b.Fatal(err)
			}
			defer c.Close()
			rec := make([]byte, 600)
			var n atomic.Int64
			b.SetParallelism(writers)
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					if err := c.Sandboxes().Put(fmt.Sprintf("sbx-%d", n.Add(1)), rec); err != nil {
						b.Error(err)
						return
					}
				}
			})
		})
	}
}
