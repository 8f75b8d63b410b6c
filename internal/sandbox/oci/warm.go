package oci

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/aenv-dev/aenv/internal/rootfs"
	"github.com/aenv-dev/aenv/internal/sandbox"
	"golang.org/x/sys/unix"
)

// firstCommandFiles are what a sandbox's first command (envd runs `/bin/bash -l -c
// CMD`, as the E2B SDKs ask) reads from the root: the shell with its interpreter and
// libraries, the login profile scripts and the user and name-service databases.
var firstCommandFiles = []string{
	"/bin/bash", "/bin/sh", "/etc/ld.so.cache", "/etc/profile", "/etc/profile.d", "/etc/bash.bashrc",
	"/etc/bashrc", "/etc/environment", "/etc/passwd", "/etc/group", "/etc/nsswitch.conf",
	"/root/.bashrc", "/root/.profile", "/root/.bash_profile",
	"/home/user/.bashrc", "/home/user/.profile", "/home/user/.bash_profile",
	// Debian's /etc/profile runs `id -u`; a UTF-8 LANG (the base template's) loads the
	// locale's files and the gconv cache.
	"/usr/bin/id", "/usr/lib/locale/C.utf8", "/usr/lib/locale/C.utf8/LC_MESSAGES",
	"/usr/lib/x86_64-linux-gnu/gconv/gconv-modules.cache",
}

// prefetchLimit bounds the bytes Prefetch reads into a warm container's page cache.
const prefetchLimit = 32 << 20

// maxWarmTemplates bounds how many templates are kept warm at once (least recently
// launched first out).
const maxWarmTemplates = 4

// warmTrimInterval is how often the filler checks for pools larger than their template's
// demand (a burst older than burstHold) and removes the extra containers.
const warmTrimInterval = time.Minute

// warmPool keeps containers created (`runc create`: namespaces, cgroup, rootfs, network
// all set up) and started (envd running, waiting for its /init) for recently launched
// templates. A launch then only sets the sandbox's limits, hostname and network policy:
// the runtime's work and envd's start are off its path.
//
// Each template's pool holds size containers, or as many as its largest recent burst of
// launches (see demand) up to maxSize, so the next burst of that size finds every one of
// its sandboxes warm.
//
// A warm container's id contains '.', which sandbox ids cannot, so the two never collide.
type warmPool struct {
	b       *Backend
	size    int // containers kept per wanted template
	maxSize int // what a burst may grow a template's pool to
	now     func() time.Time

	mu     sync.Mutex
	ready  map[string][]*Instance // by root key: a template's lower dir, or blockKey
	roots  map[string]createOpts  // the root each wanted key stands for
	demand map[string]*demand     // launches of each wanted key
	// prefetch lists, by key, the files the first warm container of a block root read
	// (rootfs.Prefetch); the next ones on the same layers read them without resolving
	// them again (rootfs.PrefetchFiles).
	prefetch map[string][]string
	wanted   []string // most recently launched first
	// inflight counts launches between begin and their end; overlapped is when two last
	// ran at once (see refillQuiet).
	inflight   int
	overlapped time.Time
	ended      time.Time // when the last launch ended (see refillDefer)
	short      time.Time // since when a pool has been short; zero when none is
	seq        int
	// preparing is the root key the filler is creating a container for, and prepared is
	// closed once that container is in the pool or discarded (forget waits for it).
	preparing string
	prepared  chan struct{}
	running   bool
	closed    bool
	wake      chan struct{}
	done      chan struct{}
	exited    chan struct{}
}

func newWarmPool(b *Backend, size, maxSize int) *warmPool {
	return &warmPool{
		b: b, size: size, maxSize: max(size, maxSize), now: time.Now,
		ready: map[string][]*Instance{}, roots: map[string]createOpts{}, demand: map[string]*demand{},
		prefetch: map[string][]string{},
		wake:     make(chan struct{}, 1), done: make(chan struct{}), exited: make(chan struct{}),
	}
}

// take removes and returns a warm container of lower, or nil.
func (w *warmPool) take(lower string) *Instance {
	w.mu.Lock()
	defer w.mu.Unlock()
	q := w.ready[lower]
	if len(q) == 0 {
		return nil
	}
	inst := q[0]
	w.ready[lower] = q[1:]
	return inst
}

// want records a launch of the root lower (a key) so the pool keeps it warm, evicting the
// least recently launched template beyond maxWarmTemplates. root describes it (lower dir,
// or layers and size).
func (w *warmPool) want(lower string, root createOpts) {
	if w.size == 0 {
		return
	}
	var evicted []*Instance
	w.mu.Lock()
	w.roots[lower] = root.rootOnly()
	d := w.demand[lower]
	if d == nil {
		d = &demand{}
		w.demand[lower] = d
	}
	d.launched(w.now())
	list := []string{lower}
	for _, l := range w.wanted {
		if l != lower {
			list = append(list, l)
		}
	}
	// Blank containers serve every template: they do not count as one.
	w.wanted = list[:0]
	templates := 0
	for _, l := range list {
		if l == blankKey || templates < maxWarmTemplates {
			w.wanted = append(w.wanted, l)
			if l != blankKey {
				templates++
			}
			continue
		}
		evicted = append(evicted, w.ready[l]...)
		delete(w.ready, l)
		delete(w.roots, l)
		delete(w.demand, l)
		delete(w.prefetch, l)
	}
	w.mu.Unlock()
	for _, inst := range evicted {
		go w.discard(inst)
	}
	w.kick()
}

func (w *warmPool) kick() {
	select {
	case w.wake <- struct{}{}:
	default:
	}
}

// start runs the filler (once; after Reconcile so it never races the sweep).
func (w *warmPool) start() {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.running || w.closed || w.size == 0 {
		return
	}
	w.running = true
	go w.loop()
	w.kick()
}

func (w *warmPool) loop() {
	defer close(w.exited)
	trim := time.NewTicker(warmTrimInterval)
	defer trim.Stop()
	for {
		select {
		case <-w.done:
			return
		case <-w.wake:
		case <-trim.C:
			for _, inst := range w.excess() {
				w.discard(inst)
			}
			continue
		}
		// A root whose container could not be made is retried at the next wake (a
		// launch); the others are filled meanwhile.
		failed := map[string]bool{}
		for {
			lower, wait := w.needed(failed)
			if wait > 0 {
				// No pool is empty: try again once launches paused, or at the next
				// launch (which may empty one).
				select {
				case <-w.done:
					return
				case <-w.wake:
				case <-time.After(wait):
				}
				continue
			}
			if lower == "" {
				break
			}
			done := make(chan struct{})
			w.mu.Lock()
			w.preparing, w.prepared = lower, done
			w.mu.Unlock()
			ok := w.fill(lower)
			w.mu.Lock()
			w.preparing, w.prepared = "", nil
			w.mu.Unlock()
			close(done)
			if !ok {
				failed[lower] = true
			}
		}
	}
}

// fill creates one warm container of lower and puts it in the pool, or discards it when
// lower is no longer wanted; false when it could not be created.
func (w *warmPool) fill(lower string) bool {
	inst, err := w.prepare(lower)
	if err != nil {
		w.b.log.Warn("oci: warm container", "template", lower, "err", err)
		return false
	}
	w.mu.Lock()
	keep := !w.closed && w.isWanted(lower)
	if keep {
		w.ready[lower] = append(w.ready[lower], inst)
	}
	w.mu.Unlock()
	if !keep {
		w.discard(inst)
	}
	return true
}

func (w *warmPool) isWanted(lower string) bool {
	for _, l := range w.wanted {
		if l == lower {
			return true
		}
	}
	return false
}

func (w *warmPool) prepare(lower string) (*Instance, error) {
	w.mu.Lock()
	o := w.roots[lower]
	w.mu.Unlock()
	if o.blank {
		if w.b.blankRoot == "" {
			return nil, errors.New("no blank root")
		}
	} else if len(o.layers) > 0 {
		for _, l := range withUpper(o.layers, o.upper) {
			if l.Path == "" {
				continue
			}
			if _, err := os.Stat(l.Path); err != nil {
				return nil, fmt.Errorf("template layer gone: %w", err)
			}
		}
	} else if fi, err := os.Stat(o.lower); err != nil || !fi.IsDir() {
		return nil, fmt.Errorf("template %s gone: %v", o.lower, err)
	}
	o.allowInternet, o.hostname = true, "sandbox"
	w.mu.Lock()
	w.seq++
	cid := fmt.Sprintf("warm.%d.%d", os.Getpid(), w.seq)
	w.mu.Unlock()
	inst := &Instance{b: w.b, cid: cid, l: w.b.layout(cid), started: time.Now()}
	if err := os.Mkdir(inst.l.dir, 0o711); err != nil {
		return nil, fmt.Errorf("oci: bundle dir: %w", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := w.b.create(ctx, inst, o); err != nil {
		return nil, errors.Join(err, inst.Stop(context.Background()))
	}
	if inst.isBlock() {
		// A block root's page cache starts empty (its own ext4 on its own loop device), so
		// what the first command reads is read now, off the launch path.
		t0 := time.Now()
		n, err := w.prefetchRoot(ctx, lower, inst.l.rootfs())
		if err != nil {
			w.b.log.Warn("oci: prefetch warm container root", "cid", cid, "err", err)
		}
		w.b.log.Debug("oci: prefetched warm container root", "cid", cid, "bytes", n, "took", time.Since(t0))
	}
	// The init (envd) starts now too, off the launch path: its start is a Go program's
	// (runtime and package init, ~25-30 ms of CPU here, most of it page faults) and
	// nothing in it depends on the sandbox it becomes; what does (environment, user,
	// token) comes with envd's /init after the launch, and the hostname, limits and
	// network policy startWarm sets apply to a running init as well.
	if err := w.b.rt.start(ctx, cid); err != nil {
		return nil, errors.Join(fmt.Errorf("oci: start warm container: %w", err), inst.Stop(context.Background()))
	}
	inst.running = true
	return inst, nil
}

// prefetchRoot reads the first command's files into the page cache of the root mounted
// at dir, a warm container's for key: resolved and read the first time (shell,
// libraries, profile scripts), then only queued for reading from the list that made.
func (w *warmPool) prefetchRoot(ctx context.Context, key, dir string) (int64, error) {
	w.mu.Lock()
	files, ok := w.prefetch[key]
	w.mu.Unlock()
	if ok {
		return rootfs.PrefetchFiles(ctx, dir, files, prefetchLimit)
	}
	n, files, err := rootfs.Prefetch(ctx, dir, firstCommandFiles, prefetchLimit)
	if err == nil {
		w.mu.Lock()
		if _, wanted := w.roots[key]; wanted {
			w.prefetch[key] = files
		}
		w.mu.Unlock()
	}
	return n, err
}

func (w *warmPool) discard(inst *Instance) {
	if err := inst.Stop(context.Background()); err != nil {
		w.b.log.Warn("oci: remove warm container", "cid", inst.cid, "err", err)
	}
}

// close stops the filler and removes every warm container.
func (w *warmPool) close(ctx context.Context) error {
	w.mu.Lock()
	if w.closed {
		w.mu.Unlock()
		return nil
	}
	w.closed = true
	running := w.running
	close(w.done)
	var all []*Instance
	for _, q := range w.ready {
		all = append(all, q...)
	}
	w.ready = map[string][]*Instance{}
	w.mu.Unlock()
	if running {
		<-w.exited
	}
	var errs []error
	for _, inst := range all {
		errs = append(errs, inst.Stop(ctx))
	}
	return errors.Join(errs...)
}

// startWarm turns warm container w into sandbox plan.SandboxID: its state, network policy,
// cgroup limits and hostname, then starts its init unless the pool already did.
func (b *Backend) startWarm(ctx context.Context, w *Instance, plan sandbox.LaunchPlan) error {
	pid, err := b.warmPID(w)
	if err != nil {
		return err
	}
	return b.claimWarm(ctx, w, pid, plan)
}

// warmPID returns the pid of warm container w's init, checking that a started one still
// runs.
func (b *Backend) warmPID(w *Instance) (int, error) {
	pid, err := readPid(w.l.pid())
	if err != nil {
		return 0, err
	}
	if w.running && !b.initAlive(w.cid, pid) {
		// Its envd ran unsupervised in the pool and died there (killed, or crashed): handed
		// out, the launch would only learn it when envd never answered.
		return 0, fmt.Errorf("%w: warm container %s", errInitGone, w.cid)
	}
	return pid, nil
}

// claimWarm gives warm container w (init pid) its sandbox's id, network policy, cgroup
// limits, hostname and saved state. The state is saved once the container is on its
// root and last: a node that restarts adopts only what is complete (one that stopped
// before finds a warm container and removes it, not a sandbox without its memory limit).
func (b *Backend) claimWarm(ctx context.Context, w *Instance, pid int, plan sandbox.LaunchPlan) error {
	w.id, w.res = plan.SandboxID, plan.Resources
	if !plan.AllowInternet {
		if err := b.pool.SetInternet(ctx, w.slot, false); err != nil {
			return err
		}
	}
	if err := setLimits(b.cgroupsPath(w.cid), b.v2, b.memsw, plan.Resources); err != nil {
		return err
	}
	if err := setHostname(pid, sandbox.Hostname(plan.SandboxID)); err != nil {
		return err
	}
	if err := b.saveState(w, plan.RootFS.LowerDir, w.isBlock(), plan.AllowInternet); err != nil {
		return err
	}
	if w.running {
		return nil
	}
	return b.rt.start(ctx, w.cid)
}

// readPid reads the pid file the runtime wrote for a created container.
func readPid(path string) (int, error) {
	raw, err := os.ReadFile(path)
	if err != nil {
		return 0, fmt.Errorf("oci: container pid: %w", err)
	}
	pid, err := strconv.Atoi(strings.TrimSpace(string(raw)))
	if err != nil {
		return 0, fmt.Errorf("oci: container pid %q: %w", raw, err)
	}
	return pid, nil
}

// initAlive reports whether the init of started container cid (pid, from its pid file)
// still runs: for runc, the process runc recorded, with its start time (as runc itself
// checks); for other runtimes, a process with that pid.
func (b *Backend) initAlive(cid string, pid int) bool {
	if b.rt.name != "runc" {
		return unix.Kill(pid, 0) == nil
	}
	st, err := readRuncState(filepath.Join(b.rt.root, cid, "state.json"))
	if err != nil || st.InitPid == nil || st.InitStart == nil || *st.InitPid != pid {
		return false
	}
	return alive("/proc", pid, *st.InitStart)
}

// setLimits writes a sandbox's cpu and memory limits into its (created) cgroup, the same
// values buildSpec would have put in config.json. Zero means unlimited, as there.
func setLimits(rel string, v2, memsw bool, res sandbox.Resources) error {
	write := func(path, v string) error {
		if err := os.WriteFile(path, []byte(v), 0o644); err != nil {
			return fmt.Errorf("oci: set limit %s: %w", path, err)
		}
		return nil
	}
	if v2 {
		dir := filepath.Join(cgroupRoot, rel)
		if res.CPUCount > 0 {
			if err := write(filepath.Join(dir, "cpu.max"), fmt.Sprintf("%d 100000", res.CPUCount*100000)); err != nil {
				return err
			}
		}
		if res.MemoryMB > 0 {
			return write(filepath.Join(dir, "memory.max"), strconv.FormatInt(int64(res.MemoryMB)<<20, 10))
		}
		return nil
	}
	if res.CPUCount > 0 {
		if err := write(filepath.Join(cgroupRoot, "cpu", rel, "cpu.cfs_period_us"), "100000"); err != nil {
			return err
		}
		if err := write(filepath.Join(cgroupRoot, "cpu", rel, "cpu.cfs_quota_us"), strconv.Itoa(res.CPUCount*100000)); err != nil {
			return err
		}
	}
	if res.MemoryMB > 0 {
		limit := strconv.FormatInt(int64(res.MemoryMB)<<20, 10)
		// The warm cgroup starts unlimited, so memory goes first, then memory+swap (which
		// may never be below memory).
		if err := write(filepath.Join(cgroupRoot, "memory", rel, "memory.limit_in_bytes"), limit); err != nil {
			return err
		}
		if memsw {
			return write(filepath.Join(cgroupRoot, "memory", rel, "memory.memsw.limit_in_bytes"), limit)
		}
	}
	return nil
}

// setHostname sets the hostname in the UTS namespace of pid from a thread that joins it
// for the call (UTS namespaces can be joined by one thread of a multithreaded process).
func setHostname(pid int, name string) error {
	runtime.LockOSThread()
	self, err := unix.Open("/proc/thread-self/ns/uts", unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		runtime.UnlockOSThread()
		return fmt.Errorf("oci: own uts namespace: %w", err)
	}
	defer unix.Close(self)
	target, err := unix.Open(fmt.Sprintf("/proc/%d/ns/uts", pid), unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		runtime.UnlockOSThread()
		return fmt.Errorf("oci: sandbox uts namespace: %w", err)
	}
	defer unix.Close(target)
	if err := unix.Setns(target, unix.CLONE_NEWUTS); err != nil {
		runtime.UnlockOSThread()
		return fmt.Errorf("oci: join uts namespace: %w", err)
	}
	herr := unix.Sethostname([]byte(name))
	if err := unix.Setns(self, unix.CLONE_NEWUTS); err != nil {
		// Leave the thread locked: Go discards it rather than reuse it in the wrong namespace.
		return fmt.Errorf("oci: restore uts namespace: %w", err)
	}
	runtime.UnlockOSThread()
	if herr != nil {
		return fmt.Errorf("oci: set hostname: %w", herr)
	}
	return nil
}
