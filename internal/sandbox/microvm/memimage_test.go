package microvm

import (
	"encoding/json"
	"net/netip"
	"strings"
	"testing"

	"github.com/aenv-dev/aenv/internal/sandbox"
	"github.com/aenv-dev/aenv/internal/vmm"
)

func TestDecodeCapture(t *testing.T) {
	b := &Backend{cfg: Config{DataDir: "/var/lib/aenv", RAMDir: "/dev/shm/aenv-microvm"}}
	good := func() *capture {
		img := "/dev/shm/aenv-microvm/images/abc"
		return &capture{Backend: "microvm", ID: "abc", Dir: "/var/lib/aenv/captures/abc",
			Layers:    []sandbox.LayerRef{{Path: "/var/lib/aenv/captures/abc/disk.lsmt"}},
			Resources: sandbox.Resources{CPUCount: 1, MemoryMB: 192},
			Memory:    &memImage{Dir: img, RAM: img + "/ram", State: vmm.State{Path: img + "/state", IgnoreShared: true}},
			Guest: guestIdentity{Addr: netip.MustParsePrefix("10.89.40.2/24"), Gateway: netip.MustParseAddr("10.89.40.1"),
				MAC: "02:00:0a:59:28:02"}}
	}
	for _, tc := range []struct {
		name string
		edit func(*capture)
		want string
	}{
		{"good", func(*capture) {}, ""},
		{"full stream", func(c *capture) { c.Memory.RAM = "" }, ""},
		{"other backend", func(c *capture) { c.Backend = "oci" }, "not a microvm"},
		{"no layers", func(c *capture) { c.Layers = nil }, "not a microvm"},
		{"dir outside", func(c *capture) { c.Dir = "/etc" }, "outside"},
		{"dir traversal", func(c *capture) { c.Dir = "/var/lib/aenv/captures/../../../etc" }, "outside"},
		{"captures dir itself", func(c *capture) { c.Dir = "/var/lib/aenv/captures" }, "outside"},
		{"ram outside", func(c *capture) { c.Memory.RAM = "/etc/shadow" }, "outside"},
		{"state outside", func(c *capture) { c.Memory.State.Path = "/dev/shm/aenv-microvm/images/other/state" }, "outside"},
		{"bad mac", func(c *capture) { c.Guest.MAC = "nope" }, "identity"},
		{"no resources", func(c *capture) { c.Resources = sandbox.Resources{} }, "resources"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := good()
			tc.edit(c)
			raw, err := json.Marshal(c)
			if err != nil {
				t.Fatal(err)
			}
			got, err := b.decode(raw)
			if tc.want == "" {
				if err != nil {
					t.Fatal(err)
				}
				back, _ := got.Encode()
				if string(back) != string(raw) {
					t.Fatalf("round trip changed the capture:\n%s\n%s", raw, back)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("decode = %v, want an error about %q", err, tc.want)
			}
		})
	}
	if _, err := b.DecodePaused([]byte("{")); err == nil {
		t.Fatal("malformed JSON decoded")
	}
}
