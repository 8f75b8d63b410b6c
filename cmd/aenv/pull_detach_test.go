package main

import (
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"
)

// TestPullDetached checks `aenv pull -d`: the node imports the image as a template build
// and the command returns at once, saying how to follow it.
func TestPullDetached(t *testing.T) {
	url, _ := pullNode(t)
	ref := "oci:" + pullTestLayout(t)
	_, msgs, err := aenv(t, url, "pull", "-d", ref, "--name", "bg", "--cpu-count", "2", "--mem", "256", "--probe", "8080", "--timeout", "30")
	if err != nil {
		t.Fatalf("%v\n%s", err, msgs)
	}
	var tid, bid string
	for _, l := range strings.Split(msgs, "\n") {
		if f := strings.Fields(l); len(f) == 5 && f[0] == "template" && f[1] == "bg" && f[3] == "build" {
			tid, bid = strings.Trim(f[2], "(),"), f[4]
		}
	}
	if tid == "" || !strings.Contains(msgs, "aenv template logs -f "+tid+" "+bid) {
		t.Fatalf("pull -d said:\n%s", msgs)
	}
	// The build pulls the image the CLI named, with its path made absolute for the node.
	deadline := time.Now().Add(20 * time.Second)
	for {
		out, _, _ := aenv(t, url, "template", "logs", tid, bid)
		if strings.Contains(out, "pulling "+ref) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("build log lacks the pull of %s:\n%s", ref, out)
		}
		time.Sleep(50 * time.Millisecond)
	}
	for _, tc := range []struct {
		args []string
		msg  string
	}{
		{[]string{"pull", "-d", ref, "--disk-mb", "100"}, "--disk-mb is not available with -d"},
		{[]string{"pull", "-d", ref, "--convert"}, "--convert is not available with -d"},
		{[]string{"pull", "-d", ref, "--user", "root"}, "--user is not available with -d"},
		{[]string{"pull", "-d", "has space:1"}, "bad image reference"},
		{[]string{"pull", ref, "--timeout", "soon"}, "seconds (600) or a duration"},
		{[]string{"pull", ref, "--timeout", "-5"}, "seconds (600) or a duration"},
	} {
		if _, _, err := aenv(t, url, tc.args...); err == nil || !strings.Contains(err.Error(), tc.msg) {
			t.Errorf("aenv %q: err = %v, want it to mention %q", tc.args, err, tc.msg)
		}
	}
}

func TestSecondsOrDuration(t *testing.T) {
	for in, want := range map[string]time.Duration{"600": 10 * time.Minute, "0": 0, "90s": 90 * time.Second, "1h": time.Hour} {
		var d time.Duration
		if err := (secondsOrDuration{&d}).Set(in); err != nil || d != want {
			t.Errorf("Set(%q) = %v, %v; want %v", in, d, err, want)
		}
	}
}

// TestPullTimeout: --timeout bounds a pull from a registry that never answers, and the
// abandoned pull registers nothing.
func TestPullTimeout(t *testing.T) {
	url, cat := pullNode(t)
	hang := make(chan struct{})
	reg := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-hang:
		case <-r.Context().Done():
		}
	}))
	defer reg.Close()
	defer close(hang)
	before, _ := cat.Templates().List("")
	start := time.Now()
	_, _, err := aenv(t, url, "pull", strings.TrimPrefix(reg.URL, "http://")+"/slow:1", "--name", "slow", "--timeout", "1")
	if err == nil || !strings.Contains(err.Error(), "deadline") {
		t.Fatalf("pull from a hanging registry: %v", err)
	}
	if d := time.Since(start); d > 15*time.Second {
		t.Errorf("--timeout 1 returned after %s", d)
	}
	if after, _ := cat.Templates().List(""); len(after) != len(before) {
		t.Errorf("the timed-out pull registered a template")
	}
}
