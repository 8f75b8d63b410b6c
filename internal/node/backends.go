package node

import (
	"context"
	"crypto/x509"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"net/netip"
	"slices"
	"strings"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/aenv-dev/aenv/internal/config"
	"github.com/aenv-dev/aenv/internal/dataplane"
	"github.com/aenv-dev/aenv/internal/egressproxy"
	"github.com/aenv-dev/aenv/internal/network"
	"github.com/aenv-dev/aenv/internal/sandbox"
	"github.com/aenv-dev/aenv/internal/sandbox/microvm"
	"github.com/aenv-dev/aenv/internal/sandbox/oci"
	"github.com/aenv-dev/aenv/internal/storage/stack"
)

// Backend is a sandbox backend as the node holds it: the sandbox contract plus Close.
type Backend interface {
	sandbox.Backend
	// Close releases what the backend holds besides its sandboxes (warm instances,
	// network pool, helper processes). It runs at node shutdown, after the orchestrator
	// stopped or left the sandboxes as the shutdown action says.
	Close(ctx context.Context) error
}

// BackendEnv is what a factory gets from the node: its configuration and the node's
// services a backend may use.
type BackendEnv struct {
	// Config is the whole node configuration (backend.*, network.*, snapshot.quiesce).
	Config config.Config
	// DataDir is the backend's own state directory, <data_dir>/<kind>; it may not exist.
	DataDir string
	// EnvdPath is the envd binary (absolute, executable) every sandbox runs as its init.
	EnvdPath string
	// Layers opens sealed layers that are known by digest only, lazily from the
	// repository through the node's block cache.
	Layers stack.Resolver
	// Registerer takes the backend's metrics (the node's /metrics).
	Registerer prometheus.Registerer
	// Logger is tagged with component=<kind>.
	Logger *slog.Logger
	// DataPlane serves layered root disks from the data-plane process, which outlives the
	// node (backend.data_plane); nil: the backend serves them itself.
	DataPlane *dataplane.Client
	// EgressCA is the node's egress CA (<data_dir>/egress), EgressUpstreamRoots what its
	// proxy verifies servers against (network.egress_upstream_ca and the system roots).
	EgressCA            *egressproxy.CA
	EgressUpstreamRoots *x509.CertPool
}

// BackendFactory opens one kind of backend. It probes what it needs and fails with an
// error that tells the operator what to install or configure; it logs what it found.
type BackendFactory func(ctx context.Context, env BackendEnv) (Backend, error)

// Backends maps backend.kind (config) to its factory.
type Backends map[string]BackendFactory

// DefaultBackends are the backend kinds of this build. Adding a kind is one line here,
// its factory next to it (a function from BackendEnv to the backend package's own
// configuration), and the kind accepted by config's validation.
func DefaultBackends() Backends {
	return Backends{
		"oci":     openOCI,
		"microvm": openMicroVM,
	}
}

// Kinds lists the registered kinds, sorted.
func (bs Backends) Kinds() []string { return slices.Sorted(maps.Keys(bs)) }

// factory returns kind's factory, or an error naming the kinds there are.
func (bs Backends) factory(kind string) (BackendFactory, error) {
	f, ok := bs[kind]
	if !ok || f == nil {
		return nil, fmt.Errorf("backend.kind %q is not available in this build; use one of: %s", kind, strings.Join(bs.Kinds(), ", "))
	}
	return f, nil
}

// warmContainers maps backend.warm_containers (0: none) onto oci.Config's (0: the
// default, negative: none).
func warmContainers(n int) int {
	if n == 0 {
		return -1
	}
	return n
}

// openOCI is the "oci" kind: containers run by an OCI runtime (package oci).
func openOCI(ctx context.Context, env BackendEnv) (Backend, error) {
	cfg := env.Config
	allowRanges, dns, err := egressSettings(cfg.Network)
	if err != nil {
		return nil, err
	}
	b, err := oci.New(ctx, oci.Config{
		DataDir:           env.DataDir,
		EnvdPath:          env.EnvdPath,
		Runtime:           cfg.Backend.Runtime,
		Logger:            env.Logger,
		CgroupParent:      cfg.Backend.CgroupParent,
		UIDBase:           uint32(cfg.Backend.UIDBase),
		UIDRanges:         cfg.Backend.UIDRanges,
		WarmContainers:    warmContainers(cfg.Backend.WarmContainers),
		WarmContainersMax: cfg.Backend.WarmContainersMax,
		OverlayRoots:      cfg.Backend.OverlayRoots,
		SnapshotQuiesce:   cfg.Snapshot.Quiesce,
		LayerResolver:     env.Layers,
		DataPlane:         ociDataPlane(env.DataPlane),
		Network: network.Config{
			Bridge:      cfg.Network.Bridge,
			Subnet:      cfg.Network.Subnet,
			Prefix:      cfg.Network.Prefix,
			PoolSize:    cfg.Network.PoolSize,
			AllowRanges: allowRanges,
			EgressCA:    env.EgressCA, EgressUpstreamRoots: env.EgressUpstreamRoots,
		},
		DNS: dns,
	})
	if err != nil {
		if errors.Is(err, oci.ErrNoRuntime) {
			return nil, fmt.Errorf("no OCI runtime can start a container on this host: %w "+
				"(install crun or runc: `apt-get install crun runc`, run as root, or choose one with backend.runtime / AENV_BACKEND_RUNTIME)", err)
		}
		return nil, fmt.Errorf("start the oci backend: %w", err)
	}
	env.Logger.Info("oci backend ready", "runtime", b.Runtime(), "userns", b.UserNamespaces())
	return b, nil
}

// egressSettings parses network.allow_ranges and network.dns, which both backends' slots
// enforce (the infrastructure deny's exceptions, the sandboxes' nameservers).
func egressSettings(n config.Network) (allowRanges []netip.Prefix, dns []netip.Addr, err error) {
	for _, r := range n.AllowRanges {
		p, err := netip.ParsePrefix(r)
		if err != nil {
			return nil, nil, fmt.Errorf("network.allow_ranges: %w", err)
		}
		allowRanges = append(allowRanges, p)
	}
	for _, a := range n.DNS {
		ip, err := netip.ParseAddr(a)
		if err != nil {
			return nil, nil, fmt.Errorf("network.dns: %w", err)
		}
		dns = append(dns, ip)
	}
	return allowRanges, dns, nil
}

// ociDataPlane keeps a nil client a nil interface.
func ociDataPlane(c *dataplane.Client) oci.DataPlane {
	if c == nil {
		return nil
	}
	return c
}

// microvmDataPlane keeps a nil client a nil interface.
func microvmDataPlane(c *dataplane.Client) microvm.DataPlane {
	if c == nil {
		return nil
	}
	return c
}

// openMicroVM is the "microvm" kind: a QEMU microVM per sandbox (package microvm).
func openMicroVM(ctx context.Context, env BackendEnv) (Backend, error) {
	cfg := env.Config
	allowRanges, dns, err := egressSettings(cfg.Network)
	if err != nil {
		return nil, err
	}
	// The node's layer resolver also fetches whole blobs, verified: the memory images of
	// snapshots made on other nodes.
	fetcher, _ := env.Layers.(microvm.BlobFetcher)
	b, err := microvm.New(ctx, microvm.Config{
		DataDir:         env.DataDir,
		EnvdPath:        env.EnvdPath,
		Kernel:          cfg.Backend.GuestKernel,
		Initrd:          cfg.Backend.GuestInitrd,
		Accel:           cfg.Backend.Accel,
		TBSizeMiB:       cfg.Backend.TBSizeMiB,
		SnapshotPool:    cfg.Backend.SnapshotPool,
		SnapshotPoolMax: cfg.Backend.SnapshotPoolMax,
		QEMUUser:        cfg.Backend.QEMUUser,
		LayerResolver:   env.Layers,
		DataPlane:       microvmDataPlane(env.DataPlane),
		BlobFetcher:     fetcher,
		Logger:          env.Logger,
		Network: network.Config{
			Bridge:      cfg.Network.Bridge,
			Subnet:      cfg.Network.Subnet,
			Prefix:      cfg.Network.Prefix,
			PoolSize:    cfg.Network.PoolSize,
			AllowRanges: allowRanges,
			DNS:         dns,
			EgressCA:    env.EgressCA, EgressUpstreamRoots: env.EgressUpstreamRoots,
		},
	})
	if err != nil {
		return nil, fmt.Errorf("start the microvm backend: %w", err)
	}
	return b, nil
}
