package caddymodule

import (
	"context"
	"errors"
	"fmt"
	"os/exec"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"go.uber.org/zap"
)

func init() {
	caddy.RegisterModule(EventsExec{})
}

// Bounds of EventsExec: commands running at once, events waiting for one of them, and the default time a
// command may run before it is killed.
const (
	execRunning        = 16
	execWaiting        = 1024
	execDefaultTimeout = time.Minute
)

// EventsExec (events.handlers.x402_exec) runs a command for each event it is subscribed to, such as a script
// told of every sale: `on payment_settled x402_exec ./notify-sale.sh {event.data.payer} {event.data.amount}`.
// Caddy's standard build has no events handler, and the payment events are of no use without one.
//
// The command runs in the background, never holding up the paid request that emitted the event: at most 16
// at once, with up to 1024 more events waiting; past that an event's command is not run and an error is
// logged. Its arguments are replaced with the event's placeholders ({event.name}, {event.data.payer},
// {event.data.transaction}, ...). No shell reads them: a value is one argument, whatever it holds. Its output
// and a non-zero exit are logged; a command still running after its timeout (default 1m) is killed.
type EventsExec struct {
	// Command is the program to run (a path, or a name looked up in PATH).
	Command string `json:"command"`
	// Args are its arguments, placeholders replaced for each event.
	Args []string `json:"args,omitempty"`
	// Timeout bounds each run; default 1m.
	Timeout caddy.Duration `json:"timeout,omitempty"`

	logger *zap.Logger
	queue  chan []string // argument lists waiting for a free runner
}

// CaddyModule returns the module information.
func (EventsExec) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{ID: "events.handlers.x402_exec", New: func() caddy.Module { return new(EventsExec) }}
}

// Provision checks the command and starts the runners, which stop when the config is unloaded.
func (h *EventsExec) Provision(ctx caddy.Context) error {
	h.logger = ctx.Logger()
	if h.Command == "" {
		return errors.New("x402_exec: no command")
	}
	if h.Timeout < 0 {
		return fmt.Errorf("x402_exec: timeout %s is negative", time.Duration(h.Timeout))
	}
	if h.Timeout == 0 {
		h.Timeout = caddy.Duration(execDefaultTimeout)
	}
	h.queue = make(chan []string, execWaiting)
	for range execRunning {
		go h.runner(ctx)
	}
	return nil
}

// Handle queues the command for the event, with its arguments replaced now, while the event's placeholders
// are in ctx.
func (h *EventsExec) Handle(ctx context.Context, e caddy.Event) error {
	repl, _ := ctx.Value(caddy.ReplacerCtxKey).(*caddy.Replacer)
	if repl == nil {
		repl = caddy.NewReplacer()
	}
	argv := make([]string, 0, 1+len(h.Args))
	argv = append(argv, repl.ReplaceAll(h.Command, ""))
	for _, a := range h.Args {
		argv = append(argv, repl.ReplaceAll(a, ""))
	}
	select {
	case h.queue <- argv:
		return nil
	default:
		// An events handler's error is logged by the events app, naming the event.
		return fmt.Errorf("x402_exec: %d commands already wait for %s, not run for event %s", execWaiting, h.Command, e.Name())
	}
}

// runner runs queued commands one at a time until the config is unloaded, and then the commands still
// waiting, so that a reload loses no event's command.
func (h *EventsExec) runner(ctx caddy.Context) {
	for {
		select {
		case <-ctx.Done():
			for {
				select {
				case argv := <-h.queue:
					h.run(argv)
				default:
					return
				}
			}
		case argv := <-h.queue:
			h.run(argv)
		}
	}
}

func (h *EventsExec) run(argv []string) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Duration(h.Timeout))
	defer cancel()
	start := time.Now()
	out, err := exec.CommandContext(ctx, argv[0], argv[1:]...).CombinedOutput()
	if len(out) > 4096 {
		out = append(out[:4096:4096], "..."...)
	}
	if err != nil {
		h.logger.Error("x402_exec: the command failed", zap.String("command", argv[0]), zap.Error(err),
			zap.Duration("took", time.Since(start)), zap.ByteString("output", out))
		return
	}
	h.logger.Debug("x402_exec: the command ran", zap.String("command", argv[0]),
		zap.Duration("took", time.Since(start)), zap.ByteString("output", out))
}

// UnmarshalCaddyfile reads
//
//	x402_exec <command> [<args...>] [{
//		timeout <duration>
//	}]
func (h *EventsExec) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	d.Next() // the module's name
	if !d.NextArg() {
		return d.ArgErr()
	}
	h.Command = d.Val()
	h.Args = d.RemainingArgs()
	for d.NextBlock(0) {
		switch d.Val() {
		case "timeout":
			if !d.NextArg() {
				return d.ArgErr()
			}
			dur, err := caddy.ParseDuration(d.Val())
			if err != nil {
				return d.Errf("timeout %q: %v", d.Val(), err)
			}
			h.Timeout = caddy.Duration(dur)
			if d.NextArg() {
				return d.ArgErr()
			}
		default:
			return d.Errf("unknown option %q of x402_exec (known: timeout)", d.Val())
		}
	}
	return nil
}

// Interface guards.
var (
	_ caddy.Provisioner     = (*EventsExec)(nil)
	_ caddyfile.Unmarshaler = (*EventsExec)(nil)
)
