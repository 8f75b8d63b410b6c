package node

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"time"

	"github.com/aenv-dev/aenv/internal/config"
	"github.com/aenv-dev/aenv/internal/dataplane"
)

// nodeDataPlane is the node's side of the data plane: the client, and what starts it.
type nodeDataPlane struct {
	*dataplane.Client
	opts dataplane.StartOptions
	log  *slog.Logger
}

func dataPlaneDir(dataDir string) string { return filepath.Join(dataDir, "dataplane") }

// startDataPlane connects to the data plane of cfg.DataDir, starting one when none runs
// (the one a previous node started keeps serving its disks across this node's restart).
func startDataPlane(ctx context.Context, cfg config.Config, log *slog.Logger) (*nodeDataPlane, error) {
	dataDir, err := filepath.Abs(cfg.DataDir)
	if err != nil {
		return nil, err
	}
	dir := dataPlaneDir(dataDir)
	// The data plane is this very binary (`aenv dataplane`).
	exe, err := os.Executable()
	if err != nil {
		return nil, fmt.Errorf("locate this binary to start the data plane: %w", err)
	}
	cmdline := []string{exe, "dataplane", "--dir", dir}
	dp := &nodeDataPlane{opts: dataplane.StartOptions{Dir: dir, Command: cmdline, Cgroup: dataplane.CgroupName(dataDir), Log: log}, log: log}
	if err := dp.ensure(ctx); err != nil {
		return nil, err
	}
	return dp, nil
}

func (dp *nodeDataPlane) ensure(ctx context.Context) error {
	c, started, err := dataplane.Ensure(ctx, dp.opts)
	if errors.Is(err, dataplane.ErrVersion) {
		return fmt.Errorf("%w: a data plane of another aenv version still serves the disks of running sandboxes "+
			"under %s; run that version's `aenv serve` and stop its sandboxes (or set backend.data_plane = false)", err, dp.opts.Dir)
	}
	if err != nil {
		return fmt.Errorf("start the data plane: %w", err)
	}
	dp.Client = c
	st, err := c.Stats(ctx)
	if err != nil {
		return fmt.Errorf("data plane: %w", err)
	}
	dp.log.Info("data plane", "started", started, "pid", st.PID, "build", st.Build, "disks", st.Disks,
		"rss_mb", st.RSSBytes>>20, "socket", c.Socket)
	return nil
}

// watch calls lost with the sandboxes whose disks the data plane served when its process
// goes away (a kill, a crash), then starts a new one for the sandboxes to come, until ctx
// ends. Their roots fail with I/O errors from the moment it died: the kernel aborts
// its FUSE connections, so nothing waits and nothing is written any more.
func (dp *nodeDataPlane) watch(ctx context.Context, onPlane func() []string, lost func(ids []string)) {
	for ctx.Err() == nil {
		gone, err := dp.Watch(ctx)
		if err == nil {
			select {
			case <-ctx.Done():
				return
			case <-gone:
			}
		}
		if ctx.Err() != nil {
			return
		}
		ids := onPlane()
		dp.log.Error("the data plane is gone; the sandboxes whose root disks it served are lost", "sandboxes", len(ids), "ids", ids)
		lost(ids)
		for ctx.Err() == nil {
			if err := dp.ensure(ctx); err == nil {
				break
			} else {
				dp.log.Error("restart the data plane", "err", err)
			}
			select {
			case <-ctx.Done():
			case <-time.After(time.Second):
			}
		}
	}
}

// stopIfIdle ends the data plane when it serves no disk (a node shut down with its
// sandboxes stopped or paused), and removes its cgroup.
func (dp *nodeDataPlane) stopIfIdle(ctx context.Context) {
	st, err := dp.Stats(ctx)
	if err != nil || st.Disks > 0 {
		return
	}
	if err := dp.Shutdown(ctx); err != nil {
		dp.log.Warn("stop the idle data plane", "err", err)
		return
	}
	for range 100 {
		if dp.Ping(ctx) != nil {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	dataplane.RemoveCgroupWhenEmpty(ctx, dp.opts.Cgroup, 5*time.Second)
}

// dataPlaneDirs lists the disk directories a data plane serves for dataDir and the
// mount it serves their files from, without starting one; nil when none answers.
func dataPlaneDirs(ctx context.Context, dataDir string) []string {
	abs, err := filepath.Abs(dataDir)
	if err != nil {
		return nil
	}
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	list, err := dataplane.NewClient(dataplane.SocketPath(dataPlaneDir(abs))).List(ctx)
	if err != nil {
		return nil
	}
	dirs := make([]string, len(list), len(list)+1)
	for i, d := range list {
		dirs[i] = d.Dir
	}
	return append(dirs, dataplane.FUSEDir(dataPlaneDir(abs)))
}

// dataPlaneUser is a backend whose sandboxes' root disks the data plane serves (the OCI
// backend with backend.data_plane).
type dataPlaneUser interface {
	// OnDataPlane lists the sandboxes whose disks the data plane serves.
	OnDataPlane() []string
	// DataPlaneLost drops what the backend keeps ready on the data plane's disks.
	DataPlaneLost(ctx context.Context) error
}

// watchDataPlane removes the sandboxes a dead data plane took down, while the node runs.
func (n *Node) watchDataPlane(dp *nodeDataPlane) {
	u, ok := n.Backend.(dataPlaneUser)
	if !ok {
		return
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		dp.watch(ctx, u.OnDataPlane, func(ids []string) {
			if err := u.DataPlaneLost(ctx); err != nil {
				n.Log.Warn("drop warm sandboxes on layered roots", "err", err)
			}
			n.Orchestrator.DropLost(ctx, ids, "data plane died")
		})
	}()
	n.onClose(func(context.Context) { cancel(); <-done })
}
