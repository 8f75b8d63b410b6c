package bench

import (
	"fmt"
	"io"
	"sync"
)

// Progress draws a one-line counter ("label: done/total") on a terminal, rewriting it in
// place; a nil *Progress draws nothing, so callers need not check for a terminal twice.
type Progress struct {
	mu    sync.Mutex
	w     io.Writer
	label string
	width int
}

// NewProgress returns a Progress drawing on w, or nil when tty is false (piped output
// stays clean).
func NewProgress(w io.Writer, tty bool) *Progress {
	if !tty {
		return nil
	}
	return &Progress{w: w}
}

// Label sets what the counter is counting from now on.
func (p *Progress) Label(label string) {
	if p == nil {
		return
	}
	p.mu.Lock()
	p.label = label
	p.mu.Unlock()
}

// Update draws done/total.
func (p *Progress) Update(done, total int) {
	if p == nil {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	line := fmt.Sprintf("%s: %d/%d", p.label, done, total)
	pad := max(p.width-len(line), 0)
	p.width = len(line)
	fmt.Fprintf(p.w, "\r%s%*s", line, pad, "")
}

// Done clears the line.
func (p *Progress) Done() {
	if p == nil {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.width > 0 {
		fmt.Fprintf(p.w, "\r%*s\r", p.width, "")
		p.width = 0
	}
}
