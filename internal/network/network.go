// Package network gives every sandbox its own network namespace: a veth pair into a host
// bridge, a private address, a default route through the bridge, outbound NAT when the
// sandbox may use the internet, and isolation (sandboxes cannot reach each other or any
// service of the host; the host can still connect into them, which is how the node reaches
// envd). Slots are prepared ahead of time in a warm pool so a create does not pay for
// namespace setup, and are named deterministically so a restart can sweep what a crash left.
package network

import (
	"bytes"
	"context"
	"crypto/sha256"
	"crypto/x509"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/vishvananda/netlink"
	"golang.org/x/sync/errgroup"

	"github.com/aenv-dev/aenv/internal/egressproxy"
	"github.com/aenv-dev/aenv/internal/steptime"
)

// ErrExhausted means every address of the subnet is allocated.
var ErrExhausted = errors.New("network: no free sandbox address")

// ErrClosed means the pool was closed.
var ErrClosed = errors.New("network: pool closed")

// Config configures a Pool. Zero values take the defaults shown.
type Config struct {
	// Bridge is the host bridge name; also the name of the nftables tables. Default "aenv0".
	Bridge string
	// Subnet is the IPv4 subnet for sandboxes; the first host address is the bridge's.
	// Default "10.88.0.0/16".
	Subnet string
	// Prefix names slots: netns "<Prefix>-<n>", host veth "<Prefix>h<n>". At most 8
	// characters so interface names fit in 15. Default "aenv".
	Prefix string
	// PoolSize is how many prepared slots are kept ready. Default 4; negative disables.
	PoolSize int
	// MTU of the bridge and veths. Default 1500.
	MTU int
	// BridgePorts is how many slots share one bridge (shard.go). Default and most
	// maxBridgePorts; tests set fewer to reach the extra bridges with a few slots.
	BridgePorts int
	// AllowRanges are IPv4 ranges inside DefaultDenyRanges that sandboxes may reach (the
	// node operator's exceptions, e.g. an internal package mirror). Default none.
	AllowRanges []netip.Prefix
	// DNS are the nameservers sandboxes are given: reachable on port 53 even inside the
	// denied ranges.
	DNS []netip.Addr
	// EgressCA lets the egress proxy terminate TLS to domains that have network.rules
	// (egressproxy.Config.CA), EgressUpstreamRoots verify their servers (nil: the
	// system roots).
	EgressCA            *egressproxy.CA
	EgressUpstreamRoots *x509.CertPool
	Logger              *slog.Logger
}

func (c *Config) defaults() error {
	if c.Bridge == "" {
		c.Bridge = "aenv0"
	}
	if c.Subnet == "" {
		c.Subnet = "10.88.0.0/16"
	}
	if c.Prefix == "" {
		c.Prefix = "aenv"
	}
	if c.PoolSize == 0 {
		c.PoolSize = 4
	}
	if c.PoolSize < 0 {
		c.PoolSize = 0
	}
	if c.MTU == 0 {
		c.MTU = 1500
	}
	if c.BridgePorts <= 0 || c.BridgePorts > maxBridgePorts {
		c.BridgePorts = maxBridgePorts
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	if len(c.Bridge) > 15 || !validName(c.Bridge) {
		return fmt.Errorf("network: bad bridge name %q (1-15 of [a-z0-9_-])", c.Bridge)
	}
	if len(c.Prefix) > 8 || !validName(c.Prefix) {
		return fmt.Errorf("network: bad slot prefix %q (1-8 of [a-z0-9_-])", c.Prefix)
	}
	return c.checkInfra()
}

func validName(s string) bool {
	if s == "" {
		return false
	}
	for _, r := range s {
		if !(r >= 'a' && r <= 'z' || r >= '0' && r <= '9' || r == '_' || r == '-') {
			return false
		}
	}
	return true
}

// Slot is one prepared network namespace.
type Slot struct {
	Index int
	// Netns is the namespace's name; NetnsPath its bind-mount (give this to the runtime).
	Netns     string
	NetnsPath string
	// HostVeth is the host end of the veth pair; the sandbox end is "eth0".
	HostVeth string
	// Bridge is the host bridge HostVeth is a port of (shard.go).
	Bridge string
	// IP is the sandbox's address; Gateway the bridge's.
	IP      netip.Addr
	Gateway netip.Addr
	// PrefixLen of the subnet, for the sandbox's eth0 address.
	PrefixLen int
	// AllowInternet is whether outbound NAT is allowed for this slot.
	AllowInternet bool
	// egress is what the slot has in the egress sets (egress.go).
	egress egressState
}

// Pool hands out slots. It is safe for concurrent use.
type Pool struct {
	cfg     Config
	subnet  netip.Prefix
	gateway netip.Addr
	max     int // highest usable index + 1

	mu       sync.Mutex
	used     map[int]bool // ready, in use, or reserved until Reconcile
	reserved map[int]bool // found at New, fate decided by Reconcile
	ready    []*Slot
	closed   bool
	wake     chan struct{}
	done     chan struct{}
	fillerOn bool
	// Released slots whose veth is not gone yet, by index (reclaim.go).
	reclaiming  map[int]bool
	reclaims    sync.WaitGroup
	reclaimWait time.Duration // tests shorten it

	// carried is what the slots an earlier run left held in the sets, put back when the
	// tables were re-created; Reconcile settles it (carry.go).
	carried map[netip.Addr]*carriedSlot

	shardMu sync.Mutex
	shards  map[string]bool // extra bridges made or checked by this process (shard.go)

	// The egress proxy (proxied.go), listening on the bridge address.
	proxy     *egressproxy.Proxy
	proxyLn   net.Listener
	proxyPort int
	// tablesKept: New found the tables already as it would install them (tables.go).
	tablesKept bool

	// v6Conf is the host's /proc/sys/net/ipv6/conf directory, -1 when it has none
	// (noHostIPv6); set on first use (v6Once) and kept for the process's life.
	v6Once sync.Once
	v6Conf int
}

// New creates (or adopts) the bridge and nftables rules. Slots found from an earlier run
// are reserved until Reconcile says which to keep; the warm pool starts filling after
// Reconcile or at the first Acquire.
func New(ctx context.Context, cfg Config) (*Pool, error) {
	if err := cfg.defaults(); err != nil {
		return nil, err
	}
	subnet, err := netip.ParsePrefix(cfg.Subnet)
	if err != nil || !subnet.Addr().Is4() {
		return nil, fmt.Errorf("network: bad IPv4 subnet %q: %v", cfg.Subnet, err)
	}
	subnet = subnet.Masked()
	if subnet.Bits() > 29 || subnet.Bits() < 8 {
		return nil, fmt.Errorf("network: subnet %s must be between /8 and /29", subnet)
	}
	size := 1 << (32 - subnet.Bits())
	max := size - 3 // network, gateway, broadcast
	if max > 1<<16 {
		max = 1 << 16 // interface names hold 5 digits
	}
	p := &Pool{
		cfg: cfg, subnet: subnet, gateway: subnet.Addr().Next(), max: max,
		used: map[int]bool{}, reserved: map[int]bool{}, reclaiming: map[int]bool{}, reclaimWait: defaultReclaimWait,
		shards: map[string]bool{},
		wake:   make(chan struct{}, 1), done: make(chan struct{}),
	}
	laps := steptime.Start()
	if err := prepareNetnsDir(netnsDir); errors.Is(err, errNetnsDirBusy) {
		cfg.Logger.Warn("network: an `ip netns add` on this host would hide the sandboxes' namespaces", "err", err)
	} else if err != nil {
		return nil, err
	}
	if err := p.ensureBridgeNamed(p.cfg.Bridge, subnet.Bits()); err != nil {
		return nil, err
	}
	// One listing of the host's links (hundreds with as many sandboxes) for the slots an
	// earlier run left and for the extra bridges the rules name.
	laps.Lap("bridge")
	links, _ := netlink.LinkList()
	existing := p.existingIndexesIn(links)
	laps.Lap("links")
	ips := make(map[netip.Addr]bool, len(existing))
	for _, i := range existing {
		ips[p.slotFor(i).IP] = true
	}
	carried, keep, err := p.openTables(ctx, ips, links)
	if err != nil {
		return nil, err
	}
	p.carried, p.tablesKept = carried, keep
	laps.Lap("tables")
	p.cfg.Logger.Info("network: nftables", append([]any{"kept", keep, "carried_sources", len(carried), "egress_proxy_port", p.proxyPort},
		laps.Attrs()...)...)
	for _, i := range existing {
		p.used[i] = true
		p.reserved[i] = true
	}
	return p, nil
}

// Gateway is the bridge's address: the host as seen from a sandbox.
func (p *Pool) Gateway() netip.Addr { return p.gateway }

// Subnet is the sandbox subnet.
func (p *Pool) Subnet() netip.Prefix { return p.subnet }

func (p *Pool) slotFor(i int) *Slot {
	ip := p.subnet.Addr()
	for k := 0; k < i+2; k++ {
		ip = ip.Next()
	}
	return &Slot{
		Index:     i,
		Netns:     p.cfg.Prefix + "-" + strconv.Itoa(i),
		NetnsPath: "/run/netns/" + p.cfg.Prefix + "-" + strconv.Itoa(i),
		HostVeth:  p.cfg.Prefix + "h" + strconv.Itoa(i),
		Bridge:    p.bridgeFor(i),
		IP:        ip, Gateway: p.gateway, PrefixLen: p.subnet.Bits(),
		AllowInternet: true,
	}
}

// ensureBridgeNamed creates (or adopts) bridge name, pins its MAC, gives it the gateway
// address with prefix length bits and brings it up.
func (p *Pool) ensureBridgeNamed(name string, bits int) error {
	l, err := netlink.LinkByName(name)
	if err != nil {
		var nf netlink.LinkNotFoundError
		if !errors.As(err, &nf) {
			return fmt.Errorf("network: look up bridge: %w", err)
		}
		br := &netlink.Bridge{LinkAttrs: netlink.LinkAttrs{Name: name, MTU: p.cfg.MTU}}
		if err := netlink.LinkAdd(br); err != nil && !errors.Is(err, os.ErrExist) {
			return fmt.Errorf("network: create bridge %s: %w", name, err)
		}
		if l, err = netlink.LinkByName(name); err != nil {
			return fmt.Errorf("network: bridge %s: %w", name, err)
		}
	}
	if l.Type() != "bridge" {
		return fmt.Errorf("network: %s exists and is a %s, not a bridge", name, l.Type())
	}
	// No multicast snooping: it keeps per-port state and timers that every port's
	// arrival and departure walk (~0.5 ms of a create and a kill at 1 000 ports), for
	// nothing here: no querier runs, so unregistered multicast is flooded either way, and
	// from isolated ports only to the host.
	// (Only the one attribute: a request carrying all of the bridge's, as read, is
	// refused with EOPNOTSUPP. Not through /sys/class/net, which shows the namespace
	// that mounted /sys, not necessarily the node's.)
	if b, ok := l.(*netlink.Bridge); !ok || b.MulticastSnooping == nil || *b.MulticastSnooping {
		only := &netlink.Bridge{LinkAttrs: netlink.LinkAttrs{Name: name, Index: l.Attrs().Index}}
		if err := netlink.BridgeSetMcastSnoop(only, false); err != nil {
			return fmt.Errorf("network: multicast snooping off on %s: %w", name, err)
		}
	}
	// Pin the bridge's MAC. Unpinned, a Linux bridge takes the lowest MAC of its ports, so
	// it changes as sandboxes' veths come and go; every change flushes the bridge's
	// neighbour table (the permanent entries of every sandbox included) and leaves the
	// sandboxes' ARP caches pointing the gateway at a MAC nobody answers to: their replies
	// to the host are flooded and dropped until ARP recovers, seconds of stall (the
	// multi-second p99 of concurrent creates). Setting the address, even to its current
	// value, makes the kernel keep it.
	if mac := bridgeMAC(l.Attrs().HardwareAddr, name); !bytes.Equal(mac, l.Attrs().HardwareAddr) || !macPinned(name) {
		if err := netlink.LinkSetHardwareAddr(l, mac); err != nil {
			return fmt.Errorf("network: pin the MAC of %s to %s: %w", name, mac, err)
		}
	}
	addr := &netlink.Addr{IPNet: &net.IPNet{IP: p.gateway.AsSlice(), Mask: net.CIDRMask(bits, 32)}}
	if err := netlink.AddrReplace(l, addr); err != nil {
		return fmt.Errorf("network: address on %s: %w", name, err)
	}
	if err := netlink.LinkSetUp(l); err != nil {
		return fmt.Errorf("network: bring up %s: %w", name, err)
	}
	return nil
}

// bridgeMAC is the MAC to pin the bridge to: its current one when that is a unicast
// address (a bridge without ports has none: all zeros), else a locally administered one
// derived from its name, the same at every start.
func bridgeMAC(cur net.HardwareAddr, name string) net.HardwareAddr {
	if len(cur) == 6 && cur[0]&1 == 0 && !bytes.Equal(cur, make([]byte, 6)) {
		return cur
	}
	sum := sha256.Sum256([]byte("aenv bridge " + name))
	mac := net.HardwareAddr(sum[:6])
	mac[0] = mac[0]&^1 | 2 // unicast, locally administered
	return mac
}

// sysfsIs reports whether the sysfs file path reads want.
func sysfsIs(path, want string) bool {
	raw, err := os.ReadFile(path)
	return err == nil && strings.TrimSpace(string(raw)) == want
}

// macPinned reports whether the kernel keeps the bridge's MAC (it was set, not taken
// from a port: addr_assign_type NET_ADDR_SET).
func macPinned(name string) bool {
	return sysfsIs("/sys/class/net/"+name+"/addr_assign_type", "3")
}

// existingIndexes finds slots of this prefix left by an earlier run (netns or host veth).
func (p *Pool) existingIndexes() []int {
	links, _ := netlink.LinkList()
	return p.existingIndexesIn(links)
}

// existingIndexesIn is existingIndexes with the host's links already listed.
func (p *Pool) existingIndexesIn(links []netlink.Link) []int {
	seen := map[int]bool{}
	if ents, err := os.ReadDir("/run/netns"); err == nil {
		for _, e := range ents {
			if i, ok := p.parseIndex(e.Name(), p.cfg.Prefix+"-"); ok {
				seen[i] = true
			}
		}
	}
	for _, l := range links {
		if i, ok := p.parseIndex(l.Attrs().Name, p.cfg.Prefix+"h"); ok {
			seen[i] = true
		}
	}
	out := make([]int, 0, len(seen))
	for i := range seen {
		out = append(out, i)
	}
	sort.Ints(out)
	return out
}

func (p *Pool) parseIndex(name, prefix string) (int, bool) {
	rest, ok := strings.CutPrefix(name, prefix)
	if !ok || rest == "" {
		return 0, false
	}
	i, err := strconv.Atoi(rest)
	if err != nil || i < 0 || strconv.Itoa(i) != rest {
		return 0, false
	}
	return i, true
}

// Reconcile keeps the slots whose indexes are in keep (with their internet setting) and
// removes every other slot of this prefix left by an earlier run. It returns the kept slots
// and starts the warm pool.
func (p *Pool) Reconcile(ctx context.Context, keep map[int]bool) (map[int]*Slot, error) {
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return nil, ErrClosed
	}
	reserved := p.reserved
	p.reserved = map[int]bool{}
	carried := p.carried
	p.carried = nil
	p.mu.Unlock()

	kept := map[int]*Slot{}
	var errs []error
	// Anything of our prefix on the host that this run neither reserved nor handed out
	// (ready or in use) is debris too.
	p.mu.Lock()
	for _, i := range p.existingIndexes() {
		if !p.used[i] {
			reserved[i] = true
		}
	}
	p.mu.Unlock()
	var gone []int
	for i := range reserved {
		if allow, ok := keep[i]; ok {
			s := p.slotFor(i)
			s.AllowInternet = allow
			kept[i] = s
			p.mu.Lock()
			p.used[i] = true
			p.mu.Unlock()
			continue
		}
		gone = append(gone, i)
	}
	// Side by side: deleting a veth and a namespace is mostly the kernel waiting (RCU),
	// and a restart finds the previous run's warm slots besides the dead sandboxes'.
	var mu sync.Mutex
	var g errgroup.Group
	g.SetLimit(8)
	for _, i := range gone {
		g.Go(func() error {
			err := p.destroy(p.slotFor(i))
			mu.Lock()
			errs = append(errs, err)
			mu.Unlock()
			p.mu.Lock()
			delete(p.used, i)
			p.mu.Unlock()
			return nil
		})
	}
	_ = g.Wait()
	// One nft run for all kept slots, and none when the sets already hold what they need.
	if err := p.settleCarried(ctx, carried, kept); err != nil {
		errs = append(errs, err)
	}
	p.startFiller()
	return kept, errors.Join(errs...)
}

// Acquire returns a prepared slot (from the warm pool when one is ready).
func (p *Pool) Acquire(ctx context.Context, allowInternet bool) (*Slot, error) {
	p.startFiller()
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return nil, ErrClosed
	}
	var s *Slot
	if n := len(p.ready); n > 0 {
		s = p.ready[n-1]
		p.ready = p.ready[:n-1]
	}
	p.mu.Unlock()
	p.kick()
	if s == nil {
		var err error
		if s, err = p.prepare(); err != nil {
			return nil, err
		}
	}
	if !allowInternet {
		if err := p.setInternet(ctx, s, false); err != nil {
			_ = p.Release(ctx, s)
			return nil, err
		}
	}
	s.AllowInternet = allowInternet
	return s, nil
}

// SetInternet switches outbound NAT for a slot handed out by Acquire.
func (p *Pool) SetInternet(ctx context.Context, s *Slot, allow bool) error {
	if s.AllowInternet == allow {
		return nil
	}
	if err := p.setInternet(ctx, s, allow); err != nil {
		return err
	}
	s.AllowInternet = allow
	return nil
}

// Release destroys a slot handed out by Acquire or Reconcile. Idempotent.
func (p *Pool) Release(ctx context.Context, s *Slot) error {
	if s == nil {
		return nil
	}
	var errs []error
	if !s.AllowInternet {
		errs = append(errs, p.setInternet(ctx, s, true))
	}
	errs = append(errs, p.clearEgress(ctx, s))
	free, err := p.release(s)
	errs = append(errs, err)
	if free {
		p.mu.Lock()
		delete(p.used, s.Index)
		p.mu.Unlock()
		p.kick()
	}
	return errors.Join(errs...)
}

// prepare allocates an index and builds its namespace.
func (p *Pool) prepare() (*Slot, error) {
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return nil, ErrClosed
	}
	idx := -1
	for i := 0; i < p.max; i++ {
		if !p.used[i] {
			idx = i
			break
		}
	}
	if idx < 0 {
		p.mu.Unlock()
		return nil, ErrExhausted
	}
	p.used[idx] = true
	p.mu.Unlock()
	s := p.slotFor(idx)
	if err := p.create(s); err != nil {
		_ = p.destroy(s)
		p.mu.Lock()
		delete(p.used, idx)
		p.mu.Unlock()
		return nil, err
	}
	return s, nil
}

func (p *Pool) kick() {
	select {
	case p.wake <- struct{}{}:
	default:
	}
}

func (p *Pool) startFiller() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.fillerOn || p.closed || p.cfg.PoolSize == 0 {
		return
	}
	p.fillerOn = true
	go p.fill()
	p.kick()
}

// fill keeps PoolSize slots ready in the background.
func (p *Pool) fill() {
	for {
		select {
		case <-p.done:
			return
		case <-p.wake:
		}
		for {
			p.mu.Lock()
			need := !p.closed && len(p.ready) < p.cfg.PoolSize
			p.mu.Unlock()
			if !need {
				break
			}
			s, err := p.prepare()
			if err != nil {
				if !errors.Is(err, ErrClosed) {
					p.cfg.Logger.Warn("network: warm slot", "err", err)
				}
				break
			}
			p.mu.Lock()
			if p.closed {
				p.mu.Unlock()
				_ = p.destroy(s)
				return
			}
			p.ready = append(p.ready, s)
			p.mu.Unlock()
		}
	}
}

// Close stops the warm pool and destroys the ready (never handed out) slots. Slots in use
// stay; the bridge and rules stay for them. Use Teardown to remove everything.
func (p *Pool) Close(ctx context.Context) error {
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return nil
	}
	p.closed = true
	close(p.done)
	ready := p.ready
	p.ready = nil
	p.mu.Unlock()
	p.stopEgressProxy()
	p.reclaims.Wait() // with done closed, each deletes its veth now
	var errs []error
	for _, s := range ready {
		errs = append(errs, p.destroy(s))
		p.mu.Lock()
		delete(p.used, s.Index)
		p.mu.Unlock()
	}
	return errors.Join(errs...)
}

// Teardown closes the pool and removes every slot of its prefix, its nftables tables and
// its bridge. For tests and uninstall; a node restart should use Reconcile instead.
func (p *Pool) Teardown(ctx context.Context) error {
	errs := []error{p.Close(ctx)}
	for _, i := range p.existingIndexes() {
		errs = append(errs, p.destroy(p.slotFor(i)))
	}
	errs = append(errs, p.removeRules(ctx), p.removeShards())
	if l, err := netlink.LinkByName(p.cfg.Bridge); err == nil {
		errs = append(errs, netlink.LinkDel(l))
	}
	return errors.Join(errs...)
}
