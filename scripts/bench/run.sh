#!/bin/bash
# Measures a Caddy binary from outside, as docs/BENCHMARKS.md reports it: one fresh Caddy with an embedded dev
# chain (scripts/bench/Caddyfile: a free route, a paid route settling after the upstream, the same settling
# async, the same paid by batch-settlement vouchers, and the facilitator), loaded by `caddy x402 bench` (another
# process) at concurrency 1, 8 and 32, and POST /facilitator/verify loaded by wrk at 8 connections with 200
# distinct valid bodies of one payer. The batch route's runs are longer (1000, 3000 and 8000 requests): each of
# the C callers opens a channel of its own by a deposit, a transaction, and a route's channels serve many
# requests, so that the transactions per 100 requests are the claims' and a few deposits'.
#
#   go build -o /tmp/caddy ./cmd/caddy && scripts/bench/run.sh /tmp/caddy /tmp/bench-out && scripts/bench/summary.py /tmp/bench-out
#
# Needs wrk (Debian: apt-get install wrk) and python3; uses ports 18080, 18545 and 12019 on 127.0.0.1. The load
# comes from the binary given, or from X402_BENCH_CLIENT (a binary with `caddy x402 bench`, to load an older
# Caddy with the same client).
set -eu
BIN=$1; D=$2; HERE=$(cd "$(dirname "$0")" && pwd)
rm -rf "$D"; mkdir -p "$D"
. "$HERE/bench_lib.sh"
trap 'kill -INT $CADDY_PID 2>/dev/null; wait $CADDY_PID 2>/dev/null || true' EXIT
start_caddy "$BIN" "$D"
CLIENT=${X402_BENCH_CLIENT:-$BIN}
B="$CLIENT x402 bench --dev --rpc http://127.0.0.1:18545 --json"
# bench exits non-zero when a request failed (a figure this script reports), when the seller's balance does not
# match, and when it could make no run (which stop the script): bench FILE ARGS runs it with its report in FILE.
bench() {
	local out=$1; shift
	$B "$@" > "$out" 2>/dev/null || python3 -c 'import json, sys; sys.exit(json.load(open(sys.argv[1])).get("balance_ok") is False)' "$out" 2>/dev/null ||
		{ echo "bench $*: no report, or the seller's balance does not match what was served" >&2; exit 1; }
}
bench "$D/warm-up.json" -c 1 -n 20 http://127.0.0.1:18080/paid/index.html # and the demo payer's Permit2 approval
for c in 1 8 32; do
	n=$((c == 1 ? 300 : (c == 8 ? 1000 : 2000)))
	bench "$D/free-c$c.json" -c $c -n $n http://127.0.0.1:18080/free/index.html
	for route in sync:paid async:async; do
		name=${route%%:*}; path=${route##*:}
		a=$(wc -l < "$D/caddy.log")
		bench "$D/$name-c$c.json" -c $c -n $n "http://127.0.0.1:18080/$path/index.html"
		b=$(wc -l < "$D/caddy.log")
		sed -n "$((a + 1)),${b}p" "$D/caddy.log" > "$D/$name-c$c.log" # the gate's log lines of this run
	done
	# The free route again beside the batch route, then the batch route: one deposit a caller, vouchers after,
	# the seller's balance waited for until the engine's claim (claim_after 2s) shows every 2xx paid.
	nb=$((c == 1 ? 1000 : (c == 8 ? 3000 : 8000)))
	bench "$D/free-batch-c$c.json" -c $c -n $nb http://127.0.0.1:18080/free/index.html
	a=$(wc -l < "$D/caddy.log")
	bench "$D/batch-c$c.json" -c $c -n $nb http://127.0.0.1:18080/batch/index.html
	b=$(wc -l < "$D/caddy.log")
	sed -n "$((a + 1)),${b}p" "$D/caddy.log" > "$D/batch-c$c.log"
	curl -s http://127.0.0.1:18080/facilitator/health > "$D/health-after-c$c.json"
done
# 200 distinct payments of the demo payer, each as a /verify body
mkdir -p "$D/bodies"
for i in $(seq 1 200); do
	"$CLIENT" x402 pay --dev --rpc http://127.0.0.1:18545 --sign-only http://127.0.0.1:18080/paid/index.html > "$D/bodies/$i.txt" 2>/dev/null
done
python3 "$HERE/verify_lua.py" "$D/bodies" "$HERE/verify.lua.tail" > "$D/verify.lua"
wrk -t 2 -c 8 -d 10s -s "$D/verify.lua" http://127.0.0.1:18080 > "$D/verify-wrk.txt" 2>&1
