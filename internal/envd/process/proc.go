package process

import (
	"errors"
	"os"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	pb "github.com/aenv-dev/aenv/internal/envd/gen/process"
)

const (
	pipeChunk = 32 * 1024 // E2B: output chunks are at most 32 KiB
	ptyChunk  = 16 * 1024 // and 16 KiB on a PTY
	// drainGrace is how long output readers keep going without data once the process has exited.
	// Descendants that inherited stdout (`sleep 100 &`) would otherwise hold the stream open.
	drainGrace = 50 * time.Millisecond
)

// proc is one started process.
type proc struct {
	pid    uint32
	tag    *string
	config *pb.ProcessConfig

	hub hub

	ioMu  sync.Mutex
	stdin *os.File // write end of the stdin pipe; nil when none or closed
	pty   *os.File // PTY master; nil for pipe processes

	outputs []*os.File // read ends being drained
	readers sync.WaitGroup

	done     chan struct{} // closed when the end event is recorded
	end      *pb.ProcessEvent
	endedAt  time.Time
	killTime *time.Timer
}

func (p *proc) isPTY() bool { return p.pty != nil }

// signal sends sig to the process group (each process leads its own), falling back to the process.
func (p *proc) signal(sig syscall.Signal) error {
	select {
	case <-p.done:
		return os.ErrProcessDone
	default:
	}
	if err := unix.Kill(-int(p.pid), sig); err == nil {
		return nil
	}
	return unix.Kill(int(p.pid), sig)
}

// read drains one output stream into events of the given kind until EOF, or until the process has
// exited and no more data arrives within drainGrace.
func (p *proc) read(f *os.File, chunk int, wrap func([]byte) *pb.ProcessEvent_DataEvent) {
	defer p.readers.Done()
	buf := make([]byte, chunk)
	retry := true
	for {
		n, err := f.Read(buf)
		if n > 0 {
			retry = true
			data := make([]byte, n)
			copy(data, buf[:n])
			p.hub.publish(&pb.ProcessEvent{Event: &pb.ProcessEvent_Data{Data: wrap(data)}})
		}
		if err == nil {
			continue
		}
		if errors.Is(err, os.ErrDeadlineExceeded) && retry {
			// The deadline may have passed while we were delivering; look once more.
			retry = false
			_ = f.SetReadDeadline(time.Now().Add(drainGrace))
			continue
		}
		return // EOF, EIO (PTY slave closed), or any read error ends this stream
	}
}

// finish runs once the process has been reaped: it lets the readers drain, closes the descriptors
// and publishes the end event.
func (p *proc) finish(ws unix.WaitStatus) {
	if p.killTime != nil {
		p.killTime.Stop()
	}
	dl := time.Now().Add(drainGrace)
	for _, f := range p.outputs {
		_ = f.SetReadDeadline(dl)
	}
	p.readers.Wait()
	p.ioMu.Lock()
	for _, f := range p.outputs {
		f.Close()
	}
	if p.stdin != nil {
		p.stdin.Close()
		p.stdin = nil
	}
	p.ioMu.Unlock()

	end := endEvent(ws)
	p.end = &pb.ProcessEvent{Event: &pb.ProcessEvent_End{End: end}}
	p.endedAt = time.Now()
	close(p.done)
	p.hub.close(p.end)
}

// endEvent mirrors Go's exec: ExitCode() (-1 when signalled), Exited(), ProcessState.String(), and
// the Wait() error string when the process failed.
func endEvent(ws unix.WaitStatus) *pb.ProcessEvent_EndEvent {
	ev := &pb.ProcessEvent_EndEvent{ExitCode: -1}
	var status string
	switch {
	case ws.Exited():
		ev.Exited = true
		ev.ExitCode = int32(ws.ExitStatus())
		status = "exit status " + itoa(ws.ExitStatus())
	case ws.Signaled():
		status = "signal: " + ws.Signal().String()
		if ws.CoreDump() {
			status += " (core dumped)"
		}
	default:
		status = "unknown status"
	}
	ev.Status = status
	if !ev.Exited || ev.ExitCode != 0 {
		ev.Error = &status
	}
	return ev
}

func itoa(n int) string {
	if n == 0 {
		return "0"
	}
	neg := n < 0
	if neg {
		n = -n
	}
	var b [20]byte
	i := len(b)
	for n > 0 {
		i--
		b[i] = byte('0' + n%10)
		n /= 10
	}
	if neg {
		i--
		b[i] = '-'
	}
	return string(b[i:])
}
