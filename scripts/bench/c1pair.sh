#!/bin/bash
# Issue 31's c1 bar, two builds alternating: per round, a fresh Caddy of each build on scripts/bench/Caddyfile
# (its own `caddy x402 bench` as the client), `/free/` then `/batch/` at concurrency 1 (1,000 requests each),
# twice; prints each pair's p50s and the batch route's p50 above the free route's, then their mean and median a
# build. Uses the ports of scripts/bench/Caddyfile.
#
#   scripts/bench/c1pair.sh /tmp/caddy-before /tmp/caddy-after /tmp/c1pair 6
set -u
A=$1; B=$2; D=$3; R=${4:-6}
HERE=$(cd "$(dirname "$0")" && pwd)
. "$HERE/bench_lib.sh"
rm -rf "$D"; mkdir -p "$D"
p50() { python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(d['latency_ms']['p50'] if d['ok']==d['requests'] else 'FAIL')" "$1"; }
one() { # BIN TAG ROUND
	local bin=$1 tag=$2 r=$3 dd=$D/$2-$3
	mkdir -p "$dd"
	start_caddy "$bin" "$dd" || return
	local pid=$CADDY_PID
	local bench="$bin x402 bench --dev --rpc http://127.0.0.1:18545 --json"
	for k in 1 2; do
		$bench -c 1 -n 1000 http://127.0.0.1:18080/free/index.html > "$dd/free-$k.json" 2>/dev/null
		$bench -c 1 -n 1000 http://127.0.0.1:18080/batch/index.html > "$dd/batch-$k.json" 2>/dev/null
		f=$(p50 "$dd/free-$k.json"); b=$(p50 "$dd/batch-$k.json")
		echo "$r $tag free $f batch $b above $(python3 -c "print(round($b-$f,3))")"
	done
	kill -INT $pid; wait $pid 2>/dev/null
}
for r in $(seq 1 "$R"); do one "$A" A "$r"; one "$B" B "$r"; done | tee "$D/summary"
python3 - "$D/summary" <<'PY'
import statistics, sys
d = {'A': [], 'B': []}
for line in open(sys.argv[1]):
    p = line.split()
    d[p[1]].append(float(p[-1]))
for k, v in d.items():
    if v:
        print(k, 'mean', round(statistics.mean(v), 3), 'median', round(statistics.median(v), 3), v)
PY
