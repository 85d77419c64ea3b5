#!/bin/bash
# Issue 31's c8 and c32 bars in steady state: one fresh Caddy on scripts/bench/Caddyfile, its own `caddy x402 bench`
# as the client, and per round, at concurrency 8 then 32, `/free/` then `/batch/` with the same number of requests
# (N8 and N32, default 20,000 and 40,000: seconds of load, where run.sh's 3,000 and 8,000 last a fraction of one,
# the batch run's one deposit a caller then a few per cent of it, not a fifth). Prints each pair's requests a second
# and their ratio; every report is kept in DIR. Uses the ports of scripts/bench/Caddyfile.
#
#   go build -o /tmp/caddy ./cmd/caddy && scripts/bench/steady.sh /tmp/caddy /tmp/steady 3
set -eu
BIN=$1; D=$2; R=${3:-3}; N8=${4:-20000}; N32=${5:-40000}
HERE=$(cd "$(dirname "$0")" && pwd)
rm -rf "$D"; mkdir -p "$D"
. "$HERE/bench_lib.sh"
trap 'kill -INT $CADDY_PID 2>/dev/null; wait $CADDY_PID 2>/dev/null || true' EXIT
start_caddy "$BIN" "$D"
B="$BIN x402 bench --dev --rpc http://127.0.0.1:18545 --json"
$B -c 8 -n 2000 http://127.0.0.1:18080/batch/index.html > "$D/warm-up.json" 2>/dev/null
for r in $(seq 1 "$R"); do
	for c in 8 32; do
		n=$N8; [ "$c" = 32 ] && n=$N32
		$B -c "$c" -n "$n" http://127.0.0.1:18080/free/index.html > "$D/free-c$c-$r.json" 2>/dev/null
		$B -c "$c" -n "$n" http://127.0.0.1:18080/batch/index.html > "$D/batch-c$c-$r.json" 2>/dev/null
		python3 - "$D/free-c$c-$r.json" "$D/batch-c$c-$r.json" "$c" "$r" <<'PY'
import json, sys
f, b = json.load(open(sys.argv[1])), json.load(open(sys.argv[2]))
x = b.get('batch') or {}
print(f"round {sys.argv[4]} c{sys.argv[3]}: free {f['ok_per_second']:.0f}/s ({f['ok']}/{f['requests']}), "
      f"batch {b['ok_per_second']:.0f}/s ({b['ok']}/{b['requests']}, {b['duration_seconds']:.2f} s, {x.get('deposits')} deposits, "
      f"{x.get('transactions_per_100_requests') or 0:.2f} transactions per 100, balance ok {b.get('balance_ok')}) "
      f"= {b['ok_per_second'] / f['ok_per_second']:.3f}x")
PY
	done
done
