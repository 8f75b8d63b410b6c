package envd

import (
	"os"
	"path/filepath"
	"testing"
)

func TestEnsureHostsEntry(t *testing.T) {
	const base = "127.0.0.1\tlocalhost sandbox\n::1\tlocalhost ip6-localhost ip6-loopback\n"
	tests := []struct {
		name, before, host, want string
	}{
		{"adds the name", base, "i3x9k2", base + "127.0.1.1\ti3x9k2\t" + hostsMark + "\n"},
		{"replaces an earlier sandbox's line", base + "127.0.1.1\told\t" + hostsMark + "\n", "new", base + "127.0.1.1\tnew\t" + hostsMark + "\n"},
		{"keeps a file that names the host", base, "sandbox", base},
		{"a name in a comment does not count", "127.0.0.1 localhost # i3x9k2\n", "i3x9k2", "127.0.0.1 localhost # i3x9k2\n127.0.1.1\ti3x9k2\t" + hostsMark + "\n"},
		{"no file yet", "", "h", "127.0.1.1\th\t" + hostsMark + "\n"},
		{"no name", base, "", base},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p := filepath.Join(t.TempDir(), "hosts")
			if tt.before != "" {
				if err := os.WriteFile(p, []byte(tt.before), 0o644); err != nil {
					t.Fatal(err)
				}
			}
			if err := ensureHostsEntry(p, tt.host); err != nil {
				t.Fatal(err)
			}
			got, _ := os.ReadFile(p)
			if string(got) != tt.want {
				t.Fatalf("hosts =\n%q\nwant\n%q", got, tt.want)
			}
		})
	}
}
