// Package steptime times the steps of a long operation (a node's start, a reconcile) for
// its log: the wall time of each step and the CPU time the process and the children it
// waited for (nft, runc) used meanwhile. On a busy host the wall times mostly measure
// the wait for a CPU; the CPU times say what a step itself costs.
package steptime

import (
	"log/slog"
	"syscall"
	"time"
)

// Laps records the steps of one operation, in order. Not safe for concurrent use.
type Laps struct {
	last    time.Time
	lastCPU time.Duration
	attrs   []any
}

// Start begins timing the first step.
func Start() *Laps {
	return &Laps{last: time.Now(), lastCPU: cpuTime()}
}

// Lap ends the step named step (and begins the next).
func (l *Laps) Lap(step string) {
	now, cpu := time.Now(), cpuTime()
	l.attrs = append(l.attrs, slog.Group(step, slog.Duration("wall", now.Sub(l.last).Round(time.Microsecond)),
		slog.Duration("cpu", (cpu-l.lastCPU).Round(time.Microsecond))))
	l.last, l.lastCPU = now, cpu
}

// Attrs are the steps' times as slog attributes (step.wall, step.cpu).
func (l *Laps) Attrs() []any { return l.attrs }

// cpuTime is the user and system time of this process and of its waited-for children.
func cpuTime() time.Duration {
	var total time.Duration
	for _, who := range []int{syscall.RUSAGE_SELF, syscall.RUSAGE_CHILDREN} {
		var ru syscall.Rusage
		if syscall.Getrusage(who, &ru) == nil {
			total += time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
		}
	}
	return total
}
