package microvm

import (
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"testing"
)

// TestGuestDNS: network.dns wins over the resolv.conf; without it the resolv.conf's
// reachable nameservers become the pool's (the port-53 exception) and the guest's.
func TestGuestDNS(t *testing.T) {
	rc := filepath.Join(t.TempDir(), "resolv.conf")
	if err := os.WriteFile(rc, []byte("nameserver 127.0.0.53\nnameserver 10.1.2.3\nnameserver ::1\nsearch x\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name string
		dns  []netip.Addr
		want []string
	}{
		{"configured", []netip.Addr{netip.MustParseAddr("192.88.99.53")}, []string{"192.88.99.53"}},
		{"from resolv.conf", nil, []string{"10.1.2.3"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := Config{ResolvConf: rc}
			c.Network.DNS = tc.dns
			c.defaultDNS()
			if got := c.guestDNS(); !slices.Equal(got, tc.want) {
				t.Errorf("guest DNS %v, want %v", got, tc.want)
			}
		})
	}
}
