package vmm

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"net"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// qmpPeer is the QEMU side of a QMP socket for protocol tests: it greets, acknowledges
// qmp_capabilities, then answers each command with answer(cmd, id).
func qmpPeer(t *testing.T, answer func(w *bufio.Writer, cmd string, id json.RawMessage)) string {
	t.Helper()
	sock := filepath.Join(t.TempDir(), "qmp.sock")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	go func() {
		c, err := l.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		r, w := bufio.NewReader(c), bufio.NewWriter(c)
		w.WriteString(`{"QMP": {"version": {"qemu": {"micro": 22, "minor": 2, "major": 7}, "package": "Debian"}, "capabilities": ["oob"]}}` + "\r\n")
		w.Flush()
		for {
			line, err := r.ReadBytes('\n')
			if err != nil {
				return
			}
			var req struct {
				Execute string          `json:"execute"`
				ID      json.RawMessage `json:"id"`
			}
			if err := json.Unmarshal(line, &req); err != nil {
				return
			}
			if req.Execute == "qmp_capabilities" {
				w.WriteString(`{"return": {}}` + "\r\n")
			} else {
				answer(w, req.Execute, req.ID)
			}
			w.Flush()
		}
	}()
	return sock
}

func TestQMPProtocol(t *testing.T) {
	sock := qmpPeer(t, func(w *bufio.Writer, cmd string, id json.RawMessage) {
		switch cmd {
		case "stop":
			// An event before the answer must not be taken for it.
			w.WriteString(`{"timestamp": {"seconds": 1, "microseconds": 2}, "event": "STOP"}` + "\r\n")
			w.WriteString(`{"return": {}, "id": ` + string(id) + "}\r\n")
		case "query-status":
			w.WriteString(`{"return": {"status": "paused", "running": false}, "id": ` + string(id) + "}\r\n")
		case "slow":
			w.Flush()
			time.Sleep(200 * time.Millisecond)
			w.WriteString(`{"return": {"late": true}, "id": ` + string(id) + "}\r\n")
		case "big":
			w.WriteString(`{"return": {"blob": "` + strings.Repeat("x", 200000) + `"}, "id": ` + string(id) + "}\r\n")
		default:
			w.WriteString(`{"error": {"class": "CommandNotFound", "desc": "The command ` + cmd + ` has not been found"}, "id": ` + string(id) + "}\r\n")
		}
	})
	ctx := context.Background()
	q, err := DialQMP(ctx, sock)
	if err != nil {
		t.Fatal(err)
	}
	defer q.Close()
	if v := q.Version(); v.Major != 7 || v.Minor != 2 || v.Micro != 22 {
		t.Fatalf("version = %+v", v)
	}
	if err := q.Execute(ctx, "stop", nil, nil); err != nil {
		t.Fatal(err)
	}
	if ev := <-q.Events(); ev.Name != "STOP" {
		t.Fatalf("event = %+v", ev)
	}
	var st struct{ Status string }
	if err := q.Execute(ctx, "query-status", nil, &st); err != nil || st.Status != "paused" {
		t.Fatalf("query-status = %+v, %v", st, err)
	}
	var qe *QMPError
	if err := q.Execute(ctx, "nope", map[string]any{"a": 1}, nil); !errors.As(err, &qe) || qe.Class != "CommandNotFound" {
		t.Fatalf("unknown command error = %v", err)
	}
	// A caller that gives up does not receive, or leave behind, a wrong answer.
	sctx, cancel := context.WithTimeout(ctx, 20*time.Millisecond)
	err = q.Execute(sctx, "slow", nil, nil)
	cancel()
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("slow command error = %v", err)
	}
	st.Status = ""
	if err := q.Execute(ctx, "query-status", nil, &st); err != nil || st.Status != "paused" {
		t.Fatalf("query-status after an abandoned command = %+v, %v", st, err)
	}
	var big struct{ Blob string }
	if err := q.Execute(ctx, "big", nil, &big); err != nil || len(big.Blob) != 200000 {
		t.Fatalf("200 kB answer: len %d, %v", len(big.Blob), err)
	}
	q.Close()
	if err := q.Execute(ctx, "query-status", nil, nil); !errors.Is(err, ErrQMPClosed) {
		t.Fatalf("after Close: %v", err)
	}
}

func TestQMPBadGreeting(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "qmp.sock")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	go func() {
		c, err := l.Accept()
		if err == nil {
			c.Write([]byte("not json\n"))
			c.Close()
		}
	}()
	if _, err := DialQMP(context.Background(), sock); err == nil {
		t.Fatal("DialQMP accepted a peer without a QMP greeting")
	}
}
