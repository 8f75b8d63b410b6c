package main

import (
	"fmt"
	"net"
	"net/url"
	"strconv"

	"github.com/spf13/cobra"

	"github.com/aenv-dev/aenv/internal/bench"
)

// localHost reports whether host is this machine, where MemAvailable, /proc and the
// cgroups describe the node.
func localHost(host string) bool {
	if host == "localhost" {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && (ip.IsLoopback() || ip.IsUnspecified())
}

// cpuFlags are the flags of a bench that measures CPU per operation.
type cpuFlags struct {
	mode          string
	nodePID       int
	dataPlanePIDs []int
	cgroupParent  string
}

func (f *cpuFlags) add(cmd *cobra.Command) {
	fl := cmd.Flags()
	fl.StringVar(&f.mode, "cpu", "auto", "CPU per operation from /proc and cgroups: auto (when the node runs on this machine), on, off")
	fl.IntVar(&f.nodePID, "node-pid", 0, "with --cpu: the node's process (default: the one listening on the --url port)")
	fl.IntSliceVar(&f.dataPlanePIDs, "dataplane-pid", nil, "with --cpu: the data plane's process (default: the node's own)")
	fl.StringVar(&f.cgroupParent, "cgroup-parent", "", "with --cpu: the node's backend.cgroup_parent (default: its AENV_BACKEND_CGROUP_PARENT, else aenv)")
}

// meter returns the CPU meter the flags ask for, nil when off. With "auto" a node that
// cannot be measured (elsewhere, not found) is a note on stderr, with "on" an error.
func (f *cpuFlags) meter(cmd *cobra.Command, base string) (*bench.CPUMeter, error) {
	switch f.mode {
	case "off":
		return nil, nil
	case "auto", "on":
	default:
		return nil, fmt.Errorf("--cpu %q: want auto, on or off", f.mode)
	}
	m, err := f.discover(base)
	if err != nil {
		if f.mode == "on" {
			return nil, err
		}
		fmt.Fprintf(cmd.ErrOrStderr(), "aenv: no CPU figures: %v\n", err)
		return nil, nil
	}
	return m, nil
}

func (f *cpuFlags) discover(base string) (*bench.CPUMeter, error) {
	u, err := url.Parse(base)
	if err != nil {
		return nil, fmt.Errorf("--url %q: %w", base, err)
	}
	var src bench.CPUSources
	if f.nodePID == 0 {
		if !localHost(u.Hostname()) {
			return nil, fmt.Errorf("%s is not on this machine (give --node-pid to measure a node here anyway)", base)
		}
		port, err := strconv.Atoi(u.Port())
		if err != nil {
			port = 80
			if u.Scheme == "https" {
				port = 443
			}
		}
		if src, err = bench.DiscoverNode("/proc", port); err != nil {
			return nil, err
		}
	} else {
		src = bench.CPUSources{NodePID: f.nodePID, CgroupParent: "aenv"}
	}
	if f.dataPlanePIDs != nil {
		src.DataPlanePIDs = f.dataPlanePIDs
	}
	if f.cgroupParent != "" {
		src.CgroupParent = f.cgroupParent
	}
	return bench.NewCPUMeter(src)
}
