package journal

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"
)

func TestStoreGrantsAccessOncePerPaymentSpendsNoncesOnceAndPrunesEndedGrants(t *testing.T) {
	forEachStore(t, func(t *testing.T, h harness) {
		clock := newTestClock()
		s := h.open(t, clock.Now)
		ctx := context.Background()
		first, second := claimOf(50).ID, claimOf(51).ID
		a := func() Access { return s.(Access) }
		until := clock.Now().Add(time.Hour)
		if err := a().GrantAccess(ctx, "route/payer", first, until, 2); err != nil {
			t.Fatal(err)
		}
		// The same payment recorded as served again grants nothing more.
		if err := a().GrantAccess(ctx, "route/payer", first, until, 2); err != nil {
			t.Fatal(err)
		}
		signIn := func(key, nonce string) (Grant, error) {
			t.Helper()
			return a().SignIn(ctx, key, nonce, clock.Now().Add(10*time.Minute), clock.Now())
		}
		if g, err := signIn("route/payer", "nonce-1"); err != nil || g.Uses != 1 {
			t.Fatalf("the first sign-in: %+v, %v; want 1 use left", g, err)
		}
		if _, err := signIn("route/payer", "nonce-1"); !errors.Is(err, ErrNonceUsed) {
			t.Fatalf("a nonce signing in again: %v, want ErrNonceUsed", err)
		}
		if _, err := signIn("route/other", "nonce-2"); !errors.Is(err, ErrNoGrant) {
			t.Fatalf("another payer's sign-in: %v, want ErrNoGrant", err)
		}
		s = h.reopen(t, s)
		if g, err := signIn("route/payer", "nonce-2"); err != nil || g.Uses != 0 {
			t.Fatalf("after a reopen, the second sign-in: %+v, %v; want 0 uses left (nonce-2 refused before spent nothing)", g, err)
		}
		if _, err := signIn("route/payer", "nonce-3"); !errors.Is(err, ErrGrantUsedUp) {
			t.Fatalf("past the grant's uses: %v, want ErrGrantUsedUp", err)
		}
		// A refused sign-in spent nothing: its nonce signs in once the payer pays again.
		if err := a().GrantAccess(ctx, "route/payer", second, until, 0); err != nil {
			t.Fatal(err)
		}
		if g, err := signIn("route/payer", "nonce-3"); err != nil || g.Uses != -1 || g.Payment != second {
			t.Fatalf("after another payment: %+v, %v; want unlimited uses bought by the second", g, err)
		}
		clock.Advance(time.Hour)
		if _, err := signIn("route/payer", "nonce-4"); !errors.Is(err, ErrGrantEnded) {
			t.Fatalf("at the grant's end: %v, want ErrGrantEnded", err)
		}
		if _, err := s.Prune(ctx, clock.Now().Add(-24*time.Hour)); err != nil {
			t.Fatal(err)
		}
		if _, ok, err := a().AccessGrant(ctx, "route/payer"); err != nil || ok {
			t.Fatalf("an ended grant outlived Prune: %v, %v", ok, err)
		}
		if err := a().GrantAccess(ctx, "route/payer", claimOf(52).ID, clock.Now().Add(time.Hour), 1); err != nil {
			t.Fatal(err)
		}
		if _, err := signIn("route/payer", "nonce-1"); err != nil {
			t.Fatalf("a nonce pruned past its time: %v, want it taken (its sign-in is refused as too old before it gets here)", err)
		}
	})
}

// A payment presented again after other payments extended its payer's grant (its first response cut short after
// its grant was written) grants nothing more: each payment's uses count once.
func TestAPaymentGrantsOnceWhateverGrantedSince(t *testing.T) {
	forEachStore(t, func(t *testing.T, h harness) {
		clock := newTestClock()
		s := h.open(t, clock.Now)
		ctx := context.Background()
		a, b := claimOf(60).ID, claimOf(61).ID
		until := clock.Now().Add(time.Hour)
		for _, p := range []ID{a, b, a, b, a} {
			if err := s.(Access).GrantAccess(ctx, "route/payer", p, until, 2); err != nil {
				t.Fatal(err)
			}
		}
		if g, ok, err := s.(Access).AccessGrant(ctx, "route/payer"); err != nil || !ok || g.Uses != 4 {
			t.Fatalf("two payments of 2 uses each, granted again and again: %+v, %v, %v; want 4 uses", g, ok, err)
		}
		// Still so past the grant's end, once pruned, and after a reopen.
		clock.Advance(2 * time.Hour)
		if _, err := s.Prune(ctx, clock.Now().Add(-24*time.Hour)); err != nil {
			t.Fatal(err)
		}
		s = h.reopen(t, s)
		if err := s.(Access).GrantAccess(ctx, "route/payer", a, clock.Now().Add(time.Hour), 2); err != nil {
			t.Fatal(err)
		}
		if _, ok, err := s.(Access).AccessGrant(ctx, "route/payer"); err != nil || ok {
			t.Fatalf("a payment that granted before granted again once its grant ended: %v, %v", ok, err)
		}
	})
}

func TestOneNonceSignsInOnceWhenPresentedAtOnce(t *testing.T) {
	forEachStore(t, func(t *testing.T, h harness) {
		clock := newTestClock()
		s := h.open(t, clock.Now)
		ctx := context.Background()
		if err := s.(Access).GrantAccess(ctx, "route/payer", claimOf(60).ID, clock.Now().Add(time.Hour), 0); err != nil {
			t.Fatal(err)
		}
		var (
			wg sync.WaitGroup
			mu sync.Mutex
			ok int
		)
		for i := 0; i < 8; i++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				_, err := s.(Access).SignIn(ctx, "route/payer", "the-nonce", clock.Now().Add(time.Minute), clock.Now())
				if err == nil {
					mu.Lock()
					ok++
					mu.Unlock()
				} else if !errors.Is(err, ErrNonceUsed) {
					t.Error(err)
				}
			}()
		}
		wg.Wait()
		if ok != 1 {
			t.Fatalf("%d sign-ins of one nonce let in, want 1", ok)
		}
	})
}
