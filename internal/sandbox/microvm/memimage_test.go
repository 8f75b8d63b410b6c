package microvm

import (
	"encoding/json"
	"net/netip"
	"strings"
	"testing"

	"github.com/aenv-dev/aenv/internal/sandbox"
)

func TestDecodeCapture(t *testing.T) {
	b := &Backend{cfg: Config{DataDir: "/var/lib/aenv", RAMDir: "/dev/shm/aenv-microvm"}}
	const dig = "sha256:3a7bd3e2360a3d29eea436fcfb7e44c735d117c42d1c1835420b6b9942dd4f1b"
	good := func() *capture {
		dir := "/var/lib/aenv/captures/abc"
		return &capture{Backend: "microvm", ID: "abc", Dir: dir,
			Layers:    []sandbox.LayerRef{{Path: dir + "/disk.lsmt"}},
			Resources: sandbox.Resources{CPUCount: 1, MemoryMB: 192},
			Memory: &memImage{Dir: dir, RAM: &memBlob{Path: dir + "/ram", Size: 192 << 20, Role: roleMemory},
				State: memBlob{Path: dir + "/state", Size: 60 << 10, Role: roleVMState}, IgnoreShared: true},
			Guest: guestIdentity{Addr: netip.MustParsePrefix("10.89.40.2/24"), Gateway: netip.MustParseAddr("10.89.40.1"),
				MAC: "02:00:0a:59:28:02"}}
	}
	for _, tc := range []struct {
		name string
		edit func(*capture)
		want string // error; "" for none
		// check inspects what decoded (nil: it must round-trip unchanged).
		check func(*capture) string
	}{
		{name: "good", edit: func(*capture) {}},
		{name: "transient", edit: func(c *capture) {
			img := "/dev/shm/aenv-microvm/images/abc"
			c.Memory.Dir, c.Memory.RAM.Path, c.Memory.State.Path = img, img+"/ram", img+"/state"
		}},
		{name: "full stream", edit: func(c *capture) { c.Memory.RAM, c.Memory.IgnoreShared = nil, false }},
		{name: "other backend", edit: func(c *capture) { c.Backend = "oci" }, want: "not a microvm"},
		{name: "no layers", edit: func(c *capture) { c.Layers = nil }, want: "not a microvm"},
		{name: "another node's (synced, by digest)", edit: func(c *capture) {
			other := "/srv/aenv/captures/abc"
			c.Dir, c.Memory.Dir = other, other
			c.Memory.RAM = &memBlob{Digest: dig, Size: 192 << 20, Role: roleMemory}
			c.Memory.State = memBlob{Path: "/srv/aenv/snapshot/layers/x.layer", Digest: dig, Size: 10, Role: roleVMState}
		}, check: func(c *capture) string {
			if c.Dir != "" || c.Memory.Dir != "" || c.Memory.State.Path != "" || c.Memory.State.Digest != dig {
				return "foreign paths kept"
			}
			return ""
		}},
		{name: "dir traversal dropped", edit: func(c *capture) { c.Dir = "/var/lib/aenv/captures/../../../etc" }, want: "neither a file"},
		{name: "captures dir itself", edit: func(c *capture) { c.Dir = "/var/lib/aenv/captures" }, want: "neither a file"},
		{name: "ram outside, no digest", edit: func(c *capture) { c.Memory.RAM.Path = "/etc/shadow" }, want: "neither a file"},
		{name: "ram outside, digest", edit: func(c *capture) { c.Memory.RAM.Path, c.Memory.RAM.Digest = "/etc/shadow", dig },
			check: func(c *capture) string {
				if c.Memory.RAM.Path != "" {
					return "outside path kept"
				}
				return ""
			}},
		{name: "state outside", edit: func(c *capture) { c.Memory.State.Path = "/dev/shm/aenv-microvm/images/other/state" }, want: "neither a file"},
		{name: "bad digest", edit: func(c *capture) { c.Memory.RAM.Digest = "sha256:nope" }, want: "digest"},
		{name: "wrong role", edit: func(c *capture) { c.Memory.RAM.Role = "rootfs" }, want: "roles"},
		{name: "ram without ignoreShared", edit: func(c *capture) { c.Memory.IgnoreShared = false }, want: "RAM file"},
		{name: "negative size", edit: func(c *capture) { c.Memory.State.Size = -1 }, want: "size"},
		{name: "bad mac", edit: func(c *capture) { c.Guest.MAC = "nope" }, want: "identity"},
		{name: "no resources", edit: func(c *capture) { c.Resources = sandbox.Resources{} }, want: "resources"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := good()
			tc.edit(c)
			raw, err := json.Marshal(c)
			if err != nil {
				t.Fatal(err)
			}
			got, err := b.decode(raw)
			if tc.want != "" {
				if err == nil || !strings.Contains(err.Error(), tc.want) {
					t.Fatalf("decode = %v, want an error about %q", err, tc.want)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if tc.check != nil {
				if msg := tc.check(got); msg != "" {
					t.Fatal(msg)
				}
				return
			}
			back, _ := got.Encode()
			if string(back) != string(raw) {
				t.Fatalf("round trip changed the capture:\n%s\n%s", raw, back)
			}
		})
	}
	if _, err := b.DecodePaused([]byte("{")); err == nil {
		t.Fatal("malformed JSON decoded")
	}
}
