package journal

import (
	"context"
	"testing"
	"time"
)

func TestStoreBindsAPaymentIdentifierToOnePaymentSharedAcrossReopensAndPrunedWithIt(t *testing.T) {
	forEachStore(t, func(t *testing.T, h harness) {
		clock := newTestClock()
		s := h.open(t, clock.Now)
		ctx := context.Background()
		first, second, third := claimOf(40).ID, claimOf(41).ID, claimOf(42).ID
		name := func(key string, id, replacing ID) ID {
			t.Helper()
			named, err := s.(PaymentIdentifiers).NamePayment(ctx, key, id, replacing)
			if err != nil {
				t.Fatalf("NamePayment(%s, %s): %v", key, id, err)
			}
			return named
		}
		if got := name("payer/pay_0123456789abcdef", first, ID{}); got != first {
			t.Fatalf("a new id named %s, want %s", got, first)
		}
		if got := name("payer/pay_0123456789abcdef", first, ID{}); got != first {
			t.Fatalf("the same id for the same payment named %s, want %s", got, first)
		}
		if got := name("payer/pay_0123456789abcdef", second, ID{}); got != first {
			t.Fatalf("the same id for another payment named %s, want the first payment %s unchanged", got, first)
		}
		if got := name("other/pay_0123456789abcdef", second, ID{}); got != second {
			t.Fatalf("the id under another key named %s, want %s", got, second)
		}
		if got := name("payer/pay_0123456789abcdef", second, third); got != first {
			t.Fatalf("replacing a payment the id is not bound to named %s, want %s", got, first)
		}

		s = h.reopen(t, s)
		if id, ok, err := s.(PaymentIdentifiers).NamedPayment(ctx, "payer/pay_0123456789abcdef"); err != nil || !ok || id != first {
			t.Fatalf("after a reopen NamedPayment = %s, %v, %v; want %s", id, ok, err, first)
		}
		if got := name("payer/pay_0123456789abcdef", second, first); got != second {
			t.Fatalf("replacing the payment the id is bound to named %s, want %s", got, second)
		}

		// second has a final record, kept; the other key's payment has none and is pruned once past the cutoff.
		mustClaim(t, s, claimOf(41))
		mustUpdate(t, s, second, toFinal(true))
		clock.Advance(time.Hour)
		if _, err := s.Prune(ctx, clock.Now().Add(-2*time.Hour)); err != nil {
			t.Fatal(err)
		}
		if _, ok, _ := s.(PaymentIdentifiers).NamedPayment(ctx, "other/pay_0123456789abcdef"); !ok {
			t.Fatal("a binding newer than the cutoff was pruned")
		}
		if _, err := s.Prune(ctx, clock.Now()); err != nil {
			t.Fatal(err)
		}
		if _, ok, _ := s.(PaymentIdentifiers).NamedPayment(ctx, "other/pay_0123456789abcdef"); ok {
			t.Error("a binding of a payment without a record outlived Prune")
		}
		if _, ok, _ := s.(PaymentIdentifiers).NamedPayment(ctx, "payer/pay_0123456789abcdef"); ok {
			t.Error("a binding outlived its payment's record, pruned")
		}
	})
}
