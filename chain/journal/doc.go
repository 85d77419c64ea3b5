// Package journal is the durable memory of settlements: one record per payment, keyed by a deterministic
// PaymentID, claimed before anything is broadcast so that concurrent or repeated /settle calls for one payment
// lead to one transaction, then carrying the broadcast hash and finally the outcome. On start-up, package chain
// reconciles every record that Pending lists with the chain before it accepts new work.
//
// The Store interface is small so that a distributed store can stand in for the embedded one: OpenBolt is the
// default (a single bbolt file, fsynced on every commit, with group commit so concurrent writers share fsyncs),
// NewMemory keeps the same semantics in memory for tests and for a dev chain, and OpenPostgres keeps them in a
// PostgreSQL database that several processes share, adding what they must agree on (Cluster: live instances,
// busy marks, fenced wallet leases, holds against a payer's funds), directly or through a connection pooler in
// transaction mode (postgres_pooler.go): it keeps no state in a database session between transactions.
//
// Every store keeps batch-settlement channels too (Channels, channel.go): one row per channel, whose cumulative
// amount each accepted voucher advances by a compare-and-set, and which a claim is marked sent on before it is
// broadcast.
//
// It must never import package chain, talk to a node, or know anything of HTTP or Caddy: it stores what it is
// told, atomically, and refuses transitions that would lose a broadcast transaction.
package journal
