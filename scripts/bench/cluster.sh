#!/bin/bash
# Measures the journal's cost from outside, in one run, as issue 30 asks: one gateway on a bbolt journal, the same
# gateway on a PostgreSQL journal, then one and three gateways on one PostgreSQL behind a round-robin Caddy,
# each round settling on a fresh `caddy x402 devchain` (twelve wallets, a block as soon as transactions arrive), each round
# loaded by `caddy x402 bench` (distinct permit2 payments of the demo payer, the seller's balance checked).
#
#   go build -o /tmp/caddy ./cmd/caddy && scripts/bench/cluster.sh /tmp/caddy /tmp/cluster-out && scripts/bench/cluster_summary.py /tmp/cluster-out
#
# Rounds are short (300 and 600 requests) so that no payment expires on a chain running ahead (see devchain).
# Needs PostgreSQL's initdb and pg_ctl (run as the postgres user when run as root); uses ports 18645 (chain),
# 15432 (PostgreSQL), 18181-18183 (gateways) and 18180 (the balancer) on 127.0.0.1. X402_BENCH_CLIENT loads with
# another binary's `caddy x402 bench` (the same client for two builds).
set -eu
BIN=$1; D=$2
source "$(dirname "$0")/cluster_lib.sh"

# One gateway on bbolt, then on PostgreSQL, loaded directly.
for journal in bbolt postgres; do
	devchain
	if [ $journal = bbolt ]; then gateway 1 "$D/journal.db"; else gateway 1 "$DSN"; fi
	wait402 http://127.0.0.1:18181/
	sleep 2
	bench "warm-$journal" 4 40 http://127.0.0.1:18181/
	bench "one-$journal-c8" 8 "$N8" http://127.0.0.1:18181/
	bench "one-$journal-c32" 32 "$N32" http://127.0.0.1:18181/
	stop_all
done
# One and three gateways on PostgreSQL behind the balancer.
for n in 1 3; do
	devchain
	for i in $(seq 1 $n); do gateway "$i" "$DSN"; done
	for i in $(seq 1 $n); do wait402 "http://127.0.0.1:1818$i/"; done
	balancer $n
	wait402 http://127.0.0.1:18180/
	sleep 5 # the wallet leases shared out
	bench "warm-lb$n" 4 40 http://127.0.0.1:18180/
	bench "lb$n-postgres-c32" 32 "$N32" http://127.0.0.1:18180/
	stop_all
done
