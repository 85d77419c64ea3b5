package gate

import (
	"context"
	"time"

	"go.uber.org/zap"
)

// asyncSettleMargin is how long a settle async payment's authorization must stay valid, past the earliest time
// its settlement can be mined at, for the gate to serve it before settling it. The engine refuses to settle a
// deadline closer than 6 s to that time (a permit that expires in flight costs gas for nothing), and the
// background settlement may wait its turn behind a backlog, or retry a facilitator out of reach, for a while
// after serving: a payment served with less room may be refused as expiring once served, and its resource go
// unpaid. It is settled before it is served instead, as settle after does. A payer signing for an offer's
// max_timeout (5 minutes by default) has minutes of room.
const asyncSettleMargin = time.Minute

// nextBlockTimer is a facilitator that knows the earliest time a settlement sent now can be mined at on a
// network (the embedded engine: one second past the head block's, and no earlier than its clock), the time it
// judges a payment's deadline by.
type nextBlockTimer interface {
	NextBlockTime(ctx context.Context, network string) (time.Time, error)
}

// roomToSettleAfterServing reports whether the payment's authorization stays valid asyncSettleMargin past the
// earliest time its settlement can be mined at: judged by the embedded engine's chain time (the next block's),
// and by the gate's clock for a remote facilitator, which the gate cannot ask. When it does not, or the engine
// cannot tell its chain time (its node out of reach: the gate's clock may lie minutes behind a chain that runs
// ahead), the payment is logged and the caller settles it before serving it.
func (x *exchange) roomToSettleAfterServing() bool {
	deadline := x.req.PaymentPayload.SettlementDeadline()
	if deadline.IsZero() {
		return true // no deadline the gate can read: the facilitator judged the payment, and its settlement will
	}
	at := x.g.now()
	if c, ok := x.g.fac.(nextBlockTimer); ok && x.g.cfg.Embedded {
		// A chain that seals on demand (a dev chain) runs ahead of the wall clock under load.
		next, err := c.NextBlockTime(x.r.Context(), x.req.PaymentRequirements.Network)
		if err != nil {
			if x.r.Context().Err() == nil {
				x.g.logger.Info("settle async: the engine could not tell its chain time, which the payment's room to settle after serving is judged by; settling it before serving it",
					zap.String("payment", x.id.String()), zap.String("payer", x.payer), zap.Time("deadline", deadline), zap.String("error", x.g.describe(err)))
			}
			return false
		}
		if next.After(at) {
			at = next
		}
	}
	if !deadline.Before(at.Add(asyncSettleMargin)) {
		return true
	}
	x.g.logger.Info("settle async: the payment's authorization expires too soon to be settled after serving; settling it before serving it",
		zap.String("payment", x.id.String()), zap.String("payer", x.payer), zap.Time("deadline", deadline),
		zap.Time("settles_at", at), zap.Duration("margin", asyncSettleMargin))
	return false
}
