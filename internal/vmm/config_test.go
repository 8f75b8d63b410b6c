package vmm

import (
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

func baseConfig() Config {
	return Config{
		Accel: AccelTCG, CPUs: 2, TSCKHz: 2095987,
		Memory: Memory{SizeMiB: 256, Path: "/dev/shm/vm,1/ram", Share: true},
		Kernel: "/k/vmlinux", Initrd: "/k/initrd", Cmdline: "console=ttyS0 quiet",
		ConsoleLog: "/run/vm/console.log", QMPSocket: "/run/vm/qmp.sock", PIDFile: "/run/vm/pid",
	}
}

func TestArgs(t *testing.T) {
	c := baseConfig()
	c.Drives = []Drive{{ID: "root", Path: "/d/root.raw"}, {ID: "ro", Path: "/d/b.qcow2", Format: "qcow2", ReadOnly: true, Cache: "none"}}
	c.NICs = []NIC{
		{ID: "n0", Tap: "aenv-tap0", MAC: "06:00:ac:10:00:02"},
		{ID: "n1", User: true, Forward: []HostForward{{Host: netip.MustParseAddrPort("127.0.0.1:40001"), GuestPort: 49983}}},
		{ID: "n2", TapFile: os.Stdin, MAC: "06:00:ac:10:00:03"},
	}
	c.Incoming = true
	got := strings.Join(c.Args(), " ")
	for _, want := range []string{
		"-M microvm,memory-backend=mem ",
		"-accel tcg -cpu max -smp 2 -m 256M",
		"-object memory-backend-file,id=mem,size=256M,mem-path=/dev/shm/vm,,1/ram,share=on",
		"-append console=ttyS0 quiet tsc_early_khz=2095987 -serial file:/run/vm/console.log",
		"-qmp unix:/run/vm/qmp.sock,server=on,wait=off -pidfile /run/vm/pid",
		"-drive id=root,file=/d/root.raw,format=raw,if=none,cache=writeback,aio=threads -device virtio-blk-device,drive=root",
		"-drive id=ro,file=/d/b.qcow2,format=qcow2,if=none,cache=none,aio=threads,readonly=on -device virtio-blk-device,drive=ro",
		"-netdev tap,id=n0,ifname=aenv-tap0,script=no,downscript=no,vhost=off -device virtio-net-device,netdev=n0,mac=06:00:ac:10:00:02",
		"-netdev user,id=n1,hostfwd=tcp:127.0.0.1:40001-:49983 -device virtio-net-device,netdev=n1",
		"-netdev tap,id=n2,fd=3,vhost=off -device virtio-net-device,netdev=n2,mac=06:00:ac:10:00:03",
		"-incoming defer",
	} {
		if !strings.Contains(got, want) {
			t.Errorf("args lack %q:\n%s", want, got)
		}
	}
	if strings.Contains(got, "acpi=off") || strings.Contains(got, "rtc=off") {
		t.Errorf("acpi and rtc must stay on: %s", got)
	}
	if err := c.Validate(); err != nil {
		t.Fatal(err)
	}
	if fs := c.extraFiles(); len(fs) != 1 || fs[0] != os.Stdin {
		t.Errorf("extra files = %v, want the tap file as fd 3", fs)
	}

	c.Confine = &Confinement{UID: 64400, GID: 64401, Chroot: "/var/empty", Seccomp: true}
	if got := strings.Join(c.Args(), " "); !strings.HasSuffix(got, " -sandbox "+SeccompPolicy+" -runas 64400:64401 -chroot /var/empty") {
		t.Errorf("confined args end %q", got[max(0, len(got)-120):])
	}
	if err := c.Validate(); err != nil {
		t.Fatal(err)
	}

	kvm := baseConfig()
	kvm.Accel = AccelKVM
	args := kvm.Args()
	if i := slices.Index(args, "-append"); strings.Contains(args[i+1], "tsc_early_khz") {
		t.Errorf("KVM cmdline got tsc_early_khz: %q", args[i+1])
	}
	if !strings.Contains(strings.Join(args, " "), "-accel kvm -cpu host") {
		t.Errorf("KVM args: %v", args)
	}
	own := baseConfig()
	own.Cmdline = "tsc_early_khz=1000"
	if i := slices.Index(own.Args(), "-append"); own.Args()[i+1] != "tsc_early_khz=1000" {
		t.Errorf("caller's tsc_early_khz replaced: %q", own.Args()[i+1])
	}
}

func TestValidate(t *testing.T) {
	for _, tc := range []struct {
		name string
		edit func(*Config)
		want string
	}{
		{"accel", func(c *Config) { c.Accel = "hvf" }, "accel"},
		{"cpus", func(c *Config) { c.CPUs = 0 }, "cpus"},
		{"memory", func(c *Config) { c.Memory.SizeMiB = 1 }, "memory"},
		{"relative kernel", func(c *Config) { c.Kernel = "vmlinux" }, "kernel"},
		{"relative pidfile", func(c *Config) { c.PIDFile = "pid" }, "pidfile"},
		{"cmdline newline", func(c *Config) { c.Cmdline = "a\nb" }, "newline"},
		{"drive id", func(c *Config) { c.Drives = []Drive{{ID: "a,b", Path: "/x"}} }, "drive id"},
		{"drive format", func(c *Config) { c.Drives = []Drive{{ID: "d", Path: "/x", Format: "vmdk"}} }, "format"},
		{"drive cache", func(c *Config) { c.Drives = []Drive{{ID: "d", Path: "/x", Cache: "fast"}} }, "cache"},
		{"duplicate id", func(c *Config) {
			c.Drives = []Drive{{ID: "d", Path: "/x"}}
			c.NICs = []NIC{{ID: "d", User: true}}
		}, "duplicate"},
		{"mem id taken", func(c *Config) { c.Drives = []Drive{{ID: "mem", Path: "/x"}} }, "duplicate"},
		{"nic both", func(c *Config) { c.NICs = []NIC{{ID: "n", Tap: "t", User: true}} }, "exactly one"},
		{"nic none", func(c *Config) { c.NICs = []NIC{{ID: "n"}} }, "exactly one"},
		{"tap name", func(c *Config) { c.NICs = []NIC{{ID: "n", Tap: "a,b"}} }, "tap name"},
		{"tap name and file", func(c *Config) { c.NICs = []NIC{{ID: "n", Tap: "t", TapFile: os.Stdin}} }, "exactly one"},
		{"tap forward", func(c *Config) {
			c.NICs = []NIC{{ID: "n", Tap: "t", Forward: []HostForward{{Host: netip.MustParseAddrPort("127.0.0.1:1"), GuestPort: 1}}}}
		}, "user networking"},
		{"mac", func(c *Config) { c.NICs = []NIC{{ID: "n", User: true, MAC: "zz"}} }, "MAC"},
		{"confine uid only", func(c *Config) { c.Confine = &Confinement{UID: 5} }, "both positive"},
		{"confine negative", func(c *Config) { c.Confine = &Confinement{UID: -1, GID: -1} }, "both positive"},
		{"confine chroot", func(c *Config) { c.Confine = &Confinement{UID: 5, GID: 5, Chroot: "root"} }, "chroot"},
		{"guest port", func(c *Config) {
			c.NICs = []NIC{{ID: "n", User: true, Forward: []HostForward{{Host: netip.MustParseAddrPort("127.0.0.1:1"), GuestPort: 0}}}}
		}, "guest port"},
		{"ipv6 forward", func(c *Config) {
			c.NICs = []NIC{{ID: "n", User: true, Forward: []HostForward{{Host: netip.MustParseAddrPort("[::1]:1"), GuestPort: 1}}}}
		}, "IPv4"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := baseConfig()
			tc.edit(&c)
			err := c.Validate()
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("Validate = %v, want an error about %q", err, tc.want)
			}
		})
	}
}

func TestCheckRAMFile(t *testing.T) {
	dir := t.TempDir()
	p := filepath.Join(dir, "ram")
	if err := checkRAMFile(Memory{SizeMiB: 16, Path: p, Share: true}); err != nil {
		t.Fatalf("a new RAM file: %v", err)
	}
	if err := os.WriteFile(p, make([]byte, 16<<20), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := checkRAMFile(Memory{SizeMiB: 32, Path: p}); err == nil {
		t.Error("a private mapping larger than the file was accepted (QEMU would grow the template)")
	}
	if err := MarkTemplate(p); err != nil {
		t.Fatal(err)
	}
	if err := checkRAMFile(Memory{SizeMiB: 16, Path: p, Share: true}); err == nil {
		t.Error("a template RAM file was accepted for a shared mapping")
	}
	if err := checkRAMFile(Memory{SizeMiB: 16, Path: p}); err != nil {
		t.Errorf("private mapping of a template: %v", err)
	}
}

func TestCopyRAMFile(t *testing.T) {
	dir := t.TempDir()
	src, dst := filepath.Join(dir, "src"), filepath.Join(dir, "dst")
	f, err := os.Create(src)
	if err != nil {
		t.Fatal(err)
	}
	f.Truncate(64 << 20)
	f.WriteAt([]byte("first page"), 0)
	f.WriteAt([]byte("middle"), 40<<20)
	f.WriteAt([]byte("end"), 64<<20-3)
	f.Close()
	if err := CopyRAMFile(src, dst); err != nil {
		t.Fatal(err)
	}
	a, _ := os.ReadFile(src)
	b, err := os.ReadFile(dst)
	if err != nil || !slices.Equal(a, b) {
		t.Fatalf("copy differs (err %v)", err)
	}
	var st1, st2 os.FileInfo
	st1, _ = os.Stat(src)
	st2, _ = os.Stat(dst)
	if st2.Mode().Perm()&0o200 == 0 || st1.Size() != st2.Size() {
		t.Fatalf("copy mode %v size %d", st2.Mode(), st2.Size())
	}
	if err := CopyRAMFile(filepath.Join(dir, "missing"), filepath.Join(dir, "x")); err == nil {
		t.Fatal("copy of a missing file succeeded")
	}
	if _, err := os.Stat(filepath.Join(dir, "x.partial")); !os.IsNotExist(err) {
		t.Fatal("a failed copy left a partial file")
	}
}

func TestQEMUEnv(t *testing.T) {
	for _, tc := range []struct {
		name string
		in   []string
		want string
	}{
		{"added", []string{"PATH=/bin"}, "MALLOC_ARENA_MAX=1"},
		{"operator's kept", []string{"MALLOC_ARENA_MAX=4", "PATH=/bin"}, "MALLOC_ARENA_MAX=4"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := qemuEnv(slices.Clone(tc.in))
			n := 0
			for _, kv := range got {
				if strings.HasPrefix(kv, "MALLOC_ARENA_MAX=") {
					n++
					if kv != tc.want {
						t.Errorf("got %q, want %q", kv, tc.want)
					}
				}
			}
			if n != 1 || !slices.Contains(got, "PATH=/bin") {
				t.Errorf("env %v: want the input plus one MALLOC_ARENA_MAX", got)
			}
		})
	}
}
