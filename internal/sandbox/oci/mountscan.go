package oci

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
)

// mountsUnder lists mountpoints at or below dir from /proc/self/mountinfo, in mount order.
//
// Every sandbox's teardown asks this of its own directory, and the host's table holds
// about three mounts per sandbox (its ext4 root, its FUSE disk, its netns), so the scan is
// O(n) in the sandboxes held. moby/sys/mountinfo parsed every line into a struct before
// its prefix filter looked at it; this looks at a line's mountpoint only when the line
// holds dir's escaped bytes at all. At 931 lines (300 held) a scan cost 4.6 ms of CPU
// against moby's 5.2 (BenchmarkMountsUnder*, user 0.7 against 1.1 ms): the rest is the
// kernel formatting the table (show_mountinfo, ~4 us a line on this host), which only
// fewer mounts in the namespace would cut.
func mountsUnder(dir string) ([]string, error) {
	raw, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return nil, fmt.Errorf("oci: mountinfo: %w", err)
	}
	return parseMountsUnder(raw, dir), nil
}

// parseMountsUnder returns the mountpoints of a mountinfo table at or below dir, in the
// table's order (mount order). Lines it cannot read are skipped, as moby's parser would
// have failed on them instead; the kernel writes none.
func parseMountsUnder(table []byte, dir string) []string {
	dir = filepath.Clean(dir)
	needle := []byte(escapeMountinfo(dir))
	var out []string
	for len(table) > 0 {
		line := table
		if i := bytes.IndexByte(table, '\n'); i >= 0 {
			line, table = table[:i], table[i+1:]
		} else {
			table = nil
		}
		if !bytes.Contains(line, needle) {
			continue
		}
		// Fields: id parent major:minor root mountpoint ...; the fifth is the mountpoint.
		f := bytes.SplitN(line, []byte{' '}, 6)
		if len(f) < 6 {
			continue
		}
		mp, ok := unescapeMountinfo(string(f[4]))
		if !ok {
			continue
		}
		if mp == dir || strings.HasPrefix(mp, dir+"/") {
			out = append(out, mp)
		}
	}
	return out
}

// escapeMountinfo escapes p as the kernel writes paths in mountinfo (show_path's
// mangle: space, tab, newline and backslash as \ooo octal).
func escapeMountinfo(p string) string {
	return strings.NewReplacer(" ", `\040`, "\t", `\011`, "\n", `\012`, `\`, `\134`).Replace(p)
}

// unescapeMountinfo undoes escapeMountinfo (any \ooo octal escape).
func unescapeMountinfo(s string) (string, bool) {
	if !strings.Contains(s, `\`) {
		return s, true
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] != '\\' {
			b.WriteByte(s[i])
			continue
		}
		if i+4 > len(s) {
			return "", false
		}
		v, err := strconv.ParseUint(s[i+1:i+4], 8, 8)
		if err != nil {
			return "", false
		}
		b.WriteByte(byte(v))
		i += 3
	}
	return b.String(), true
}
