package network

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"os/exec"
	"strings"
	"sync"
)

// A restart finds the tables its predecessor installed. When they are exactly the rules
// this start would install, they stay as they are: no `nft -f` (~0.1 s of CPU per run)
// and no moment in which the surviving sandboxes' set elements are being put back. The
// last rule of each table carries a fingerprint of the text that installed it (rules
// and egress-proxy port) as its comment; a start compares it with the text it would
// install, and also counts the installed rules and sets, so a table changed by hand is
// replaced. The egress proxy's port is part of the rules (the redirect), so a start
// listens on the port the fingerprint names when it is free, and on a new one (and
// replaces the tables) when it is not.

// fingerprintPrefix starts the comment that holds a fingerprint.
const fingerprintPrefix = "aenv rules "

// fingerprint is the comment that identifies the tables of text, whose redirect names
// port.
func fingerprint(port int, text string) string {
	sum := sha256.Sum256([]byte(text))
	return fmt.Sprintf("%sport=%d sum=%s", fingerprintPrefix, port, hex.EncodeToString(sum[:12]))
}

// fingerprintPort is the egress-proxy port a fingerprint names (0: none).
func fingerprintPort(comment string) int {
	var port int
	var sum string
	if _, err := fmt.Sscanf(strings.TrimPrefix(comment, fingerprintPrefix), "port=%d sum=%s", &port, &sum); err != nil {
		return 0
	}
	return port
}

// installed is what `nft -j list table` shows of one of the pool's tables.
type installed struct {
	// raw is the listing (nil: no such table), objs its objects.
	raw  []byte
	objs []nftObject
	// comment is the last rule's comment, rules the number of rules, sets the set names.
	comment string
	rules   int
	sets    map[string]bool
}

// listTable lists table family/name; a missing table is not an error (raw stays nil).
func listTable(ctx context.Context, family, name string) (installed, error) {
	out, err := exec.CommandContext(ctx, "nft", "-j", "list", "table", family, name).Output()
	if err != nil {
		var ee *exec.ExitError
		if errors.As(err, &ee) && strings.Contains(string(ee.Stderr), "No such file") {
			return installed{}, nil
		}
		return installed{}, fmt.Errorf("network: list table %s %s: %w", family, name, err)
	}
	return parseInstalled(out)
}

// parseInstalled reads a listing's rules and sets.
func parseInstalled(out []byte) (installed, error) {
	objs, err := decodeListing(out)
	if err != nil {
		return installed{}, err
	}
	t := installed{raw: out, objs: objs, sets: map[string]bool{}}
	for _, o := range objs {
		switch {
		case o.Set != nil:
			t.sets[o.Set.Name] = true
		case o.Rule != nil:
			t.rules++
			t.comment = o.Rule.Comment
		}
	}
	return t, nil
}

// listTables lists the pool's two tables at once.
func (p *Pool) listTables(ctx context.Context) (inet, bridge installed, err error) {
	var wg sync.WaitGroup
	var berr error
	wg.Add(1)
	go func() {
		defer wg.Done()
		bridge, berr = listTable(ctx, "bridge", p.cfg.Bridge)
	}()
	inet, err = listTable(ctx, "inet", p.cfg.Bridge)
	wg.Wait()
	return inet, bridge, errors.Join(err, berr)
}

// tablesMatch reports whether the installed tables are the ones text (from p.tables)
// defines: the same fingerprint, as many rules and the same sets.
func tablesMatch(inet, bridge installed, inetText, bridgeText string) bool {
	want := lastComment(inetText)
	if inet.raw == nil || bridge.raw == nil || want == "" || inet.comment != want || bridge.comment != want {
		return false
	}
	if inet.rules != countRules(inetText) || bridge.rules != countRules(bridgeText) {
		return false
	}
	sets := setNames(inetText)
	if len(sets) != len(inet.sets) {
		return false
	}
	for _, s := range sets {
		if !inet.sets[s] {
			return false
		}
	}
	return true
}

// countRules counts the rules of a table's text: the lines of its chains other than
// their type line.
func countRules(text string) int {
	n, in := 0, false
	for _, l := range strings.Split(text, "\n") {
		t := strings.TrimSpace(l)
		switch {
		case strings.HasPrefix(t, "chain "):
			in = true
		case t == "}":
			in = false
		case in && t != "" && !strings.HasPrefix(t, "type "):
			n++
		}
	}
	return n
}

// setNames lists the sets a table's text declares.
func setNames(text string) []string {
	var out []string
	for _, l := range strings.Split(text, "\n") {
		if f := strings.Fields(l); len(f) > 1 && f[0] == "set" {
			out = append(out, f[1])
		}
	}
	return out
}

// lastComment is the comment of the last rule of a table's text ("" if none).
func lastComment(text string) string {
	i := strings.LastIndex(text, ` comment "`)
	if i < 0 {
		return ""
	}
	rest := text[i+len(` comment "`):]
	if j := strings.IndexByte(rest, '"'); j >= 0 {
		return rest[:j]
	}
	return ""
}
