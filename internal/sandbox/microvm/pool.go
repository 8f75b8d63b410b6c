package microvm

import (
	"context"
	"errors"
	"fmt"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/aenv-dev/aenv/internal/sandbox"
)

// The snapshot pool keeps, per snapshot (from the moment it is taken, or the first
// create from it on a node that did not take it), a few VMs already restored from its
// memory image: QEMU started, the stream loaded on a private mapping of the RAM file, the network
// slot and root disk attached, the guest run until envd answered and ran a first command
// (which fills TCG's translation cache for those paths) and then stopped. A create
// from that snapshot takes one and continues it: what costs 150 ms to seconds under TCG
// (QEMU's start, the stream's load, the translation of the guest's first answer) is paid
// in the background before the request. The orchestrator then does what it does after
// every restore (envd /init: token, environment, clock), so a pooled VM carries no
// sandbox's identity until it is handed out.
//
// A pooled VM runs in a directory of its own (sandboxes/pool-<capture>-<n>) and keeps it
// when handed out: its QEMU's command line names that directory, so the directory cannot
// be renamed. Its state file then records the sandbox's id, which is how a restart adopts
// it (Reconcile); a pooled VM that was never handed out is unknown to the orchestrator and
// removed in full, like any VM a crash left.
//
// Fork children do not use it: a fork's capture is new each time.

// poolIDPrefix starts the directory name of every pooled VM.
const poolIDPrefix = "pool-"

// poolQuiet is how long the filler waits after a launch: a VM launched from the pool or
// restored takes its first requests then (envd /init, a command), and a fill competing
// for the CPU would slow exactly the latency the pool is for.
const poolQuiet = time.Second

// poolIdleTTL: a snapshot no sandbox was created from for this long loses its pooled VMs
// (a capture restored once, such as a paused sandbox resumed on another node, would
// otherwise hold them for ever).
const poolIdleTTL = 10 * time.Minute

// poolWarmTimeout bounds a pooled VM's warm-up (envd's first answer).
const poolWarmTimeout = 60 * time.Second

type vmPool struct {
	b    *Backend
	size int // VMs kept per snapshot
	max  int // VMs kept in all

	mu     sync.Mutex
	snaps  map[string]*snapPool // by capture id
	closed bool

	seq  atomic.Int64
	busy atomic.Int64 // launches in flight; the filler waits for none
	// warmed counts the pooled VMs whose warm-up ran every step (logs and tests).
	warmed atomic.Int64
	// lastReq is when the last launch ended (UnixNano): the filler waits poolQuiet
	// after it, while the launched guest takes its first requests.
	lastReq  atomic.Int64
	kick     chan struct{}
	stop     chan struct{}
	stopOnce sync.Once
	done     chan struct{}
}

// snapPool is one snapshot's pooled VMs.
type snapPool struct {
	c       *capture
	ready   []*Instance
	filling int
	used    time.Time // last hand-out or request
	// token is the access token the snapshot's envd holds, which the warm-up needs:
	// the snapshotted sandbox's (Instance.envdToken) or a launch's LaunchPlan.HeldEnvdToken.
	token string
}

func newVMPool(b *Backend, size, max int) *vmPool {
	p := &vmPool{b: b, size: size, max: max, snaps: map[string]*snapPool{},
		kick: make(chan struct{}, 1), stop: make(chan struct{}), done: make(chan struct{})}
	if size <= 0 {
		close(p.done)
		return p
	}
	go p.fillLoop()
	return p
}

func (p *vmPool) enabled() bool { return p != nil && p.size > 0 }

// request marks a launch in flight until the returned function is called: the filler
// does not start a VM meanwhile, so pool refills never compete with requests.
func (p *vmPool) request() func() {
	if p == nil {
		return func() {}
	}
	p.busy.Add(1)
	return func() {
		p.lastReq.Store(time.Now().UnixNano())
		p.busy.Add(-1)
		p.poke()
	}
}

func (p *vmPool) poke() {
	select {
	case p.kick <- struct{}{}:
	default:
	}
}

// prime starts the pool of a snapshot just taken, so that even the first create from it
// finds a VM ready.
func (p *vmPool) prime(c *capture) {
	if !p.enabled() || c.Memory == nil || c.Memory.RAM == nil {
		return
	}
	p.mu.Lock()
	if p.snaps[c.ID] == nil && !p.closed {
		p.snaps[c.ID] = &snapPool{c: c, used: time.Now(), token: c.envdToken}
	}
	p.mu.Unlock()
	p.poke()
}

// poolable reports whether launches from c can come from the pool: a snapshot's memory
// image with a RAM file (mapped private), not a fork's transient one.
func (b *Backend) poolable(plan sandbox.LaunchPlan, c *capture) bool {
	return b.vmpool.enabled() && plan.Kind == sandbox.LaunchFromSnapshot && !plan.ColdBoot &&
		c.Memory != nil && c.Memory.RAM != nil && !within(c.Memory.Dir, b.cfg.imagesDir())
}

// take hands out a pooled VM of c as sandbox plan.SandboxID, continued, or returns nil
// when the pool has none (the caller restores as usual). Either way the snapshot's pool
// is (re)filled in the background.
func (p *vmPool) take(ctx context.Context, plan sandbox.LaunchPlan, c *capture) *Instance {
	p.mu.Lock()
	sp := p.snaps[c.ID]
	if sp == nil && !p.closed {
		sp = &snapPool{c: c, token: c.envdToken}
		p.snaps[c.ID] = sp
	}
	var inst *Instance
	if sp != nil {
		sp.used = time.Now()
		if plan.HeldEnvdToken != "" {
			sp.token = plan.HeldEnvdToken
		}
		if n := len(sp.ready); n > 0 {
			inst, sp.ready = sp.ready[n-1], sp.ready[:n-1]
		}
	}
	p.mu.Unlock()
	p.poke()
	if inst == nil {
		return nil
	}
	if err := p.handOut(ctx, inst, plan); err != nil {
		p.b.log.Warn("microvm: pooled VM could not be handed out; restoring instead", "vm", inst.dir, "err", err)
		p.discard(inst)
		return nil
	}
	return inst
}

// handOut makes pooled VM inst sandbox plan.SandboxID and continues its guest.
func (p *vmPool) handOut(ctx context.Context, inst *Instance, plan sandbox.LaunchPlan) error {
	b := p.b
	inst.mu.Lock()
	proc, slot := inst.proc, inst.slot
	inst.mu.Unlock()
	if proc == nil || proc.exited() || slot == nil {
		return errors.New("its QEMU is gone")
	}
	b.mu.Lock()
	if _, ok := b.instances[plan.SandboxID]; ok {
		b.mu.Unlock()
		return fmt.Errorf("%w: %s", ErrExists, plan.SandboxID)
	}
	delete(b.instances, inst.id)
	inst.mu.Lock()
	inst.id, inst.started = plan.SandboxID, time.Now()
	inst.mu.Unlock()
	b.instances[plan.SandboxID] = inst
	b.mu.Unlock()
	if err := b.pool.SetInternet(ctx, slot, plan.AllowInternet); err != nil {
		return err
	}
	// From here a restart adopts the VM as this sandbox (or removes it, when the
	// orchestrator never recorded the sandbox).
	if err := inst.saveState(); err != nil {
		return err
	}
	if err := proc.m.Resume(ctx); err != nil {
		return fmt.Errorf("microvm: continue pooled VM: %w", err)
	}
	return nil
}

// discard stops a pooled VM (one that is no longer wanted, or failed).
func (p *vmPool) discard(inst *Instance) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := inst.Stop(ctx); err != nil {
		p.b.log.Warn("microvm: stop pooled VM", "vm", inst.dir, "err", err)
	}
}

// drain stops the pooled VMs of capture id and fills no more for it (its snapshot is
// discarded). A fill in flight stops its VM when done.
func (p *vmPool) drain(id string) {
	if p == nil {
		return
	}
	p.mu.Lock()
	sp := p.snaps[id]
	delete(p.snaps, id)
	p.mu.Unlock()
	if sp == nil {
		return
	}
	for _, inst := range sp.ready {
		p.discard(inst)
	}
}

// close stops the filler and every pooled VM that was not handed out.
func (p *vmPool) close() {
	if p == nil {
		return
	}
	p.mu.Lock()
	p.closed = true
	snaps := p.snaps
	p.snaps = map[string]*snapPool{}
	p.mu.Unlock()
	p.halt()
	for _, sp := range snaps {
		for _, inst := range sp.ready {
			p.discard(inst)
		}
	}
}

// expire drains the pools of snapshots unused for poolIdleTTL.
func (p *vmPool) expire() {
	p.mu.Lock()
	var old []string
	for id, sp := range p.snaps {
		if time.Since(sp.used) > poolIdleTTL {
			old = append(old, id)
		}
	}
	p.mu.Unlock()
	for _, id := range old {
		p.b.log.Debug("microvm: pool: snapshot unused; stopping its VMs", "capture", id)
		p.drain(id)
	}
}

// halt stops the filler and waits for it (a fill in progress ends first).
func (p *vmPool) halt() {
	p.stopOnce.Do(func() { close(p.stop) })
	<-p.done
}

// fillLoop fills one VM at a time, for the most recently used snapshot that lacks one,
// while no launch is in flight.
func (p *vmPool) fillLoop() {
	defer close(p.done)
	for {
		select {
		case <-p.stop:
			return
		case <-p.kick:
		case <-time.After(time.Second):
		}
		p.expire()
		for p.idle() {
			sp := p.next()
			if sp == nil {
				break
			}
			p.fill(sp)
			select {
			case <-p.stop:
				return
			default:
			}
		}
	}
}

// idle reports whether the filler may start a VM now: no launch in flight or just done.
func (p *vmPool) idle() bool {
	if p.busy.Load() > 0 {
		return false
	}
	if wait := poolQuiet - time.Since(time.Unix(0, p.lastReq.Load())); wait > 0 {
		time.AfterFunc(wait, p.poke)
		return false
	}
	return true
}

// next picks the snapshot to fill a VM for and counts the fill, or nil.
func (p *vmPool) next() *snapPool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return nil
	}
	total := 0
	var want []*snapPool
	for _, sp := range p.snaps {
		total += len(sp.ready) + sp.filling
		if len(sp.ready)+sp.filling < p.size {
			want = append(want, sp)
		}
	}
	if len(want) == 0 || total >= p.max {
		return nil
	}
	slices.SortFunc(want, func(a, b *snapPool) int { return b.used.Compare(a.used) })
	want[0].filling++
	return want[0]
}

// fill restores one VM of sp's snapshot, warms it and adds it to sp stopped.
func (p *vmPool) fill(sp *snapPool) {
	t0 := time.Now()
	p.mu.Lock()
	token := sp.token
	p.mu.Unlock()
	inst, err := p.restoreStopped(sp.c, token)
	p.mu.Lock()
	sp.filling--
	keep := err == nil && !p.closed && p.snaps[sp.c.ID] == sp
	if keep {
		sp.ready = append(sp.ready, inst)
	}
	p.mu.Unlock()
	if err != nil {
		p.b.log.Warn("microvm: pool: restore failed", "capture", sp.c.ID, "err", err)
		// Do not spin on a snapshot that cannot be restored.
		p.mu.Lock()
		if p.snaps[sp.c.ID] == sp {
			delete(p.snaps, sp.c.ID)
		}
		p.mu.Unlock()
		return
	}
	if !keep {
		p.discard(inst)
		return
	}
	p.b.log.Debug("microvm: pool: VM ready", "capture", sp.c.ID, "vm", inst.id, "took", time.Since(t0))
}

// restoreStopped restores a VM of c under a pool id, runs it through the warm-up (envd
// holds token) and stops it. On error nothing is left.
func (p *vmPool) restoreStopped(c *capture, token string) (*Instance, error) {
	b := p.b
	ctx, cancel := context.WithTimeout(context.Background(), 2*poolWarmTimeout)
	defer cancel()
	id := fmt.Sprintf("%s%.8s-%d", poolIDPrefix, c.ID, p.seq.Add(1))
	inst, err := b.reserve(id, c.Resources)
	if err != nil {
		return nil, err
	}
	if err := os.Mkdir(inst.dir, 0o700); err != nil {
		b.forget(inst)
		return nil, fmt.Errorf("microvm: %w", err)
	}
	err = b.restore(ctx, inst, c, false, true)
	if err == nil {
		err = warm(ctx, inst, token)
	}
	if err == nil {
		err = inst.proc.m.Pause(ctx)
	}
	if err != nil {
		if serr := inst.Stop(context.WithoutCancel(ctx)); serr != nil {
			b.log.Warn("microvm: pool: cleanup", "vm", id, "err", serr)
		}
		return nil, err
	}
	return inst, nil
}

// pooledDir reports whether a sandbox directory name is a pooled VM's.
func pooledDir(name string) bool { return strings.HasPrefix(name, poolIDPrefix) }
