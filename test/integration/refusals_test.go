package integration

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"testing"
	"time"

	"github.com/aenv-dev/aenv/internal/bench"
)

// TestSnapshotForkRefusals drives a real node with the bad requests of a snapshot and a
// fork: a count of 0, -1 or 1000, a bad name, a sandbox paused in memory or to disk, one
// being killed and one gone. Each answers a clear 4xx and changes nothing: no snapshot
// appears, no sandbox appears or changes state. A snapshot racing a kill either wins
// (and works) or is refused.
func TestSnapshotForkRefusals(t *testing.T) {
	n := newNode(t, "AENV_SANDBOX_SHUTDOWN_ACTION=stop")
	n.start()
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	c := n.client()
	src := n.create(ctx, c)
	run(ctx, t, c, src, "echo v1 > /home/user/marker")
	if _, err := n.api(ctx, http.MethodPost, "/sandboxes/"+src.ID+"/fork", `{"count":1}`, http.StatusCreated); err != nil {
		skipIfNotLayered(t, err)
		t.Fatal(err)
	}
	killAll(ctx, t, c)
	src = n.create(ctx, c)
	inMemory, onDisk := n.create(ctx, c), n.create(ctx, c)
	if _, err := n.api(ctx, http.MethodPost, "/sandboxes/"+inMemory.ID+"/pause", `{}`, http.StatusNoContent); err != nil {
		t.Fatal(err)
	}
	if _, err := n.api(ctx, http.MethodPost, "/sandboxes/"+onDisk.ID+"/pause", `{"memory":false}`, http.StatusNoContent); err != nil {
		t.Fatal(err)
	}
	gone := n.create(ctx, c)
	if err := c.Kill(ctx, gone.ID); err != nil {
		t.Fatal(err)
	}
	before := states(ctx, t, c)

	for _, tc := range []struct {
		name, path, body string
		want             int
	}{
		{"fork count 0", "/sandboxes/" + src.ID + "/fork", `{"count":0}`, http.StatusBadRequest},
		{"fork count -1", "/sandboxes/" + src.ID + "/fork", `{"count":-1}`, http.StatusBadRequest},
		{"fork count 1000", "/sandboxes/" + src.ID + "/fork", `{"count":1000}`, http.StatusBadRequest},
		{"fork count not a number", "/sandboxes/" + src.ID + "/fork", `{"count":"many"}`, http.StatusBadRequest},
		{"fork negative timeout", "/sandboxes/" + src.ID + "/fork", `{"count":1,"timeout":-5}`, http.StatusBadRequest},
		{"snapshot bad name", "/sandboxes/" + src.ID + "/snapshots", `{"name":"../etc"}`, http.StatusBadRequest},
		{"snapshot paused in memory", "/sandboxes/" + inMemory.ID + "/snapshots", `{}`, http.StatusConflict},
		{"fork paused in memory", "/sandboxes/" + inMemory.ID + "/fork", `{"count":2}`, http.StatusConflict},
		{"snapshot paused to disk", "/sandboxes/" + onDisk.ID + "/snapshots", `{}`, http.StatusConflict},
		{"fork paused to disk", "/sandboxes/" + onDisk.ID + "/fork", `{"count":2}`, http.StatusConflict},
		{"snapshot killed", "/sandboxes/" + gone.ID + "/snapshots", `{}`, http.StatusNotFound},
		{"fork killed", "/sandboxes/" + gone.ID + "/fork", `{"count":2}`, http.StatusNotFound},
	} {
		out, err := n.api(ctx, http.MethodPost, tc.path, tc.body, tc.want)
		if err != nil {
			t.Errorf("%s: %v", tc.name, err)
			continue
		}
		var body struct {
			Code    int    `json:"code"`
			Message string `json:"message"`
		}
		if err := json.Unmarshal(out, &body); err != nil || body.Code != tc.want || body.Message == "" {
			t.Errorf("%s: answer %s is not an E2B error with code %d and a message", tc.name, out, tc.want)
		}
	}
	if after := states(ctx, t, c); fmt.Sprint(after) != fmt.Sprint(before) {
		t.Errorf("refused requests changed the sandboxes: %v, was %v", after, before)
	}
	if snaps := n.snapshots(ctx, t); len(snaps) != 0 {
		t.Errorf("refused requests made snapshots %v", snaps)
	}

	// A snapshot racing a kill: taken before it (and usable), or refused.
	for range 3 {
		sb := n.create(ctx, c)
		res := make(chan error, 1)
		go func() {
			_, err := n.api(ctx, http.MethodPost, "/sandboxes/"+sb.ID+"/snapshots", `{}`, http.StatusCreated)
			res <- err
		}()
		if err := c.Kill(ctx, sb.ID); err != nil {
			t.Fatal(err)
		}
		err := <-res
		var se *bench.APIError
		switch {
		case err == nil:
		case errors.As(err, &se) && (se.Status == http.StatusConflict || se.Status == http.StatusNotFound):
		default:
			t.Errorf("snapshot racing a kill: %v", err)
		}
	}
	for _, id := range n.snapshots(ctx, t) {
		child, err := c.Create(ctx, bench.CreateRequest{TemplateID: id, Timeout: 120, Secure: true})
		if err != nil {
			t.Errorf("create from a snapshot that won its race with a kill: %v", err)
			continue
		}
		n.observe()
		run(ctx, t, c, child, "true")
		if _, err := n.api(ctx, http.MethodDelete, "/templates/"+id, "", http.StatusNoContent); err != nil {
			t.Fatal(err)
		}
	}
	killAll(ctx, t, c)
	n.stop()
	requireNoLeftovers(t, n, nil)
	requireNoStateLeftovers(t, n)
}
