package orchestrator

import (
	"os"
	"slices"
	"syscall"
)

// CrashPointEnv names a debug-only crash point, "<operation>:<stage>" (for example
// "snapshot:capture"): when the node's environment sets it, the process kills itself
// with SIGKILL right after that stage of that operation, exactly as `kill -9` would
// there. The crash tests in test/integration use it to hit each window of a snapshot,
// a fork and a pause to disk, which are too short to hit from outside. Never set it in
// production.
const CrashPointEnv = "AENV_DEBUG_CRASH_AT"

// Crash points (operation:stage) the orchestrator honours.
const (
	// CrashSnapshotCaptured: the backend sealed the layers, nothing is registered.
	CrashSnapshotCaptured = opSnapshot + ":" + stageCapture
	// CrashSnapshotRegistered: in the catalog, its publication not yet started.
	CrashSnapshotRegistered = opSnapshot + ":" + stageRegister
	// CrashSnapshotPublishing: the publication started (journaled), uploads in flight.
	CrashSnapshotPublishing = opSnapshot + ":" + stagePublish
	// CrashForkCaptured: the source captured, no child launched.
	CrashForkCaptured = opFork + ":" + stageCapture
	// CrashForkLaunched: the first child is up, the others may not be.
	CrashForkLaunched = opFork + ":" + stageLaunch
	// CrashPauseCaptured: the pause to disk captured, the record still says running.
	CrashPauseCaptured = opPause + ":" + stageCapture
	// CrashPausePersisted: the record says paused to disk, the instance still runs.
	CrashPausePersisted = opPause + ":" + stagePersist
)

// stagePublish is the start of a snapshot's publication (a crash point only).
const stagePublish = "publish"

// crashPoint kills the process when the node was started with CrashPointEnv set to
// operation:stage. o.crashAt is read once, at New.
func (o *Orchestrator) crashPoint(operation, stage string) {
	if o.crashAt == "" || o.crashAt != operation+":"+stage {
		return
	}
	o.log.Warn("crash point reached: killing the node", "point", o.crashAt)
	_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
	select {} // SIGKILL cannot be caught; nothing after this runs
}

// armCrashPoint says loudly that a crash point is set, and when it names none that
// exists (a typo would otherwise make a crash test pass without crashing).
func (o *Orchestrator) armCrashPoint() {
	if o.crashAt == "" {
		return
	}
	known := []string{CrashSnapshotCaptured, CrashSnapshotRegistered, CrashSnapshotPublishing,
		CrashForkCaptured, CrashForkLaunched, CrashPauseCaptured, CrashPausePersisted}
	if !slices.Contains(known, o.crashAt) {
		o.log.Error("unknown debug crash point; ignored", "env", CrashPointEnv, "point", o.crashAt, "known", known)
		o.crashAt = ""
		return
	}
	o.log.Warn("debug crash point armed: the node kills itself there", "env", CrashPointEnv, "point", o.crashAt)
}
