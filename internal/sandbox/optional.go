package sandbox

import (
	"context"
	"encoding/json"
)

// The interfaces below are the optional part of the contract: behaviours the
// orchestrator discovers on a Backend or an Instance by type assertion, because only
// some technologies have them. They live here, not in the orchestrator, so that every
// backend can assert the ones it implements at compile time
//
//	var _ sandbox.SnapshotDiscarder = (*Backend)(nil)
//
// and a renamed or re-typed method breaks the build instead of silently turning the
// behaviour off (a backend that stops matching SnapshotDiscarder would keep every
// capture forever). A backend that lacks one gets the documented fallback.

// PausedDiscarder is implemented by backends whose paused state lives outside the
// instance (a VM's memory and device files, a capture of a pause to disk).
//
// The orchestrator calls DiscardPaused when it drops a PausedState it will never
// resume: a kill of a paused sandbox that has no live instance, and the paused state a
// cold-boot conversion replaced. sandboxID is the sandbox the state belongs to; ps may
// have been decoded by DecodePaused after a restart. The backend frees what ps holds;
// errors are logged, never retried (Reconcile removes what is left at the next start).
//
// Without it the orchestrator assumes a paused sandbox holds nothing beyond its instance
// (pause in place), and Instance.Stop releases everything.
type PausedDiscarder interface {
	DiscardPaused(ctx context.Context, sandboxID string, ps PausedState) error
}

// PausedCapturer is implemented by backends whose paused state is a capture of the
// sandbox with its memory (the microvm backend: a pause writes RAM, device state and the
// sealed disk, then the VM ends).
//
// In a cluster the orchestrator publishes such a pause like a pause to disk, with the
// capture PausedCapture returns as its artifact, so another node can resume the sandbox
// with LaunchFromSnapshot (ColdBoot false: processes and memory kept) when its node is
// gone. ok is false when ps cannot be resumed elsewhere.
//
// Without it a pause that keeps memory resumes on its own node only.
type PausedCapturer interface {
	PausedCapture(ps PausedState) (c Captured, ok bool)
}

// SnapshotDiscarder is implemented by backends whose captures hold resources (sealed
// layers, memory images).
//
// The orchestrator calls DiscardSnapshot once it no longer references c: a snapshot
// deleted (locally or by another node's sync), a fork's fan-out done, a sandbox resumed
// from, or killed while, paused to disk. The backend frees only what no live instance
// and no other capture still uses, so a call for a capture that is shared, or already
// discarded, is harmless. Errors are logged; CaptureReconciler collects what is left.
//
// Without it the orchestrator never decodes a capture just to drop it, and captures are
// expected to hold nothing that outlives their record.
type SnapshotDiscarder interface {
	DiscardSnapshot(ctx context.Context, c Captured) error
}

// CaptureReconciler is implemented by backends that keep their captures on the node
// (the OCI backend's capture records and sealed layers).
//
// The orchestrator calls ReconcileCaptures once at Start, after Backend.Reconcile and
// after the sandbox records were loaded, with every artifact it still references
// (catalog entries' artifacts, sandbox records' paused state and disk snapshots; some
// may be empty or belong to another backend). The backend frees the captures none of
// them names: a node killed between a capture and its registration (a snapshot, a
// fork's fan-out, a pause to disk) leaves such orphans. It must keep anything it cannot
// prove unreferenced; an error is logged and the captures stay.
type CaptureReconciler interface {
	ReconcileCaptures(ctx context.Context, referenced []json.RawMessage) error
}

// WarmForgetter is implemented by backends that keep pre-started instances per template
// root (the OCI backend's warm pool).
//
// The orchestrator calls ForgetTemplate when a template is deleted or replaced by a new
// version, with the root its sandboxes were launched on, so warm instances stop now
// instead of holding the old layers (disk space, mounts, loop devices) until pushed out.
// The root may no longer exist on disk: the backend then drops the warm instances whose
// files are gone. Errors are logged.
type WarmForgetter interface {
	ForgetTemplate(ctx context.Context, root RootFS) error
}

// CapturedStopper is implemented by instances that can stop faster once their state is
// captured.
//
// The orchestrator calls StopAfterCapture instead of Stop after a pause to disk has
// captured the instance (Snapshot succeeded). When it returns, the instance's processes
// are gone and its id may be launched again; what it held (unmounts, runtime state,
// network slot) may be released in the background. It is idempotent like Stop.
// Without it the orchestrator calls Stop.
type CapturedStopper interface {
	StopAfterCapture(ctx context.Context) error
}

// DirectoryBooter is implemented by backends that can run a sandbox on a plain directory
// tree: RootFS.LowerDir, a template's unpacked root filesystem (the OCI backend makes a
// per-sandbox overlay over it).
//
// The orchestrator passes a template's directory in LaunchPlan.RootFS.LowerDir only to
// backends whose BootsDirectories returns true, next to the template's layers when it
// has them; others see layered roots only, and a create from a template that has no
// layers is refused with ErrUnsupported before the backend is asked.
type DirectoryBooter interface {
	BootsDirectories() bool
}

// VolumeMounter is implemented by backends that can mount host directories (the node's
// volumes) into a sandbox: LaunchPlan.Mounts are honoured on every launch kind.
//
// Without it the orchestrator refuses a create that asks for volumes, before anything
// starts, instead of starting a sandbox without them.
type VolumeMounter interface {
	MountsVolumes() bool
}
