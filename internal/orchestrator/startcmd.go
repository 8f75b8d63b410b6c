package orchestrator

import (
	"cmp"
	"context"
	"fmt"
	"time"

	"connectrpc.com/connect"

	"github.com/aenv-dev/aenv/internal/envdclient"
	"github.com/aenv-dev/aenv/internal/sandbox"
	"github.com/aenv-dev/aenv/internal/sandboxconn"
)

// startCmdTag is the envd process tag of a template's start command, so users can find
// it with commands.list() and reattach to its output.
const startCmdTag = "start-cmd"

// runsFreshProcesses says whether a launch boots the sandbox's processes anew (so the
// template's start command must run again) rather than continuing them from memory.
func runsFreshProcesses(plan sandbox.LaunchPlan, caps sandbox.Capabilities) bool {
	switch {
	case plan.Kind == sandbox.LaunchFresh, plan.ColdBoot:
		return true
	case plan.Kind == sandbox.LaunchFromSnapshot:
		return !caps.MemorySnapshots
	default: // LaunchResume continues the paused processes
		return false
	}
}

// startTemplateCommand starts the template's start command in the background through
// envd, as the template's default user in its workdir, and returns once envd reports
// the process started. E2B templates capture a running start command in their memory
// snapshot; a backend that boots fresh processes has to start it again instead.
func (o *Orchestrator) startTemplateCommand(ctx context.Context, ep sandbox.Endpoint, rec *Sandbox) error {
	cmd := rec.Launch.StartCmd
	if cmd == "" {
		return nil
	}
	// The stream outlives the operation: it carries the output into the sandbox's logs
	// (logs.go) until the process ends or the sandbox goes. Only starting is bounded by ctx.
	client := envdclient.New(o.streamClient(), o.envdURL(ep), envdclient.WithAccessToken(rec.EnvdAccessToken))
	fctx, cancel := context.WithCancel(sandboxconn.WithSandbox(context.WithoutCancel(ctx), rec.ID))
	stop := context.AfterFunc(ctx, cancel)
	p, err := client.Start(fctx, envdclient.Command{
		Cmd:  "/bin/bash",
		Args: []string{"-l", "-c", cmd},
		Cwd:  cmp.Or(rec.Launch.DefaultWorkdir, defaultWorkdir),
		User: cmp.Or(rec.Launch.DefaultUser, defaultUser),
		Tag:  startCmdTag,
	})
	if !stop() || err != nil {
		cancel()
		if err == nil {
			p.Close()
			err = ctx.Err()
		}
		// ErrNoStart's text keeps the message this returned before envdclient existed.
		return fmt.Errorf("start command: %w", err)
	}
	o.followStartCommand(rec.ID, p, fctx, cancel, msgStartCmdStarted)
	return nil
}

// reattachStartCommand resumes capturing the output of the start command of a sandbox
// the node adopted after a restart (running, or paused in place and now resumed): the
// process outlived the node that started it, but its output went nowhere since. The
// sandbox's logs say whether it was still running and its pid; envd's Connect (tagged
// processes outlive their stream) re-attaches. Output written while no node listened is
// lost. It does nothing while the capture runs (a resume on the node that paused it). It
// returns at once; the work runs in the background so a node with many sandboxes is not
// held up starting.
func (o *Orchestrator) reattachStartCommand(ctx context.Context, ep sandbox.Endpoint, rec *Sandbox) {
	if rec.Launch.StartCmd == "" || o.logs.following(rec.ID) {
		return
	}
	pid, running := o.logs.startCommandPid(rec.ID)
	if !running {
		return
	}
	id := rec.ID
	client := envdclient.New(o.streamClient(), o.envdURL(ep), envdclient.WithAccessToken(rec.EnvdAccessToken))
	fctx, cancel := context.WithCancel(sandboxconn.WithSandbox(context.WithoutCancel(ctx), id))
	go func() {
		// Only the attach is bounded; the stream then lasts as long as the process.
		timer := time.AfterFunc(o.cfg.EnvdReadyTimeout, cancel)
		p, err := client.Connect(fctx, envdclient.Selector{Pid: pid, Tag: startCmdTag})
		if !timer.Stop() || err != nil {
			cancel()
			if err == nil {
				p.Close()
				err = fctx.Err()
			}
			if connect.CodeOf(err) == connect.CodeNotFound {
				// envd forgets finished processes after a while: it ended unseen.
				o.logEvent(id, LevelInfo, msgStartCmdGone, nil)
				return
			}
			o.log.Warn("re-attach template start command", "sandbox", id, "err", err)
			o.logEvent(id, LevelWarn, "start command output not re-attached", map[string]string{"error": err.Error()})
			return
		}
		o.followStartCommand(id, p, fctx, cancel, msgStartCmdReattached)
	}()
}
