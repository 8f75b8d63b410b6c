package vmm

import "testing"

// TestAdoptArgs: what Adopt reads back from a command line Args wrote.
func TestAdoptArgs(t *testing.T) {
	for _, share := range []bool{true, false} {
		c := baseConfig()
		c.Memory.Share = share
		c.Memory.Path = "/dev/shm/vm/ram"
		args := c.Args()
		obj, ok := ArgValue(args, "-object", "memory-backend-file,id="+MemoryBackendID+",")
		if !ok {
			t.Fatalf("no memory object in %q", args)
		}
		if m := parseMemory(obj); m != c.Memory {
			t.Errorf("memory read back %+v, want %+v", m, c.Memory)
		}
		if !hasArgPair(args, "-pidfile", c.PIDFile) || !hasArgPair(args, "-qmp", "unix:"+c.QMPSocket+",server=on,wait=off") {
			t.Errorf("pidfile or QMP socket not found in %q", args)
		}
		if hasArgPair(args, "-pidfile", c.PIDFile+"x") {
			t.Error("another pidfile matched")
		}
	}
	if _, ok := ArgValue([]string{"-drive"}, "-drive", ""); ok {
		t.Error("a flag without a value matched")
	}
}
