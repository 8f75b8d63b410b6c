package envd

import (
	"fmt"
	"os"
	"slices"
	"strings"
)

// hostsMark ends the /etc/hosts line envd keeps for the sandbox's host name.
const hostsMark = "# aenv: this sandbox's host name"

// ensureHostsEntry makes the host name resolve through the hosts file at path, as Debian's
// installer does with a 127.0.1.1 line: a sandbox's host name is its id, which no DNS
// server knows, and tools that resolve it (sudo, for one) otherwise print "unable to
// resolve host" and wait for DNS to time out. A line envd wrote for an earlier name (a
// snapshot's source) is replaced; a file that already names the host is left alone. The
// file is rewritten in place: it may be a bind mount, which a rename cannot replace.
func ensureHostsEntry(path, name string) error {
	if name == "" || name == "(none)" { // "(none)": a kernel nobody gave a name
		return nil
	}
	b, err := os.ReadFile(path)
	if err != nil && !os.IsNotExist(err) {
		return err
	}
	var lines []string
	for _, l := range strings.Split(strings.TrimRight(string(b), "\n"), "\n") {
		if strings.HasSuffix(l, hostsMark) {
			continue
		}
		if f := strings.Fields(strings.SplitN(l, "#", 2)[0]); len(f) > 1 && slices.Contains(f[1:], name) {
			return nil
		}
		if l != "" || len(lines) > 0 {
			lines = append(lines, l)
		}
	}
	lines = append(lines, fmt.Sprintf("127.0.1.1\t%s\t%s", name, hostsMark))
	return os.WriteFile(path, []byte(strings.Join(lines, "\n")+"\n"), 0o644)
}
