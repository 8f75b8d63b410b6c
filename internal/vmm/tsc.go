package vmm

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// HostTSCKHz reads the host's TSC rate, which is the guest's TSC rate under TCG. Sources,
// most precise first: the kernel's sysfs value where it exists, the kernel's own
// calibration in its log ("tsc: Refined TSC clocksource calibration" or "tsc: Detected"),
// then /proc/cpuinfo's "cpu MHz" (the TSC rate on constant-TSC CPUs). A wrong value only
// makes the guest clock drift; a missing one risks a hung boot.
func HostTSCKHz() (int, error) {
	if b, err := os.ReadFile("/sys/devices/system/cpu/cpu0/tsc_freq_khz"); err == nil {
		if v, err := strconv.Atoi(strings.TrimSpace(string(b))); err == nil && v > 0 {
			return v, nil
		}
	}
	if v, err := tscFromKmsg(); err == nil && v > 0 {
		return v, nil
	}
	b, err := os.ReadFile("/proc/cpuinfo")
	if err != nil {
		return 0, fmt.Errorf("vmm: host TSC rate: %w", err)
	}
	if v := tscFromCPUInfo(b); v > 0 {
		return v, nil
	}
	return 0, errors.New("vmm: host TSC rate: not in sysfs, kernel log or /proc/cpuinfo")
}

// tscFromKmsg reads the kernel log without blocking (needs CAP_SYSLOG or
// dmesg_restrict=0; the boot lines may have been overwritten on a long-running host).
func tscFromKmsg() (int, error) {
	// Raw syscalls: an *os.File would park a non-blocking read in the poller at the
	// end of the log instead of returning EAGAIN.
	fd, err := unix.Open("/dev/kmsg", unix.O_RDONLY|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
	if err != nil {
		return 0, err
	}
	defer unix.Close(fd)
	var log bytes.Buffer
	buf := make([]byte, 8192)
	for {
		n, err := unix.Read(fd, buf) // one record per read
		if n > 0 {
			log.Write(buf[:n])
			log.WriteByte('\n')
		}
		if errors.Is(err, unix.EPIPE) { // a record was overwritten: keep reading
			continue
		}
		if err != nil || n <= 0 {
			break
		}
	}
	return tscFromKernelLog(log.Bytes()), nil
}

// tscFromKernelLog returns the last calibration the kernel logged, in kHz, or 0.
func tscFromKernelLog(b []byte) int {
	best, refined := 0, false
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		line := sc.Text()
		for _, p := range []struct {
			marker  string
			refined bool
		}{{"tsc: Refined TSC clocksource calibration: ", true}, {"tsc: Detected ", false}} {
			i := strings.Index(line, p.marker)
			if i < 0 || (refined && !p.refined) {
				continue
			}
			if v := parseMHz(line[i+len(p.marker):]); v > 0 {
				best, refined = v, p.refined
			}
		}
	}
	return best
}

func tscFromCPUInfo(b []byte) int {
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		k, v, ok := strings.Cut(sc.Text(), ":")
		if ok && strings.TrimSpace(k) == "cpu MHz" {
			return parseMHz(strings.TrimSpace(v) + " MHz")
		}
	}
	return 0
}

// parseMHz turns "2095.987 MHz ..." into 2095987.
func parseMHz(s string) int {
	f, _, ok := strings.Cut(strings.TrimSpace(s), " MHz")
	if !ok {
		return 0
	}
	whole, frac, _ := strings.Cut(f, ".")
	frac = (frac + "000")[:3]
	w, err1 := strconv.Atoi(whole)
	fr, err2 := strconv.Atoi(frac)
	if err1 != nil || err2 != nil || w <= 0 {
		return 0
	}
	return w*1000 + fr
}
