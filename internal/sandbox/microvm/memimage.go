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

	"github.com/aenv-dev/aenv/internal/repository"
	"github.com/aenv-dev/aenv/internal/sandbox"
	"github.com/aenv-dev/aenv/internal/vmm"
)

// Memory snapshots. A capture (Instance.Snapshot, and Instance.Pause, whose state is the
// same thing) is a VM stopped at one instant: its device state, its RAM and its disk's
// upper sealed into a new lower. Forks and snapshot launches restore on a private
// (copy-on-write) mapping of the capture's RAM file, which they share; a resumed pause
// runs shared on a copy of it.
//
// Where memory images live (see docs/operations.md, "microVM memory images"):
//   - a snapshot's or a pause's image is persistent: the RAM file and the device state are
//     written next to the sealed disk layer, on disk (DataDir/captures/<id>/{ram,state}),
//     so they survive a reboot of the machine like the layer;
//   - a fork's capture is transient: it lives on tmpfs (RAMDir/images/<id>) only until the
//     children have mapped it;
//   - both files are named in the capture as blobs ({"path", "digest", "size", "role"}),
//     which the repository publisher finds in the artifact and publishes as the record's
//     "memory" and "vmstate" blobs, with block hash lists, like the disk layers. Another
//     node's catalog entry names them by digest (and a path of its publisher's, if any);
//     a restore there fetches each blob once, verifying every chunk against the published
//     hashes, into DataDir/memory/<digest hex> (content addressed, read-only), and maps
//     that copy (memfetch.go).

// Roles of the memory image's blobs in a repository record.
const (
	roleMemory  = "memory"
	roleVMState = "vmstate"
)

// capture is the backend's Captured and PausedState: everything a restore needs.
type capture struct {
	Backend string `json:"backend"` // "microvm"
	ID      string `json:"id"`
	// Dir holds the capture's sealed disk layer (DataDir/captures/<id>) and, for a
	// persistent capture, its memory image.
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
	// envdToken is the access token the captured envd holds, when this node knows it
	// (never stored: the orchestrator keeps tokens).
	envdToken string
}

// memImage is a VM's memory: a device state stream and, unless the stream holds the RAM
// itself, a RAM file.
type memImage struct {
	// Dir is where this node wrote the image: the capture's Dir (persistent) or a
	// directory under RAMDir/images (transient). Empty on a node that fetches the image.
	Dir string `json:"dir,omitempty"`
	// RAM is the RAM file (read-only: forks map it private). Nil when State holds the RAM
	// (a full stream, taken from a VM whose RAM was itself a private mapping).
	RAM *memBlob `json:"ram,omitempty"`
	// State is QEMU's migration stream.
	State memBlob `json:"state"`
	// IgnoreShared: State was taken with x-ignore-shared and needs RAM (vmm.State).
	IgnoreShared bool `json:"ignoreShared"`
}

// memBlob is one file of a memory image, in the shape the repository publisher finds in
// artifacts (snapshot.ArtifactLayers): the local file, and once published the digest
// that finds its bytes on any node.
type memBlob struct {
	Path   string `json:"path,omitempty"`
	Digest string `json:"digest,omitempty"`
	Size   int64  `json:"size"`
	Role   string `json:"role"`
}

// vmState is the image's state stream as package vmm restores it from path.
func (m *memImage) vmState(path string) vmm.State {
	return vmm.State{Path: path, IgnoreShared: m.IgnoreShared, Size: m.State.Size}
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

// decode parses a stored capture. Paths are this node's only when they lie in this
// backend's directories: a capture made on another node (synced from the repository)
// keeps its layers and memory blobs by digest, and its other paths are dropped, so a
// record can never make the node read or delete files elsewhere.
func (b *Backend) decode(raw []byte) (*capture, error) {
	var c capture
	if err := json.Unmarshal(raw, &c); err != nil {
		return nil, fmt.Errorf("microvm: capture: %w", err)
	}
	if c.Backend != "microvm" || c.ID == "" || len(c.Layers) == 0 {
		return nil, fmt.Errorf("%w: not a microvm capture", ErrUnsupported)
	}
	if !within(c.Dir, b.cfg.capturesDir()) {
		c.Dir = "" // another node's
	}
	if m := c.Memory; m != nil {
		if m.Dir != "" && (m.Dir != c.Dir || c.Dir == "") && !within(m.Dir, b.cfg.imagesDir()) {
			m.Dir = ""
		}
		blobs := []*memBlob{&m.State}
		if m.RAM != nil {
			blobs = append(blobs, m.RAM)
		}
		for _, mb := range blobs {
			if err := b.checkBlob(c.ID, m.Dir, mb); err != nil {
				return nil, err
			}
		}
		if m.RAM != nil && m.RAM.Role != roleMemory || m.State.Role != roleVMState {
			return nil, fmt.Errorf("microvm: capture %s: memory image roles %q, %q", c.ID, m.RAM.roleOrNone(), m.State.Role)
		}
		if m.IgnoreShared != (m.RAM != nil) {
			return nil, fmt.Errorf("microvm: capture %s: a state stream without RAM needs a RAM file, a full one none", c.ID)
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

// checkBlob keeps mb's path only when it is a file of the image's directory dir on this
// node; a blob without one must have a digest to be fetched by.
func (b *Backend) checkBlob(id, dir string, mb *memBlob) error {
	if mb.Path != "" && (dir == "" || !within(mb.Path, dir)) {
		mb.Path = ""
	}
	if mb.Digest != "" {
		if _, err := repository.ParseDigest(mb.Digest); err != nil {
			return fmt.Errorf("microvm: capture %s: memory blob: %w", id, err)
		}
	}
	if mb.Path == "" && mb.Digest == "" {
		return fmt.Errorf("microvm: capture %s: %s blob has neither a file on this node nor a digest", id, mb.Role)
	}
	if mb.Size < 0 {
		return fmt.Errorf("microvm: capture %s: %s blob size %d", id, mb.Role, mb.Size)
	}
	return nil
}

func (mb *memBlob) roleOrNone() string {
	if mb == nil {
		return ""
	}
	return mb.Role
}

// within reports whether p is a clean absolute path strictly inside dir.
func within(p, dir string) bool {
	return filepath.IsAbs(p) && filepath.Clean(p) == p && strings.HasPrefix(p, dir+string(filepath.Separator))
}
