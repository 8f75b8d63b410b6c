package orchestrator

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"strconv"
	"sync"
	"testing"
	"time"
)

// answers checks that the sandbox's envd was initialised once and answers GET /health
// at the endpoint the orchestrator gives for it.
func answers(ctx context.Context, h *harness, id string) error {
	ep, _, err := h.o.Endpoint(ctx, id, false)
	if err != nil {
		return fmt.Errorf("endpoint of %s: %w", id, err)
	}
	inst := h.b.Instance(id)
	if inst == nil {
		return fmt.Errorf("%s has no backend instance", id)
	}
	if n := len(inst.Envd().Inits()); n != 1 {
		return fmt.Errorf("%s: envd initialised %d times", id, n)
	}
	url := "http://" + net.JoinHostPort(ep.Host, strconv.Itoa(ep.EnvdPort)) + "/health"
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return err
	}
	res, err := http.DefaultClient.Do(req)
	if err != nil {
		return fmt.Errorf("%s: %w", id, err)
	}
	res.Body.Close()
	if res.StatusCode/100 != 2 {
		return fmt.Errorf("%s: envd /health answered %s", id, res.Status)
	}
	return nil
}

// 64 goroutines at once each create a sandbox, fork it (every other one), check that
// every sandbox answers, and kill all they made, while a second wave kills sandboxes of
// other goroutines as they appear. Run with -race: the orchestrator's maps, entries and
// operations are shared by all of them. At the end nothing is left: no entry, no
// instance, no record, no captured snapshot, no operation in flight.
func TestConcurrent64CreatesForksKills(t *testing.T) {
	const workers, children = 64, 2
	for _, mode := range snapModes {
		t.Run(mode.name, func(t *testing.T) {
			// 64 fake envds answering at once under the race detector on a busy
			// machine: the harness's 2 s readiness timeout is for one sandbox.
			h := newHarness(t, mode.opts, func(c *Config) { c.EnvdReadyTimeout = time.Minute })
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
			defer cancel()
			created := make(chan string, workers*(children+1))
			errs := make(chan error, workers*4)
			var wg sync.WaitGroup
			start := make(chan struct{})
			for w := range workers {
				wg.Add(1)
				go func() {
					defer wg.Done()
					<-start
					sb, err := h.o.Create(ctx, CreateRequest{TemplateID: "base", Secure: true, Timeout: time.Hour})
					if err != nil {
						errs <- fmt.Errorf("worker %d: create: %w", w, err)
						return
					}
					ids := []string{sb.ID}
					if w%2 == 0 {
						res, err := h.o.Fork(ctx, sb.ID, children, time.Hour)
						if err != nil {
							errs <- fmt.Errorf("worker %d: fork: %w", w, err)
						}
						for i, r := range res {
							if r.Err != nil || r.Sandbox == nil {
								errs <- fmt.Errorf("worker %d: fork child %d: %v", w, i, r.Err)
								continue
							}
							ids = append(ids, r.Sandbox.ID)
						}
					}
					for _, id := range ids {
						if err := answers(ctx, h, id); err != nil {
							errs <- fmt.Errorf("worker %d: %w", w, err)
						}
						created <- id
					}
					// Odd workers kill their own sandboxes; the others' are killed by
					// the killers below, concurrently with creates and forks.
					if w%2 == 1 {
						for _, id := range ids {
							if err := h.o.Kill(ctx, id); err != nil && !errors.Is(err, ErrNotFound) {
								errs <- fmt.Errorf("worker %d: kill %s: %w", w, id, err)
							}
						}
					}
				}()
			}
			var killers sync.WaitGroup
			for range 8 {
				killers.Add(1)
				go func() {
					defer killers.Done()
					for id := range created {
						// Kill races the owner's kill for odd workers: both outcomes are fine.
						if err := h.o.Kill(ctx, id); err != nil && !errors.Is(err, ErrNotFound) && !errors.Is(err, ErrConflict) {
							errs <- fmt.Errorf("kill %s: %w", id, err)
						}
					}
				}()
			}
			close(start)
			wg.Wait()
			close(created)
			killers.Wait()
			close(errs)
			for err := range errs {
				t.Error(err)
			}
			// A kill that lost a race (ErrConflict) leaves the winner's kill to finish.
			eventually(t, "every sandbox gone", func() bool {
				h.o.mu.Lock()
				defer h.o.mu.Unlock()
				return len(h.o.entries) == 0
			})
			if live := h.b.Live(); len(live) != 0 {
				t.Errorf("backend instances left: %v", live)
			}
			if a := h.b.Artifacts(); len(a) != 0 {
				t.Errorf("paused artifacts left: %v", a)
			}
			recs, err := h.cat.Sandboxes().All()
			if err != nil {
				t.Fatal(err)
			}
			if len(recs) != 0 {
				t.Errorf("%d sandbox records left", len(recs))
			}
		})
	}
}
