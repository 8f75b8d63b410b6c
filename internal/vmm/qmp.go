package vmm

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"sync"
	"time"

	"golang.org/x/sys/unix"
)

// QMPError is an error answer from QEMU to one command.
type QMPError struct {
	Command string
	Class   string
	Desc    string
}

func (e *QMPError) Error() string {
	return fmt.Sprintf("qmp %s: %s (%s)", e.Command, e.Desc, e.Class)
}

// ErrQMPClosed means the monitor connection ended (QEMU exited or Close was called).
var ErrQMPClosed = errors.New("qmp connection closed")

// Event is an asynchronous QMP event (STOP, RESUME, SHUTDOWN, MIGRATION, ...).
type Event struct {
	Name string          `json:"event"`
	Data json.RawMessage `json:"data,omitempty"`
}

// QMPVersion is QEMU's version from the greeting.
type QMPVersion struct {
	Major, Minor, Micro int
	Package             string
}

// QMP is a client of one QEMU monitor socket. Commands are serialised (QMP answers in
// order, one at a time); each carries an id so an answer to a command whose caller gave
// up (context done) is recognised and dropped instead of being taken for the next one.
type QMP struct {
	conn    net.Conn
	version QMPVersion

	sem    chan struct{} // one command in flight
	nextID uint64        // guarded by sem

	replies chan qmpMessage
	events  chan Event
	done    chan struct{}
	errMu   sync.Mutex
	err     error
}

type qmpMessage struct {
	ID     json.RawMessage `json:"id,omitempty"`
	Return json.RawMessage `json:"return,omitempty"`
	Error  *struct {
		Class string `json:"class"`
		Desc  string `json:"desc"`
	} `json:"error,omitempty"`
	Event string          `json:"event,omitempty"`
	Data  json.RawMessage `json:"data,omitempty"`
	QMP   *struct {
		Version struct {
			QEMU struct {
				Major int `json:"major"`
				Minor int `json:"minor"`
				Micro int `json:"micro"`
			} `json:"qemu"`
			Package string `json:"package"`
		} `json:"version"`
	} `json:"QMP,omitempty"`
}

// eventBuffer bounds the events kept for a reader that is not draining them; older
// events are dropped rather than blocking the command answers behind them.
const eventBuffer = 64

// DialQMP connects to a QMP unix socket, reads the greeting and leaves capability
// negotiation mode. It does not retry: the caller knows whether QEMU is still starting.
func DialQMP(ctx context.Context, path string) (*QMP, error) {
	var d net.Dialer
	conn, err := d.DialContext(ctx, "unix", path)
	if err != nil {
		return nil, fmt.Errorf("qmp dial %s: %w", path, err)
	}
	if dl, ok := ctx.Deadline(); ok {
		_ = conn.SetDeadline(dl)
	}
	r := bufio.NewReader(conn)
	var greet qmpMessage
	if err := readMessage(r, &greet); err != nil || greet.QMP == nil {
		conn.Close()
		return nil, fmt.Errorf("qmp greeting from %s: %w", path, errors.Join(err, errNoGreeting(greet)))
	}
	if _, err := conn.Write([]byte(`{"execute":"qmp_capabilities"}` + "\n")); err != nil {
		conn.Close()
		return nil, fmt.Errorf("qmp capabilities: %w", err)
	}
	var ack qmpMessage
	for {
		if err := readMessage(r, &ack); err != nil {
			conn.Close()
			return nil, fmt.Errorf("qmp capabilities: %w", err)
		}
		if ack.Event == "" {
			break
		}
	}
	if ack.Error != nil {
		conn.Close()
		return nil, &QMPError{Command: "qmp_capabilities", Class: ack.Error.Class, Desc: ack.Error.Desc}
	}
	_ = conn.SetDeadline(time.Time{})
	v := greet.QMP.Version
	q := &QMP{
		conn:    conn,
		version: QMPVersion{Major: v.QEMU.Major, Minor: v.QEMU.Minor, Micro: v.QEMU.Micro, Package: v.Package},
		sem:     make(chan struct{}, 1),
		replies: make(chan qmpMessage, 1),
		events:  make(chan Event, eventBuffer),
		done:    make(chan struct{}),
	}
	go q.readLoop(r)
	return q, nil
}

func errNoGreeting(m qmpMessage) error {
	if m.QMP == nil {
		return errors.New("no QMP greeting")
	}
	return nil
}

func readMessage(r *bufio.Reader, m *qmpMessage) error {
	line, err := r.ReadBytes('\n')
	if err != nil {
		return err
	}
	*m = qmpMessage{}
	if err := json.Unmarshal(line, m); err != nil {
		return fmt.Errorf("qmp: malformed message %.120q: %w", line, err)
	}
	return nil
}

func (q *QMP) readLoop(r *bufio.Reader) {
	var err error
	for {
		var m qmpMessage
		if err = readMessage(r, &m); err != nil {
			break
		}
		if m.Event != "" {
			select {
			case q.events <- Event{Name: m.Event, Data: m.Data}:
			default: // nobody drains events: drop rather than stall command answers
			}
			continue
		}
		select {
		case q.replies <- m:
		case <-q.done:
			return
		}
	}
	q.fail(err)
}

func (q *QMP) fail(err error) {
	q.errMu.Lock()
	defer q.errMu.Unlock()
	if q.err != nil {
		return
	}
	q.err = fmt.Errorf("%w: %v", ErrQMPClosed, err)
	close(q.done)
	q.conn.Close()
}

func (q *QMP) closedErr() error {
	q.errMu.Lock()
	defer q.errMu.Unlock()
	return q.err
}

// Version is the QEMU version the greeting announced.
func (q *QMP) Version() QMPVersion { return q.version }

// Events delivers asynchronous events; at most eventBuffer are kept when not drained.
func (q *QMP) Events() <-chan Event { return q.events }

// Close ends the connection; commands in flight fail with ErrQMPClosed.
func (q *QMP) Close() error {
	q.fail(errors.New("closed by client"))
	return nil
}

// Execute runs one command. args (may be nil) is marshalled as "arguments"; the
// "return" value is unmarshalled into out when out is not nil. A QEMU error answer is a
// *QMPError.
func (q *QMP) Execute(ctx context.Context, command string, args, out any) error {
	return q.execute(ctx, command, args, out, nil)
}

// ExecuteWithFile runs one command and passes f's descriptor with it (SCM_RIGHTS), as
// getfd and add-fd expect. f stays open on this side; QEMU holds its own copy.
func (q *QMP) ExecuteWithFile(ctx context.Context, command string, args, out any, f *os.File) error {
	if f == nil {
		return fmt.Errorf("qmp %s: no file to pass", command)
	}
	return q.execute(ctx, command, args, out, f)
}

func (q *QMP) execute(ctx context.Context, command string, args, out any, f *os.File) error {
	select {
	case q.sem <- struct{}{}:
	case <-ctx.Done():
		return fmt.Errorf("qmp %s: %w", command, ctx.Err())
	case <-q.done:
		return fmt.Errorf("qmp %s: %w", command, q.closedErr())
	}
	defer func() { <-q.sem }()

	q.nextID++
	id := fmt.Sprintf(`"aenv-%d"`, q.nextID)
	req := struct {
		Execute   string          `json:"execute"`
		Arguments any             `json:"arguments,omitempty"`
		ID        json.RawMessage `json:"id"`
	}{command, args, json.RawMessage(id)}
	b, err := json.Marshal(req)
	if err != nil {
		return fmt.Errorf("qmp %s: encode arguments: %w", command, err)
	}
	dl, _ := ctx.Deadline()
	_ = q.conn.SetWriteDeadline(dl)
	if f != nil {
		uc, ok := q.conn.(*net.UnixConn)
		if !ok {
			return fmt.Errorf("qmp %s: passing a file needs a unix socket", command)
		}
		_, _, err = uc.WriteMsgUnix(append(b, '\n'), unix.UnixRights(int(f.Fd())), nil)
	} else {
		_, err = q.conn.Write(append(b, '\n'))
	}
	if err != nil {
		return fmt.Errorf("qmp %s: %w", command, errors.Join(q.closedErr(), err))
	}
	for {
		select {
		case m := <-q.replies:
			if string(m.ID) != id {
				continue // answer to an earlier command whose caller gave up
			}
			if m.Error != nil {
				return &QMPError{Command: command, Class: m.Error.Class, Desc: m.Error.Desc}
			}
			if out != nil && len(m.Return) > 0 {
				if err := json.Unmarshal(m.Return, out); err != nil {
					return fmt.Errorf("qmp %s: decode answer: %w", command, err)
				}
			}
			return nil
		case <-ctx.Done():
			return fmt.Errorf("qmp %s: %w", command, ctx.Err())
		case <-q.done:
			return fmt.Errorf("qmp %s: %w", command, q.closedErr())
		}
	}
}
