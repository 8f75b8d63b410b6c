package oci

import "time"

// burstWindow: launches of one template that follow each other within this long count as
// one burst (a batch of rollouts asks for its sandboxes at once; a loop of sequential
// creates at full speed is a burst too).
const burstWindow = 2 * time.Second

// burstHold is how long a template's warm pool stays sized to its largest burst after the
// last launch that reached it.
const burstHold = 10 * time.Minute

// demand follows one template's launches to size its warm pool to its bursts.
type demand struct {
	recent []time.Time // launches within burstWindow of the newest, oldest first
	peak   int         // the largest burst that ended within burstHold
	peakAt time.Time   // the last launch that reached peak
}

// launched records a launch at now.
func (d *demand) launched(now time.Time) {
	i := 0
	for i < len(d.recent) && now.Sub(d.recent[i]) > burstWindow {
		i++
	}
	d.recent = append(d.recent[i:], now)
	if n := len(d.recent); n >= d.peak || now.Sub(d.peakAt) > burstHold {
		d.peak, d.peakAt = n, now
	}
}

// size is how many warm containers to keep at now: the largest recent burst, at least lo
// and at most hi.
func (d *demand) size(now time.Time, lo, hi int) int {
	n := lo
	if now.Sub(d.peakAt) <= burstHold {
		n = max(n, d.peak)
	}
	return min(n, hi)
}
