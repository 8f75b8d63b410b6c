// Package orchestrator owns the lifecycle of sandboxes on one node: the state machine,
// launch plans, TTLs, persistence of records and reconciliation after a restart.
//
// The HTTP layer consumes *Orchestrator through a small interface of its own; the
// methods it relies on (implemented in orchestrator.go) are:
//
//	Create(ctx, CreateRequest) (*Sandbox, error)
//	Connect(ctx, id string, o ConnectOptions) (sb *Sandbox, resumed bool, err error)
//	Get(ctx, id string) (*Sandbox, error)
//	List(ctx, ListFilter) (items []*Sandbox, nextToken string, err error)
//	Kill(ctx, id string) error
//	SetTimeout(ctx, id string, d time.Duration) error      // may shorten; d<=0 expires now
//	Refresh(ctx, id string, d time.Duration) error         // extends only
//	Pause(ctx, id string, o sandbox.PauseOptions) error    // ErrConflict when already paused
//	Metrics(ctx, id string) ([]sandbox.Stats, error)
//	Endpoint(ctx, id string, autoResume bool) (sandbox.Endpoint, *Sandbox, error)
//	Capabilities() sandbox.Capabilities
//	Snapshot(ctx, id, name string) (SnapshotInfo, error)           // snapshot.go
//	ListSnapshots(ctx, SnapshotFilter) ([]SnapshotInfo, string, error)
//	DeleteTemplate(ctx, idOrName string) error                      // snapshots and templates
//	Fork(ctx, id string, count int, timeout time.Duration) ([]ForkResult, error) // fork.go
package orchestrator

import (
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/aenv-dev/aenv/internal/catalog"
	"github.com/aenv-dev/aenv/internal/sandbox"
)

// Sentinel errors the API layer maps to HTTP statuses.
var (
	ErrNotFound = errors.New("sandbox not found")      // 404
	ErrConflict = errors.New("sandbox state conflict") // 409 (already paused, being killed)
	// ErrMoved: a paused sandbox of this node was resumed by another node of the cluster.
	ErrMoved            = fmt.Errorf("%w here: it was resumed on another node", ErrNotFound)
	ErrInvalid          = errors.New("invalid request")                 // 400
	ErrTemplateNotFound = errors.New("template not found")              // 404 on create
	ErrNotRunning       = errors.New("sandbox is not running")          // 502 on the proxy path
	ErrCapacity         = errors.New("node is out of sandbox capacity") // 503
	// ErrTemplateNotReady: a template the node installs itself (base) is still being built,
	// or its build failed; 503 on create.
	ErrTemplateNotReady = errors.New("template is not ready on this node")
	// ErrPaused: the sandbox is paused and this request may not resume it (409 on the proxy
	// path, as E2B answers). It is also an ErrNotRunning.
	ErrPaused = fmt.Errorf("%w: the sandbox is paused", ErrNotRunning)
	// ErrUnsupported: the backend cannot do this (Capabilities say so); 501.
	ErrUnsupported = errors.New("not supported by this node's sandbox backend")
)

// State of a sandbox. Transitional states are held while an operation runs; concurrent
// operations on the same sandbox wait for it to leave them.
type State string

const (
	StateCreating     State = "creating"
	StateRunning      State = "running"
	StatePausing      State = "pausing"
	StatePaused       State = "paused"
	StateResuming     State = "resuming"
	StateSnapshotting State = "snapshotting"
	StateForking      State = "forking"
	StateKilling      State = "killing"
)

// Public maps internal states onto the two E2B states ("running" | "paused").
func (s State) Public() string {
	if s == StatePaused || s == StatePausing {
		return "paused"
	}
	return "running"
}

// CreateRequest is a validated create (v1 or v2).
type CreateRequest struct {
	TemplateID    string
	Timeout       time.Duration
	Metadata      map[string]string
	EnvVars       map[string]string
	AutoPause     bool
	AutoResume    bool
	AllowInternet bool
	// Secure issues an envd access token (always true for v2).
	Secure bool
	// Private requires the traffic access token on user-port traffic
	// (E2B's network.allowPublicTraffic=false).
	Private   bool
	Resources sandbox.Resources // zero fields take the template's values
	// AutoPauseDisk makes the timeout pause a pause to disk (E2B's autoPauseMemory:false).
	AutoPauseDisk bool
	// Egress is network.allowOut/denyOut/rules/egressProxy, validated by ParseEgress.
	Egress Egress
	// MaskRequestHost is network.maskRequestHost: the Host user-port requests carry into
	// the sandbox ("${PORT}" is replaced by the port).
	MaskRequestHost string
	// Owner is who asked (the API key's owner): secrets in EnvVars and volumes resolve
	// in its scope.
	Owner string
	// VolumeMounts are the volumes to mount, their ids resolved in Owner's scope.
	VolumeMounts []VolumeMount
	// FlatRoot is sandbox.LaunchPlan.FlatRoot: a template build's sandbox, whose capture
	// becomes a template.
	FlatRoot bool
}

// VolumeMount is one volume a sandbox mounts.
type VolumeMount = catalog.VolumeMount

// ConnectOptions is a v1/v2 connect or resume.
type ConnectOptions struct {
	Timeout time.Duration
	// ColdBoot is E2B's memory:false: a paused sandbox restarts its processes on its
	// filesystem as it was, instead of having its memory restored. It has no effect on a
	// running sandbox.
	ColdBoot bool
	// Adopt lets a sandbox unknown here be resumed from its publication by the node of
	// the cluster that paused it to disk (the gateway sets it when that node is gone,
	// full or draining).
	Adopt bool
}

// ListFilter selects sandboxes for GET /sandboxes and /v2/sandboxes.
type ListFilter struct {
	States       []string // "running", "paused"; empty = both
	Metadata     map[string]string
	TemplateID   string
	StartedAfter time.Time
	Ascending    bool
	Limit        int
	NextToken    string
}

// Sandbox is the record the node keeps for each sandbox (persisted).
type Sandbox struct {
	ID                 string            `json:"id"`
	TemplateID         string            `json:"templateID"`
	Alias              string            `json:"alias,omitempty"`
	State              State             `json:"state"`
	StartedAt          time.Time         `json:"startedAt"`
	EndAt              time.Time         `json:"endAt"`
	Resources          sandbox.Resources `json:"resources"`
	Metadata           map[string]string `json:"metadata,omitempty"`
	EnvVars            map[string]string `json:"envVars,omitempty"`
	EnvdVersion        string            `json:"envdVersion"`
	EnvdAccessToken    string            `json:"envdAccessToken,omitempty"`
	TrafficAccessToken string            `json:"trafficAccessToken,omitempty"`
	AutoPause          bool              `json:"autoPause"`
	AutoResume         bool              `json:"autoResume"`
	AllowInternet      bool              `json:"allowInternet"`
	// Private sandboxes require TrafficAccessToken on user ports.
	Private bool `json:"private,omitempty"`
	// Egress is the destination part of the outbound policy (network.go).
	Egress Egress `json:"egress,omitzero"`
	// MaskRequestHost replaces the Host of requests proxied into user ports.
	MaskRequestHost string `json:"maskRequestHost,omitempty"`
	Backend         string `json:"backend"`
	// AutoPauseDisk makes the timeout pause to disk instead of keeping memory.
	AutoPauseDisk bool `json:"autoPauseDisk,omitempty"`
	// Paused is the backend's encoded PausedState while State is paused in memory.
	Paused []byte `json:"paused,omitempty"`
	// DiskSnapshot is the backend's encoded Captured while the sandbox is paused to
	// disk (no instance; resumed by launching from it under the same id).
	DiskSnapshot json.RawMessage `json:"diskSnapshot,omitempty"`
	// Handoff is the repository record that publishes this pause (to disk, or a memory
	// image another node can restore) for the other nodes of the cluster
	// (orchestrator/handoff.go); "" when not published.
	Handoff string `json:"handoff,omitempty"`
	// Launch is what a resume needs to relaunch and re-initialise the sandbox even if
	// its template was deleted meanwhile. Internal: not part of any API response.
	Launch LaunchInfo `json:"launch"`
	// Owner is the API key's owner that created the sandbox (secrets resolve in its scope).
	Owner string `json:"owner,omitempty"`
	// VolumeMounts are the volumes the sandbox mounts (reported by the API).
	VolumeMounts []VolumeMount `json:"volumeMounts,omitempty"`
}

// LaunchInfo is the part of a sandbox's template it keeps for its whole life.
type LaunchInfo struct {
	RootFS          sandbox.RootFS    `json:"rootfs"`
	TemplateEnvVars map[string]string `json:"templateEnvVars,omitempty"`
	DefaultUser     string            `json:"defaultUser,omitempty"`
	DefaultWorkdir  string            `json:"defaultWorkdir,omitempty"`
	// StartCmd is the template's start command, run again whenever the sandbox's
	// processes boot fresh (create, fork, resume from disk).
	StartCmd string `json:"startCmd,omitempty"`
	// ParentSnapshot is the snapshot the sandbox was created from, if any (lineage of
	// snapshots taken from it).
	ParentSnapshot string `json:"parentSnapshot,omitempty"`
	// Mounts are the host directories of VolumeMounts, mounted on every launch.
	Mounts []sandbox.Mount `json:"mounts,omitempty"`
	// Adopted is the handoff this node resumed the sandbox from (paused on another
	// node); its layers are read from the repository, so it is deleted only with the
	// sandbox.
	Adopted string `json:"adopted,omitempty"`
}

// SnapshotInfo is E2B's SnapshotInfo plus what aenv knows about the snapshot.
type SnapshotInfo struct {
	SnapshotID      string
	Names           []string
	SourceSandboxID string
	ParentID        string
	CreatedAt       time.Time
	// Publication is the repository publication's state when the snapshot was taken:
	// PublicationNone, PublicationPending or PublicationFailed.
	Publication string
}

// SnapshotFilter selects snapshots for GET /snapshots.
type SnapshotFilter struct {
	SandboxID string // only snapshots taken from this sandbox
	Name      string // only the snapshot with this name (alias) or id
	Limit     int    // 0 = DefaultListLimit; 1..MaxListLimit
	NextToken string
}

// ForkResult is one fork child's outcome: exactly one of Sandbox and Err is set.
type ForkResult struct {
	Sandbox *Sandbox
	Err     error
}
