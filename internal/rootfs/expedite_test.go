package rootfs

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// needRCUSwitch skips unless this test may flip the host's expedited-RCU switch: root,
// a writable switch, and nobody else (an operator) has it on.
func needRCUSwitch(t *testing.T) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root (writes " + rcuExpedited + ")")
	}
	v, err := os.ReadFile(rcuExpedited)
	if err != nil {
		t.Skipf("no %s: %v", rcuExpedited, err)
	}
	if strings.TrimSpace(string(v)) != "0" {
		t.Skipf("%s is %q already (left alone by design)", rcuExpedited, strings.TrimSpace(string(v)))
	}
}

func rcuSwitch(t *testing.T) string {
	t.Helper()
	v, err := os.ReadFile(rcuExpedited)
	if err != nil {
		t.Fatal(err)
	}
	return strings.TrimSpace(string(v))
}

// TestExpediteRCU checks the switch is on only between expediteRCU and its restore,
// with the crash marker present exactly then, and that Sweep switches it off again
// after a crash in between.
func TestExpediteRCU(t *testing.T) {
	needRCUSwitch(t)
	root := t.TempDir()
	dir := filepath.Join(root, "sb1")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	marker := filepath.Join(dir, expeditedMarker)
	restore := expediteRCU(dir)
	if got := rcuSwitch(t); got != "1" {
		restore()
		t.Fatalf("switch %q while expedited", got)
	}
	if _, err := os.Stat(marker); err != nil {
		restore()
		t.Fatalf("marker while expedited: %v", err)
	}
	restore()
	if got := rcuSwitch(t); got != "0" {
		t.Fatalf("switch %q after restore", got)
	}
	if _, err := os.Stat(marker); !os.IsNotExist(err) {
		t.Fatalf("marker after restore: %v", err)
	}

	// A crash between the two: only the marker and the switch are left.
	_ = expediteRCU(dir)
	if err := sweepExpedited(root); err != nil {
		t.Fatal(err)
	}
	if got := rcuSwitch(t); got != "0" {
		t.Fatalf("switch %q after sweep", got)
	}
	if _, err := os.Stat(marker); !os.IsNotExist(err) {
		t.Fatalf("marker after sweep: %v", err)
	}
	// Nothing to do: no error, nothing touched.
	if err := sweepExpedited(root); err != nil {
		t.Fatal(err)
	}
}
