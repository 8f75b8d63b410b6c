package envd

import (
	"fmt"
	"os"

	"golang.org/x/sys/unix"
)

// reseedRandom mixes b into the kernel's entropy pool through dev (/dev/urandom) and
// makes the kernel's random generator take a new key from the pool at once
// (RNDRESEEDCRNG, root only).
//
// A microVM restored from a capture goes on with the generator's state of the moment
// of the capture: every fork child and the parent read the same bytes from
// /dev/urandom and getrandom (keys, UUIDs, temporary names) until the kernel's next
// scheduled reseed, up to a minute later once the guest has run two minutes, each
// then from entropy of its own. The node sends fresh bytes in the /init of every
// sandbox whose memory came from a capture.
func reseedRandom(dev string, b []byte) error {
	f, err := os.OpenFile(dev, os.O_WRONLY, 0)
	if err != nil {
		return fmt.Errorf("open the random device: %w", err)
	}
	defer f.Close()
	if _, err := f.Write(b); err != nil {
		return fmt.Errorf("mix into the entropy pool: %w", err)
	}
	if err := unix.IoctlSetInt(int(f.Fd()), unix.RNDRESEEDCRNG, 0); err != nil {
		return fmt.Errorf("reseed the random generator: %w", err)
	}
	return nil
}
