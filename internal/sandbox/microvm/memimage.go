package microvm

import (
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"net"
	"net/netip"
	"path/filepath"
	"strings"

	"github.com/aenv-dev/aenv/internal/sandbox"
	"github.com/aenv-dev/aenv/internal/vmm"
)

// Memory snapshots. A capture (Instance.Snapshot, and Instance.Pause, whose state is the
// same thing) is a VM stopped at one instant: its device state, its RAM and its disk's
// upper sealed into a new lower. Forks and snapshot launches restore on a private
// (copy-on-write) mapping of the capture's RAM file, which they share; a resumed pause
// takes its RAM file over and runs shared on it.
//
// Memory images are node-local: the RAM file and device state live under
// RAMDir/images/<capture id> (tmpfs), the sealed disk layer under DataDir/captures/<id>.
// A capture cannot yet run on another node (the layers are publishable, the memory image
// is not).

// capture is the backend's Captured and PausedState: everything a restore needs.
type capture struct {
	Backend string `json:"backend"` // "microvm"
	ID      string `json:"id"`
	// Dir holds the capture's sealed disk layer (DataDir/captures/<id>).
	Dir string `json:"dir"`
	// Layers are the disk's lowers at the capture, bottom first; the sealed upper last.
	Layers      []sandbox.LayerRef `json:"layers"`
	VirtualSize uint64             `json:"virtualSize"`
	// Resources is the VM shape the memory image needs (vCPUs, RAM); a restore uses it
	// whatever its plan asks.
	Resources sandbox.Resources `json:"resources"`
	Memory    *memImage         `json:"memory,omitempty"`
	// Guest is the network identity in the guest's memory, which a restore on another
	// network slot keeps (restorenet.go).
	Guest guestIdentity `json:"guest"`
}

// memImage is a VM's memory on this node.
type memImage struct {
	Dir string `json:"dir"`
	// RAM is the RAM file (read-only: forks map it private). Empty when State holds the
	// RAM (a full stream, taken from a VM whose RAM was itself a private mapping).
	RAM   string    `json:"ram,omitempty"`
	State vmm.State `json:"state"`
}

// guestIdentity is the guest's address configuration, set at its first boot.
type guestIdentity struct {
	Addr    netip.Prefix `json:"addr"`
	Gateway netip.Addr   `json:"gateway"`
	MAC     string       `json:"mac"`
	// GatewayMAC is the bridge's MAC, which the guest has cached for its gateway.
	GatewayMAC string `json:"gatewayMac,omitempty"`
}

// Encode implements sandbox.Captured and sandbox.PausedState.
func (c *capture) Encode() ([]byte, error) { return json.Marshal(c) }

var (
	_ sandbox.Captured          = (*capture)(nil)
	_ sandbox.PausedState       = (*capture)(nil)
	_ sandbox.SnapshotDiscarder = (*Backend)(nil)
	_ sandbox.PausedDiscarder   = (*Backend)(nil)
)

func (c *Config) capturesDir() string { return filepath.Join(c.DataDir, "captures") }
func (c *Config) imagesDir() string   { return filepath.Join(c.RAMDir, "images") }

func newCaptureID() (string, error) {
	var b [8]byte
	if _, err := rand.Read(b[:]); err != nil {
		return "", fmt.Errorf("microvm: capture id: %w", err)
	}
	return hex.EncodeToString(b[:]), nil
}

// Capabilities implements sandbox.Backend: memory snapshots, so processes survive pause,
// snapshot launches and forks; a pause ends the VM (its state is files).
func (b *Backend) Capabilities() sandbox.Capabilities {
	return sandbox.Capabilities{MemorySnapshots: true, PauseKeepsProcesses: true,
		PauseReleasesMemory: true, LiveFork: true, Snapshots: true}
}

// DecodePaused implements sandbox.Backend.
func (b *Backend) DecodePaused(raw []byte) (sandbox.PausedState, error) { return b.decode(raw) }

// DecodeCaptured implements sandbox.Backend.
func (b *Backend) DecodeCaptured(raw []byte) (sandbox.Captured, error) { return b.decode(raw) }

// decode parses a stored capture and checks that every path it names is one of this
// backend's, so a record cannot make the node read or delete files elsewhere.
func (b *Backend) decode(raw []byte) (*capture, error) {
	var c capture
	if err := json.Unmarshal(raw, &c); err != nil {
		return nil, fmt.Errorf("microvm: capture: %w", err)
	}
	if c.Backend != "microvm" || c.ID == "" || len(c.Layers) == 0 {
		return nil, fmt.Errorf("%w: not a microvm capture", ErrUnsupported)
	}
	if !within(c.Dir, b.cfg.capturesDir()) {
		return nil, fmt.Errorf("microvm: capture dir %q outside %s", c.Dir, b.cfg.capturesDir())
	}
	if m := c.Memory; m != nil {
		if !within(m.Dir, b.cfg.imagesDir()) || !within(m.State.Path, m.Dir) || (m.RAM != "" && !within(m.RAM, m.Dir)) {
			return nil, fmt.Errorf("microvm: memory image paths outside %s", b.cfg.imagesDir())
		}
		if _, err := net.ParseMAC(c.Guest.MAC); err != nil || !c.Guest.Addr.IsValid() || !c.Guest.Gateway.IsValid() {
			return nil, fmt.Errorf("microvm: capture %s: guest identity %+v invalid", c.ID, c.Guest)
		}
	}
	if c.Resources.CPUCount < 1 || c.Resources.MemoryMB < 16 {
		return nil, fmt.Errorf("microvm: capture %s: resources %+v invalid", c.ID, c.Resources)
	}
	return &c, nil
}

// within reports whether p is a clean absolute path strictly inside dir.
func within(p, dir string) bool {
	return filepath.IsAbs(p) && filepath.Clean(p) == p && strings.HasPrefix(p, dir+string(filepath.Separator))
}
