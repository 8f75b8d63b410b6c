// Package vmm runs QEMU `-M microvm` processes and drives them over QMP: start and stop,
// pause and resume, snapshots as migration streams, and restores on a copy-on-write
// mapping of a template's RAM file. It knows nothing of sandboxes; the microvm backend
// (internal/sandbox/microvm) builds on it. Facts and measurements behind the choices
// below are in shared/reference/microvm.md.
//
// # Machine shape
//
// Guest RAM is always a file (-object memory-backend-file,id=mem), so a VM whose RAM is
// shared (share=on) is snapshotted by saving only its device state (x-ignore-shared,
// ~7 ms), and any number of forks restore on private (MAP_PRIVATE, copy-on-write)
// mappings of that file (30–50 ms to running under TCG). ACPI and the RTC stay on: the
// Debian kernel finds virtio-mmio devices only through ACPI, and without an RTC it waits
// 2 s at boot. Under TCG the kernel command line gets tsc_early_khz=<host TSC kHz>;
// without it one boot in five hangs calibrating the TSC. QEMU runs in its own process
// group and is stopped or killed by PID, never by name.
//
// # QMP client
//
// The client is written here rather than taken from github.com/digitalocean/go-qemu/qmp,
// the one QMP library on the module proxy. That library has no release (pseudo-versions
// only, last change Feb 2025), takes no context (a command to a hung QEMU blocks
// forever), reads answers with a bufio.Scanner that dies on lines over 64 KiB, blocks its
// reader when an events subscriber stops draining, and reports QEMU errors without their
// class. QMP itself is small (JSON lines: a greeting, qmp_capabilities, then commands with
// an id and their answers, interleaved with events), so a client with per-command
// contexts and ids costs less than wrapping those limits.
//
// # RAM-file rules
//
// A template's RAM file never changes once forks map it (MarkTemplate; Start refuses to
// map a read-only RAM file shared or to map any file private at another size). Forks map
// it private. A sandbox that must pause cheaply runs shared on its own copy
// (CopyRAMFile); its pause is then a device-state save.
package vmm
