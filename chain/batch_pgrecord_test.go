package chain_test

import (
	"context"
	"math/big"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/x402-gateway/caddy-x402/chain"
	"github.com/x402-gateway/caddy-x402/chain/journal"
	"github.com/x402-gateway/caddy-x402/chain/journal/pgtest"
)

// On PostgreSQL a voucher's step and its record are one statement: a record the database will not write (here a
// trigger refusing every insert into x402_records, standing in for a database stopped between the two) leaves the
// channel where it was, nothing charged, and the voucher presented again once the database writes is accepted with
// its record. Before, the step was taken alone and the record written after it: the voucher stood accepted with no
// record, and once the channel's next voucher was accepted it could never be served, its payer charged for a
// response it did not get (the money-invariant soak, seed 13349433749126242145, scarce: a lane's voucher answered
// "accepted, but its record was not written", its next voucher paid ahead of it, the first then refused).
func TestOnPostgresAVoucherIsNeverAcceptedWithoutItsRecord(t *testing.T) {
	dsn := pgtest.Shared(t)
	b := newBatchRoute(t, fixtureOpts{journal: openPostgres(t, dsn)})
	b.deposit(t, 10*batchPrice)
	if resp := settleBatch(t, b.fx.f, b.voucher(b.rq, batchPrice)); !resp.Success {
		t.Fatalf("the first voucher: %+v", resp)
	}
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	if _, err := conn.Exec(ctx, `CREATE FUNCTION x402_test_refuse_records() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN RAISE EXCEPTION 'the test refuses every record'; END $$;
CREATE TRIGGER x402_test_refuse_records BEFORE INSERT ON x402_records FOR EACH ROW EXECUTE FUNCTION x402_test_refuse_records()`); err != nil {
		t.Fatal(err)
	}
	second := b.voucher(b.rq, 2*batchPrice)
	if resp, err := b.fx.f.SettleBatch(ctx, second); err == nil && resp.Success {
		t.Fatalf("the second voucher, its record refused: %+v; want it not accepted", resp)
	}
	if row := b.row(t, b.fx.journal); row.Charged.Int64() != batchPrice {
		t.Fatalf("the channel's row after the second voucher's record was refused: charged %v; want %d (the step not taken without its record)", row.Charged, batchPrice)
	}
	if _, err := conn.Exec(ctx, `DROP TRIGGER x402_test_refuse_records ON x402_records`); err != nil {
		t.Fatal(err)
	}
	if resp := settleBatch(t, b.fx.f, second); !resp.Success {
		t.Fatalf("the second voucher presented again once the database writes: %+v", resp)
	}
	if row := b.row(t, b.fx.journal); row.Charged.Int64() != 2*batchPrice {
		t.Fatalf("the channel's row after the second voucher: charged %v; want %d", row.Charged, 2*batchPrice)
	}
	id := chain.BatchVoucherID(b.fx.net, b.id, big.NewInt(2*batchPrice))
	if rec, ok, err := b.fx.journal.Get(ctx, id); err != nil || !ok || rec.State != journal.StateFinal {
		t.Fatalf("the second voucher's record: %+v found %v (%v); want it final", rec, ok, err)
	}
}
