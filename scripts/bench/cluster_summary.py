#!/usr/bin/env python3
"""Tabulates scripts/bench/cluster.sh runs: ok/s and p50 of each round, and the ratios issue 30 targets."""
import json, os, sys

ROUNDS = ["one-bbolt-c8", "one-postgres-c8", "one-bbolt-c32", "one-postgres-c32", "lb1-postgres-c32", "lb3-postgres-c32"]


def load(d, name):
    try:
        with open(os.path.join(d, name + ".json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def find(obj, *keys):
    for k in keys:
        if isinstance(obj, dict) and k in obj:
            return obj[k]
    return None


for d in sys.argv[1:]:
    print(f"## {d}")
    got = {}
    for r in ROUNDS:
        j = load(d, r)
        if j is None:
            print(f"{r}: no report")
            continue
        ok = find(j, "ok_per_second", "ok_per_sec", "throughput")
        got[r] = ok
        print(f"{r}: ok/s {ok}, ok {find(j, 'ok')}, failed {find(j, 'failed')}, p50 ms {(j.get('latency_ms') or {}).get('p50')}, seller_delta {j.get('seller_delta')} expected {j.get('expected_delta')}")
    def ratio(a, b):
        return f"{got[a] / got[b]:.2f}" if got.get(a) and got.get(b) else "n/a"
    print(f"postgres/bbolt c8: {ratio('one-postgres-c8', 'one-bbolt-c8')}; c32: {ratio('one-postgres-c32', 'one-bbolt-c32')}; "
          f"three/one on postgres (balancer, c32): {ratio('lb3-postgres-c32', 'lb1-postgres-c32')}")
