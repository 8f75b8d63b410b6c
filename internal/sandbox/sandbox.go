// Package sandbox defines what the orchestrator needs from an isolation technology
// (OCI containers, microVMs, or a mock in unit tests). Backends live in subpackages.
//
// The orchestrator never looks inside a PausedState: it stores Encode() and hands the
// bytes back through Backend.DecodePaused when it resumes.
package sandbox

import (
	"context"
	"errors"
	"time"
)

// ErrGone means the instance no longer exists (it died or was stopped); callers treat the
// sandbox as terminal. Other capture errors leave the sandbox running and are recoverable.
var ErrGone = errors.New("sandbox instance is gone")

// ErrUnsupported means the backend cannot do this for this sandbox (for example a
// snapshot of a sandbox whose root filesystem cannot be captured). Backends wrap it so
// the API answers 501 instead of reporting a server failure.
var ErrUnsupported = errors.New("not supported by this sandbox backend")

// Capabilities tells the API and the orchestrator what a backend can do, so they report
// behaviour honestly instead of pretending every backend is a VM.
type Capabilities struct {
	// MemorySnapshots: a snapshot/pause captures RAM and processes (VMs), not only the filesystem.
	MemorySnapshots bool `json:"memorySnapshots"`
	// PauseKeepsProcesses: processes survive pause/resume (freezer or memory snapshot).
	PauseKeepsProcesses bool `json:"pauseKeepsProcesses"`
	// PauseReleasesMemory: a paused sandbox gives its RAM back to the host.
	PauseReleasesMemory bool `json:"pauseReleasesMemory"`
	// LiveFork: fork children continue the parent's processes.
	LiveFork bool `json:"liveFork"`
	// Snapshots: Instance.Snapshot captures a running sandbox and Launch accepts
	// LaunchFromSnapshot. Without it the orchestrator refuses snapshot and fork and
	// pauses in place even when asked to release memory.
	Snapshots bool `json:"snapshots"`
}

// Resources are the limits a sandbox runs under.
type Resources struct {
	CPUCount   int `json:"cpuCount"`
	MemoryMB   int `json:"memoryMB"`
	DiskSizeMB int `json:"diskSizeMB"`
}

// RootFS says where a sandbox's root filesystem comes from: an unpacked directory used as
// the read-only lower of a per-sandbox overlay, or a stack of sealed overlaybd layers
// holding an ext4 filesystem, under a per-sandbox writable upper (a layered block root).
// A backend that supports block roots uses Layers when set, LowerDir otherwise.
type RootFS struct {
	// LowerDir is a read-only directory tree (a template's rootfs).
	LowerDir string `json:"lowerDir,omitempty"`
	// Layers are sealed overlaybd layers, bottom first (a converted template's stack).
	Layers []LayerRef `json:"layers,omitempty"`
	// VirtualSize is the layered device's size in bytes; 0 means the top layer's. A
	// sandbox whose Resources.DiskSizeMB is larger gets its filesystem grown.
	VirtualSize uint64 `json:"virtualSize,omitempty"`
}

// LayerRef names one sealed layer of a layered root: a local file (Path, absolute) or a
// blob by digest that the storage engine resolves. Its JSON matches the storage engine's
// stack manifests.
type LayerRef struct {
	Path   string `json:"path,omitempty"`
	Digest string `json:"digest,omitempty"`
	Size   int64  `json:"size,omitempty"`
	UUID   string `json:"uuid,omitempty"`
}

// LaunchKind selects what a LaunchPlan does.
type LaunchKind int

const (
	LaunchFresh        LaunchKind = iota // create from a template
	LaunchFromSnapshot                   // create from a runnable snapshot
	LaunchResume                         // resume a paused sandbox (same id)
)

// Hostname is the host name a sandbox runs under: its id, cut to the 63 bytes the kernel
// keeps (HOST_NAME_MAX 64, less the NUL). Backends set it at launch; envd sets it again
// after a memory restore, and both must agree.
func Hostname(id string) string {
	return id[:min(len(id), 63)]
}

// LaunchPlan is everything a backend needs to start one sandbox.
type LaunchPlan struct {
	Kind      LaunchKind
	SandboxID string
	RootFS    RootFS
	Resources Resources
	// AllowInternet enables outbound NAT from the sandbox's network namespace.
	AllowInternet bool
	// Paused is set for LaunchResume: the state returned by Instance.Pause.
	Paused PausedState
	// Snapshot is set for LaunchFromSnapshot: what Instance.Snapshot captured (possibly
	// from another sandbox, possibly decoded by Backend.DecodeCaptured after a restart).
	// A sandbox paused to disk is resumed this way under its own SandboxID.
	Snapshot Captured
	// ColdBoot asks LaunchFromSnapshot for fresh processes on the captured filesystem
	// even when the capture holds memory (a pause to disk, E2B's memory:false).
	ColdBoot bool
	// SnapshotTemplate is set for LaunchFromSnapshot when Snapshot is a snapshot template,
	// created from again and again (E2B's snapshots), rather than a fork's or a pause's
	// capture, launched once per child or resume: a backend may keep instances of it
	// ready ahead of demand, as it does for templates.
	SnapshotTemplate bool
	// FlatRoot asks LaunchFresh for a root whose capture is one stack of layers, the
	// template's and the sandbox's own on them: a template build's sandbox, whose capture
	// becomes a template. A backend whose roots may be overlays over layers shared with
	// other sandboxes (the OCI backend's overlay roots, captured as two stacks) gives such
	// a sandbox a root of its own; others ignore it.
	FlatRoot bool
	// Mounts are host directories (volumes) bind-mounted read-write into the sandbox, on
	// every launch kind; only backends that are a VolumeMounter get any.
	Mounts []Mount
	// EnvdAccessToken is the access token the orchestrator gives the sandbox's envd ("":
	// none), and HeldEnvdToken the one the launched memory's envd already holds (a launch
	// from a capture with memory: the captured sandbox's). A backend that warms VMs
	// restored from captures ahead of a request needs them to pass envd's token check;
	// nothing else may depend on them.
	EnvdAccessToken string
	HeldEnvdToken   string
}

// Mount is a host directory shared into a sandbox at Destination. Writes go straight to
// Source, so every sandbox mounting it sees them at once (a shared filesystem), and a
// snapshot of the sandbox does not capture it.
type Mount struct {
	Source      string `json:"source"`
	Destination string `json:"destination"`
}

// Endpoint is how the host reaches a running sandbox.
type Endpoint struct {
	// Host is the sandbox's address as seen from the host (an IP), for user ports.
	Host string `json:"host"`
	// EnvdPort is envd's port on Host (49983 unless the backend maps it).
	EnvdPort int `json:"envdPort"`
}

// PauseOptions asks for a pause.
type PauseOptions struct {
	// KeepMemory asks to keep RAM and processes (E2B's memory:true). A backend that cannot
	// honour it pauses as well as it can and says so in its Capabilities.
	KeepMemory bool
}

// PausedState is a backend's opaque description of a paused sandbox.
type PausedState interface {
	Encode() ([]byte, error)
}

// Captured is the result of a snapshot of a running sandbox. Encode must return a JSON
// value: the orchestrator stores it verbatim as a catalog record's artifact, so records
// stay inspectable, and hands it back through Backend.DecodeCaptured.
type Captured interface {
	Encode() ([]byte, error)
}

// ForkSpec describes one fork child.
type ForkSpec struct {
	SandboxID string
	Resources Resources
}

// ForkResult is one child's outcome, in the order of the specs.
type ForkResult struct {
	Instance Instance
	Err      error
}

// Stats are point-in-time resource counters of one sandbox.
type Stats struct {
	Timestamp  time.Time
	CPUCount   int
	CPUUsedPct float64
	MemUsed    int64
	MemTotal   int64
	MemCache   int64
	DiskUsed   int64
	DiskTotal  int64
}

// Backend is one isolation technology.
type Backend interface {
	Name() string
	Capabilities() Capabilities
	// Launch creates (fresh or from snapshot) or resumes a sandbox and returns once its
	// init (envd) has been started; the orchestrator waits for envd health itself.
	Launch(ctx context.Context, plan LaunchPlan) (Instance, error)
	DecodePaused(raw []byte) (PausedState, error)
	// DecodeCaptured turns a stored Captured.Encode() back into a Captured.
	DecodeCaptured(raw []byte) (Captured, error)
	// Reconcile is called once at startup with the ids the node believes exist; the
	// backend removes everything else it finds (containers, mounts, netns) and reports
	// which of the known ids are still alive.
	Reconcile(ctx context.Context, known []string) (alive map[string]Instance, err error)
}

// Instance is one running (or paused) sandbox.
type Instance interface {
	ID() string
	Endpoint() Endpoint
	Pause(ctx context.Context, o PauseOptions) (PausedState, error)
	// Resume undoes an in-place Pause (freezer thaw). Backends whose pause stops the
	// instance return an error wrapping ErrGone and are resumed through Launch.
	Resume(ctx context.Context) error
	Snapshot(ctx context.Context) (Captured, error)
	Fork(ctx context.Context, specs []ForkSpec) ([]ForkResult, error)
	Stop(ctx context.Context) error // idempotent
	Stats(ctx context.Context) (Stats, error)
}
