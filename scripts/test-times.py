#!/usr/bin/env python3
"""test-times.py reads `go test -json` output and prints where the time went: each package's total and the tests
that took longest (top-level tests; a subtest's time is in its parent's).

    go test -count=1 -json ./... > plain.json; scripts/test-times.py plain.json
    X402_RACE_PASS=1 go test -race -count=1 -json ./chain/... ./gate | scripts/test-times.py -n 50

The machine is usually shared: compare a test's share of its run, not its seconds, between runs under different
load. A package's total is its test binary's run (go test's own line), not its build; run the packages one at a
time (-p 1) to keep one's tests from slowing another's.
"""
import argparse
import json
import sys


def main():
    ap = argparse.ArgumentParser(description="where the time of a go test -json run went")
    ap.add_argument("files", nargs="*", help="go test -json output (default: standard input)")
    ap.add_argument("-n", type=int, default=30, help="how many tests to list (default 30)")
    args = ap.parse_args()

    packages, tests, outcomes = {}, {}, {}
    for line in read_lines(args.files):
        try:
            e = json.loads(line)
        except ValueError:
            continue
        action, pkg, test = e.get("Action"), e.get("Package", ""), e.get("Test")
        if action not in ("pass", "fail", "skip") or "Elapsed" not in e:
            continue
        if test is None:
            packages[pkg] = e["Elapsed"]
            outcomes[pkg] = action
        elif "/" not in test:
            tests[(pkg, test)] = (e["Elapsed"], action)

    total = sum(packages.values())
    print(f"{'package':<52} {'seconds':>9} {'share':>6}")
    for pkg, s in sorted(packages.items(), key=lambda kv: -kv[1]):
        print(f"{short(pkg):<52} {s:>9.1f} {100 * s / total if total else 0:>5.1f}% {outcomes[pkg]}")
    print(f"{'all packages':<52} {total:>9.1f}")
    print()
    print(f"the {args.n} longest tests")
    for (pkg, test), (s, action) in sorted(tests.items(), key=lambda kv: -kv[1][0])[: args.n]:
        print(f"{s:>8.1f} s {100 * s / total if total else 0:>5.1f}%  {short(pkg)} {test}{'' if action == 'pass' else ' (' + action + ')'}")


def read_lines(files):
    if not files:
        yield from sys.stdin
    for name in files:
        with open(name) as f:
            yield from f


def short(pkg):
    return pkg.replace("github.com/x402-gateway/caddy-x402", ".", 1)


if __name__ == "__main__":
    main()
