package network

import (
	"bytes"
	"context"
	"net"
	"testing"

	"github.com/vishvananda/netlink"
)

// TestBridgeKeepsItsMAC: slots coming and going neither change the bridge's MAC (which
// sandboxes have cached for their gateway) nor drop the permanent neighbour entries of
// the slots still in use. An unpinned bridge takes the lowest MAC of its ports, and each
// change flushes its neighbour table.
func TestBridgeKeepsItsMAC(t *testing.T) {
	needRoot(t)
	ctx := context.Background()
	p := testPool(t, "ntmac", -1)
	if _, err := p.Reconcile(ctx, nil); err != nil {
		t.Fatal(err)
	}
	br, err := netlink.LinkByName(p.cfg.Bridge)
	if err != nil {
		t.Fatal(err)
	}
	mac := br.Attrs().HardwareAddr
	keep, err := p.Acquire(ctx, true)
	if err != nil {
		t.Fatal(err)
	}
	// Enough veths that one almost surely has a MAC below the bridge's (each port's is
	// random): an unpinned bridge would adopt it.
	for range 12 {
		s, err := p.Acquire(ctx, true)
		if err != nil {
			t.Fatal(err)
		}
		if err := p.Release(ctx, s); err != nil {
			t.Fatal(err)
		}
	}
	br, err = netlink.LinkByName(p.cfg.Bridge)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(br.Attrs().HardwareAddr, mac) {
		t.Fatalf("bridge MAC changed from %s to %s", mac, br.Attrs().HardwareAddr)
	}
	neighs, err := netlink.NeighList(br.Attrs().Index, netlink.FAMILY_V4)
	if err != nil {
		t.Fatal(err)
	}
	found := false
	for _, n := range neighs {
		if n.IP.Equal(keep.IP.AsSlice()) && n.State == netlink.NUD_PERMANENT {
			found = true
		}
	}
	if !found {
		t.Fatalf("permanent neighbour entry of %s lost: %v", keep.IP, neighs)
	}
	if err := p.Release(ctx, keep); err != nil {
		t.Fatal(err)
	}
}

func TestBridgeMAC(t *testing.T) {
	derived := bridgeMAC(nil, "aenv0")
	if len(derived) != 6 || derived[0]&1 != 0 || derived[0]&2 == 0 {
		t.Fatalf("derived MAC %s is not a locally administered unicast address", derived)
	}
	if other := bridgeMAC(nil, "aenv1"); bytes.Equal(other, derived) {
		t.Fatalf("two bridges derive the same MAC %s", other)
	}
	tests := []struct {
		name string
		cur  net.HardwareAddr
		want net.HardwareAddr
	}{
		{"unicast is kept", net.HardwareAddr{0x5a, 1, 2, 3, 4, 5}, net.HardwareAddr{0x5a, 1, 2, 3, 4, 5}},
		{"zero (no ports) is replaced", net.HardwareAddr{0, 0, 0, 0, 0, 0}, derived},
		{"multicast is replaced", net.HardwareAddr{0x01, 0, 0x5e, 0, 0, 1}, derived},
		{"none is replaced", nil, derived},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := bridgeMAC(tt.cur, "aenv0"); !bytes.Equal(got, tt.want) {
				t.Fatalf("bridgeMAC(%s) = %s, want %s", tt.cur, got, tt.want)
			}
		})
	}
}
