#!/usr/bin/env python3
"""Summarizes scripts/bench/cpu.sh's folders: each round's ok/s and the CPU milliseconds a 200 cost, by process."""
import json
import os
import sys

HZ = os.sysconf('SC_CLK_TCK')


def ticks(path):
    with open(path) as f:
        return {k: int(v) for k, v in (line.split() for line in f if line.strip())}


for d in sys.argv[1:]:
    print('##', d)
    for name in sorted(os.listdir(d)):
        if not name.startswith('cpu-before-'):
            continue
        k = name[len('cpu-before-'):]
        before, after = ticks(os.path.join(d, name)), ticks(os.path.join(d, 'cpu-after-' + k))
        before.update(ticks(os.path.join(d, 'cpu-bench0-' + k)))
        after.update(ticks(os.path.join(d, 'cpu-bench-' + k)))
        with open(os.path.join(d, 'one-' + k + '.json')) as f:
            r = json.load(f)
        ok = r['ok'] or 1
        kinds = ['gw', 'chain', 'bench'] + sorted(n for n in set(before) | set(after) if n.startswith('pg'))
        ms = {n: (after.get(n, 0) - before.get(n, 0)) * 1000.0 / HZ / ok for n in kinds}
        parts = ' '.join('%s %.2f' % (n, v) for n, v in ms.items() if n in ('gw', 'chain', 'bench', 'pgbackend') or v >= 0.05)
        print('%s: ok/s %.0f, CPU ms a 200: %s, total %.2f' % (k, r['ok_per_second'], parts, sum(ms.values())))
