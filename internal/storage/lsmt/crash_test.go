package lsmt

import (
	"bufio"
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

const crashEnv = "AENV_LSMT_CRASH_CHILD"

// TestMain lets the test binary double as the child that gets killed.
func TestMain(m *testing.M) {
	if dir := os.Getenv(crashEnv); dir != "" {
		crashChild(dir)
		return
	}
	os.Exit(m.Run())
}

func crashPattern(i int) []byte { return bytes.Repeat([]byte{byte(i%251 + 1)}, 8192) }

// crashChild writes forever, reporting each synced write count on stdout.
func crashChild(dir string) {
	l, err := CreateRW(filepath.Join(dir, "d"), filepath.Join(dir, "i"), CreateOptions{VirtualSize: 64 << 20})
	if err != nil {
		fmt.Println("error", err)
		os.Exit(1)
	}
	for i := 0; ; i++ {
		// Rewrite slots so the index has overwrites, not just appends.
		if _, err := l.WriteAt(crashPattern(i), int64(i%1000)*8192); err != nil {
			os.Exit(1)
		}
		if i%7 == 6 {
			if err := l.Sync(); err != nil {
				os.Exit(1)
			}
			fmt.Println("synced", i)
		}
	}
}

// TestCrashKill SIGKILLs a writer mid-stream and checks that every synced
// write is readable after reopening.
func TestCrashKill(t *testing.T) {
	dir := t.TempDir()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), crashEnv+"="+dir)
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	sc := bufio.NewScanner(out)
	last := -1
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) == 2 && f[0] == "synced" {
			last, _ = strconv.Atoi(f[1])
			if last > 2500 {
				break
			}
		}
	}
	cmd.Process.Kill()
	cmd.Wait()
	if last < 0 {
		t.Fatal("child never synced")
	}
	l, err := OpenRW(filepath.Join(dir, "d"), filepath.Join(dir, "i"))
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	got := make([]byte, 8192)
	// Slot s holds, at least, its last synced write; later unsynced writes
	// may or may not have survived, but nothing else.
	for s := 0; s < 1000; s++ {
		l.ReadAt(got, int64(s)*8192)
		lastSynced := last - ((last-s)%1000+1000)%1000
		ok := false
		for i := lastSynced; i <= lastSynced+1000 && !ok; i += 1000 {
			ok = bytes.Equal(got, crashPattern(i))
		}
		if !ok {
			t.Fatalf("slot %d: synced write %d lost (got %d)", s, lastSynced, got[0])
		}
	}
}
