#!/bin/bash
# Measures where a paid request's CPU goes, by process, from outside: one gateway on a bbolt journal and then on a
# PostgreSQL one (as scripts/bench/cluster.sh's first rounds), each round loaded by `caddy x402 bench`, with the CPU
# time of the gateway, the dev chain, the bench client and PostgreSQL's backends read from /proc before and after
# the load. On a machine whose cores they all share, throughput is what the total a request allows.
#
#   go build -o /tmp/caddy ./cmd/caddy && scripts/bench/cpu.sh /tmp/caddy /tmp/cpu-out && scripts/bench/cpu_summary.py /tmp/cpu-out
#
# JOURNALS (bbolt postgres) and CS (8 32) choose the rounds; X402_BENCH_N8 and X402_BENCH_N32 their requests.
# PGSTAT=1 keeps pg_stat_statements' table of each PostgreSQL round (pgstat-cN.txt: calls, time, rows a statement).
# PGOPTS adds PostgreSQL server settings. Processes are told apart by their command lines, machine-wide: run it on a
# machine with no other gateway, chain or PostgreSQL at work. Ports as cluster.sh's.
set -eu
BIN=$1; D=$2
source "$(dirname "$0")/cluster_lib.sh"

# cpu prints "NAME TICKS" for each kind of process: gw, chain, bench, pgbackend (a session), pg-<kind> (PostgreSQL's
# own: walwriter, checkpointer, ...).
cpu() {
	for p in /proc/[0-9]*; do
		c=$( { tr '\0' ' ' < "$p/cmdline"; } 2>/dev/null) || continue
		t=$(awk '{print $14+$15}' "$p/stat" 2>/dev/null) || continue
		case "$c" in
		*"x402 devchain"*) echo "chain $t" ;;
		*"x402 bench"*) echo "bench $t" ;;
		*"run --config"*) echo "gw $t" ;;
		"postgres: postgres postgres"*) echo "pgbackend $t" ;;
		postgres:*) echo "pg-$(echo "$c" | awk '{print $2}') $t" ;;
		esac
	done | awk '{a[$1]+=$2} END {for (k in a) print k, a[k]}' | sort
}
# children is what this shell's waited-for children used: the bench of a round runs as one, and its CPU is read so.
children() { awk '{print "bench", $16+$17}' /proc/$$/stat; }
pgstat() { psql "$DSN" -X -A "$@"; }

for journal in ${JOURNALS:-bbolt postgres}; do
	devchain
	if [ "$journal" = bbolt ]; then gateway 1 "$D/journal.db"; else gateway 1 "$DSN"; fi
	wait402 http://127.0.0.1:18181/
	if [ "$journal" = postgres ] && [ -n "${PGSTAT:-}" ]; then
		pgstat -c "create extension if not exists pg_stat_statements" > /dev/null
	fi
	sleep 2
	bench "warm-$journal" 4 40 http://127.0.0.1:18181/
	for c in ${CS:-8 32}; do
		n=$N32; [ "$c" = 8 ] && n=$N8
		k=$journal-c$c
		if [ "$journal" = postgres ] && [ -n "${PGSTAT:-}" ]; then pgstat -c "select pg_stat_statements_reset()" > /dev/null; fi
		cpu > "$D/cpu-before-$k"; children > "$D/cpu-bench0-$k"
		( bench "one-$k" "$c" "$n" http://127.0.0.1:18181/ )
		children > "$D/cpu-bench-$k"; cpu > "$D/cpu-after-$k"
		if [ "$journal" = postgres ] && [ -n "${PGSTAT:-}" ]; then
			pgstat -F ' | ' -c "select calls, round(total_exec_time::numeric, 1) ms, round((total_exec_time / nullif(calls, 0))::numeric, 3) per, rows, left(regexp_replace(query, '\s+', ' ', 'g'), 160) q from pg_stat_statements order by total_exec_time desc limit 40" > "$D/pgstat-c$c.txt"
		fi
	done
	stop_all
done
