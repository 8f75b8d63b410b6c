package dataplane

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"sync"
	"syscall"
	"time"

	"github.com/aenv-dev/aenv/internal/storage/blockdev"
	"github.com/aenv-dev/aenv/internal/storage/stack"
)

// ErrNotFound is the data plane's answer about a disk it does not serve.
var ErrNotFound = errors.New("dataplane: no such disk")

// ErrVersion means the data plane speaks another major version of the socket API.
var ErrVersion = errors.New("dataplane: incompatible API version")

// ErrUnsupported means the data plane is older than this client and lacks an operation.
var ErrUnsupported = errors.New("dataplane: operation not supported by this data plane")

// Client talks to a data plane over its unix socket. Each call uses a connection of its
// own (a snapshot keeps one for its steps), so calls may run concurrently.
type Client struct {
	Socket string
	// Build is the data plane's build, learnt at the first hello.
	mu    sync.Mutex
	build string
}

// NewClient returns a client of the data plane listening on socket.
func NewClient(socket string) *Client { return &Client{Socket: socket} }

type conn struct {
	c   net.Conn
	r   *bufio.Reader
	enc *json.Encoder
}

// dial connects and says hello.
func (c *Client) dial(ctx context.Context) (*conn, error) {
	var d net.Dialer
	nc, err := d.DialContext(ctx, "unix", c.Socket)
	if err != nil {
		return nil, fmt.Errorf("dataplane: connect %s: %w", c.Socket, err)
	}
	cn := &conn{c: nc, r: bufio.NewReader(nc), enc: json.NewEncoder(nc)}
	resp, err := cn.call(ctx, request{Op: opHello, Version: APIVersion})
	if err != nil {
		nc.Close()
		return nil, err
	}
	c.mu.Lock()
	c.build = resp.Build
	c.mu.Unlock()
	return cn, nil
}

func (cn *conn) close() { cn.c.Close() }

// call sends req and reads the response; ctx bounds both.
func (cn *conn) call(ctx context.Context, req request) (response, error) {
	if dl, ok := ctx.Deadline(); ok {
		_ = cn.c.SetDeadline(dl)
	} else {
		_ = cn.c.SetDeadline(time.Time{})
	}
	stop := context.AfterFunc(ctx, func() { _ = cn.c.SetDeadline(time.Unix(1, 0)) })
	defer stop()
	if err := cn.enc.Encode(req); err != nil {
		return response{}, fmt.Errorf("dataplane: %s: %w", req.Op, err)
	}
	line, err := cn.r.ReadBytes('\n')
	if err != nil {
		if ctx.Err() != nil {
			err = ctx.Err()
		}
		return response{}, fmt.Errorf("dataplane: %s: %w", req.Op, err)
	}
	var resp response
	if err := json.Unmarshal(line, &resp); err != nil {
		return response{}, fmt.Errorf("dataplane: %s: bad response: %w", req.Op, err)
	}
	if resp.Error != "" {
		switch resp.Code {
		case codeNotFound:
			return resp, fmt.Errorf("%w: %s", ErrNotFound, resp.Error)
		case codeVersion:
			return resp, fmt.Errorf("%w: %s (data plane build %q)", ErrVersion, resp.Error, resp.Build)
		case codeBroken:
			return resp, fmt.Errorf("%w: %s", stack.ErrBroken, resp.Error)
		case codeInUse:
			return resp, fmt.Errorf("%w: %s", blockdev.ErrStillInUse, resp.Error)
		case codeUnknown:
			return resp, fmt.Errorf("%w: %s", ErrUnsupported, resp.Error)
		}
		return resp, errors.New(resp.Error)
	}
	return resp, nil
}

// do runs one request on a fresh connection.
func (c *Client) do(ctx context.Context, req request) (response, error) {
	cn, err := c.dial(ctx)
	if err != nil {
		return response{}, err
	}
	defer cn.close()
	return cn.call(ctx, req)
}

// Build is the data plane's build string ("" before the first call).
func (c *Client) Build() string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.build
}

// Ping says hello: it fails when no compatible data plane answers.
func (c *Client) Ping(ctx context.Context) error {
	cn, err := c.dial(ctx)
	if err != nil {
		return err
	}
	cn.close()
	return nil
}

// Open asks the data plane to open and serve a disk.
func (c *Client) Open(ctx context.Context, spec Spec) (*RemoteDisk, error) {
	if err := spec.Validate(); err != nil {
		return nil, err
	}
	resp, err := c.do(ctx, request{Op: opOpen, Spec: &spec})
	if err != nil {
		return nil, err
	}
	if resp.Info == nil {
		return nil, errors.New("dataplane: open: no disk in the answer")
	}
	return c.Attach(*resp.Info), nil
}

// OpenDisk is Open for rootfs's disk opener.
func (c *Client) OpenDisk(ctx context.Context, spec Spec) (*RemoteDisk, error) {
	return c.Open(ctx, spec)
}

// Attach returns a handle on a disk the data plane already serves (from List).
func (c *Client) Attach(info Info) *RemoteDisk { return &RemoteDisk{c: c, info: info} }

// List returns the disks the data plane serves.
func (c *Client) List(ctx context.Context) ([]Info, error) {
	resp, err := c.do(ctx, request{Op: opList})
	if err != nil {
		return nil, err
	}
	return resp.Disks, nil
}

// Close asks the data plane to stop serving the disk in dir. Whatever attached its file
// must have let go of it first.
func (c *Client) Close(ctx context.Context, dir string) error {
	_, err := c.do(ctx, request{Op: opClose, Dir: dir})
	return err
}

// Stats describes the data plane process.
func (c *Client) Stats(ctx context.Context) (Stats, error) {
	resp, err := c.do(ctx, request{Op: opStats})
	if err != nil {
		return Stats{}, err
	}
	if resp.Stats == nil {
		return Stats{}, errors.New("dataplane: stats: empty answer")
	}
	return *resp.Stats, nil
}

// Shutdown asks the data plane to exit; it refuses while it serves a disk.
func (c *Client) Shutdown(ctx context.Context) error {
	_, err := c.do(ctx, request{Op: opShutdown})
	return err
}

// Watch returns a channel that is closed when the data plane's process goes away (its
// connection ends): a kill, a crash, or a granted shutdown.
func (c *Client) Watch(ctx context.Context) (<-chan struct{}, error) {
	cn, err := c.dial(ctx)
	if err != nil {
		return nil, err
	}
	gone := make(chan struct{})
	go func() {
		defer close(gone)
		_ = cn.c.SetDeadline(time.Time{})
		stop := context.AfterFunc(ctx, func() { cn.close() })
		defer stop()
		// The server never answers without a request: a read returns only at EOF.
		_, _ = cn.r.ReadByte()
		cn.close()
	}()
	return gone, nil
}

// RemoteDisk is a disk served by the data plane.
type RemoteDisk struct {
	c    *Client
	info Info
	mu   sync.Mutex
}

// Dir is the disk's directory (its name).
func (d *RemoteDisk) Dir() string { return d.info.Dir }

// Path is the device file.
func (d *RemoteDisk) Path() string { return d.info.Path }

// Size is the device size.
func (d *RemoteDisk) Size() int64 { return d.info.Size }

// Lowers returns the lowers as of the last open, list or snapshot.
func (d *RemoteDisk) Lowers() []stack.LayerRef {
	d.mu.Lock()
	defer d.mu.Unlock()
	return append([]stack.LayerRef(nil), d.info.Lowers...)
}

// Close asks the data plane to close the disk. One it no longer serves is fine, and so
// is no data plane at all: the disk died with it.
func (d *RemoteDisk) Close() error {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	err := d.c.Close(ctx, d.info.Dir)
	if err == nil || errors.Is(err, ErrNotFound) || gone(err) {
		return nil
	}
	return err
}

// DropSyncs tells the data plane that the disk's directory is deleted once it closes:
// its flushes write nothing back from now on (Disk.DropSyncs). A data plane that
// predates the operation, or no longer serves the disk, syncs as before: that only
// costs the fsyncs.
func (d *RemoteDisk) DropSyncs() error {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	_, err := d.c.do(ctx, request{Op: opDropSyncs, Dir: d.info.Dir})
	if err == nil || errors.Is(err, ErrNotFound) || errors.Is(err, ErrUnsupported) || gone(err) {
		return nil
	}
	return err
}

// gone reports whether err means no data plane answers any more (none listens, or the
// one that did died during the call).
func gone(err error) bool {
	for _, e := range []error{syscall.ECONNREFUSED, os.ErrNotExist, io.EOF, io.ErrUnexpectedEOF, syscall.ECONNRESET, syscall.EPIPE} {
		if errors.Is(err, e) {
			return true
		}
	}
	return false
}

// BeginSnapshot starts a snapshot on a connection of its own; the data plane ends it if
// the connection goes away first.
func (d *RemoteDisk) BeginSnapshot(ctx context.Context) (Snapshot, error) {
	cn, err := d.c.dial(ctx)
	if err != nil {
		return nil, err
	}
	if _, err := cn.call(ctx, request{Op: opSnapBegin, Dir: d.info.Dir}); err != nil {
		cn.close()
		return nil, err
	}
	return &remoteSnap{d: d, cn: cn}, nil
}

type remoteSnap struct {
	d  *RemoteDisk
	cn *conn
}

func (s *remoteSnap) Quiet(ctx context.Context) error {
	_, err := s.cn.call(ctx, request{Op: opSnapQuiet})
	return err
}

func (s *remoteSnap) Seal(ctx context.Context, output string) (stack.LayerRef, error) {
	resp, err := s.cn.call(ctx, request{Op: opSnapSeal, Output: output})
	if err != nil {
		return stack.LayerRef{}, err
	}
	if resp.Ref == nil {
		return stack.LayerRef{}, errors.New("dataplane: seal: no layer in the answer")
	}
	return *resp.Ref, nil
}

func (s *remoteSnap) Finish(ctx context.Context) ([]stack.LayerRef, time.Duration, error) {
	resp, err := s.cn.call(ctx, request{Op: opSnapFinish})
	if err != nil {
		return nil, 0, err
	}
	s.d.mu.Lock()
	s.d.info.Lowers = resp.Lowers
	s.d.mu.Unlock()
	return resp.Lowers, resp.Durable, nil
}

func (s *remoteSnap) End() { s.cn.close() }
