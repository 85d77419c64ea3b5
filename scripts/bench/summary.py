#!/usr/bin/env python3
"""Summarises the runs of scripts/bench/run.sh: per route and concurrency, ok/requests, ok/s, client latency,
the seller's balance check, and the gate's own verify/settle timings (p50 of its "payment" log lines)."""
import json, statistics, sys

for d in sys.argv[1:]:
    print(d)
    for kind in ['free', 'sync', 'async']:
        for c in [1, 8, 32]:
            j = json.load(open(f'{d}/{kind}-c{c}.json'))
            line = (f"  {kind:5} c={c:<2} {j['ok']}/{j['requests']} ok, {j['ok_per_second']:.0f}/s, "
                    f"p50 {j['latency_ms']['p50']:.2f} ms p90 {j['latency_ms']['p90']:.2f} ms")
            if kind != 'free':
                line += f", seller +{j['seller_delta']} (balance ok: {j['balance_ok']})"
                v, s = [], []
                for l in open(f'{d}/{kind}-c{c}.log'):
                    if '"msg":"payment"' in l:
                        e = json.loads(l)
                        v.append(e.get('verify_ms', 0))
                        s.append(e.get('settle_ms', 0))
                if v:
                    line += f"; gate: verify p50 {statistics.median(v):.3f} ms"
                    if kind == 'sync':
                        line += f", settle p50 {statistics.median(s):.3f} ms"
            print(line)
    # The batch route against the free route run just before it, at the same concurrency and number of requests.
    for c in [1, 8, 32]:
        try:
            j, f = json.load(open(f'{d}/batch-c{c}.json')), json.load(open(f'{d}/free-batch-c{c}.json'))
        except FileNotFoundError:
            continue
        b = j.get('batch') or {}
        s = []
        for l in open(f'{d}/batch-c{c}.log'):
            if '"msg":"payment"' in l:
                s.append(json.loads(l).get('settle_ms', 0))
        line = (f"  batch c={c:<2} {j['ok']}/{j['requests']} ok, {j['ok_per_second']:.0f}/s = {j['ok_per_second'] / f['ok_per_second']:.2f}x free's "
                f"{f['ok_per_second']:.0f}/s; p50 {j['latency_ms']['p50']:.3f} ms vs free {f['latency_ms']['p50']:.3f} ms "
                f"(+{j['latency_ms']['p50'] - f['latency_ms']['p50']:.3f}); {b.get('deposits')} deposits, {b.get('vouchers')} vouchers, "
                f"{b.get('transactions')} transactions = {b.get('transactions_per_100_requests') or 0:.2f} per 100 requests; "
                f"seller +{j['seller_delta']} (balance ok: {j['balance_ok']})")
        if s:
            line += f"; gate: voucher accept p50 {statistics.median(s):.3f} ms"
        print(line)
    h = json.load(open(f'{d}/health-after-c32.json'))
    print('  journal backlog after the c=32 runs:', [n.get('journalBacklog') for n in h.get('networks', [])])
    print('  /facilitator/verify (wrk -t 2 -c 8):', open(f'{d}/verify-wrk.txt').read().strip().splitlines()[-1])
