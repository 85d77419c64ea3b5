#!/usr/bin/env bash
# go-only-check.sh shows what the README promises of a machine with only Go: on a copy of the repository (a clone
# of HEAD: commit first) with PostgreSQL, npm and node, Chromium and Prometheus hidden from PATH, go test passes
# and names every test it skipped and what to install for it; with CI=true those same tests fail instead.
#
#   scripts/go-only-check.sh [packages]     # default ./...; the full suite takes ten minutes and more
#
# The hiding: PATH becomes Go's directory and a folder of links to every other program of PATH but the hidden
# ones; X402_TEST_POSTGRES_PATH_ONLY stops chain/journal/pgtest from finding the server in /usr/lib/postgresql,
# and X402_TEST_POSTGRES_DSN is unset. The clone has no chain/contracts/node_modules (npm ci makes it).
# Exit status 0 when the first run passes naming its skips, and the second, run on the skipped tests alone with
# CI=true, fails each of them with its line naming what to install and skips none.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
packages=("${@:-./...}")

work=$(mktemp -d)
trap 'chmod -R u+w "$work" 2>/dev/null; rm -rf "$work"' EXIT

git clone -q --no-hardlinks "$root" "$work/repo"
echo "go-only-check: a clone of $(git -C "$root" rev-parse --short HEAD) in $work/repo"

# The programs hidden: PostgreSQL's server and client, npm and node, Chromium, Prometheus.
hidden='^(initdb|pg_ctl|pg_ctlcluster|postgres|postmaster|psql|npm|npx|node|nodejs|corepack|chromium|chromium-browser|google-chrome|prometheus|promtool)$'
mkdir "$work/bin"
IFS=: read -r -a dirs <<<"$PATH"
for dir in "${dirs[@]}"; do
	[ -d "$dir" ] || continue
	for prog in "$dir"/*; do
		name=$(basename "$prog")
		if [ -x "$prog" ] && [ ! -d "$prog" ] && ! [[ $name =~ $hidden ]] && [ ! -e "$work/bin/$name" ]; then
			ln -s "$prog" "$work/bin/$name"
		fi
	done
done
goroot_bin=$(dirname "$(command -v go)")
export PATH="$goroot_bin:$work/bin"
export X402_TEST_POSTGRES_PATH_ONLY=1
unset X402_TEST_POSTGRES_DSN CI
export GOFLAGS="${GOFLAGS:--buildvcs=false}" GOPRIVATE=github.com/x402-gateway/caddy-x402
export XDG_DATA_HOME="$work/data" XDG_CONFIG_HOME="$work/config"
for prog in initdb npm node; do
	if command -v "$prog" >/dev/null; then
		echo "go-only-check: FAIL: $prog is still on PATH ($(command -v "$prog"))" >&2
		exit 1
	fi
done
echo "go-only-check: PATH hides PostgreSQL, npm, node, Chromium and Prometheus; X402_TEST_POSTGRES_PATH_ONLY=1"

cd "$work/repo"

# field NAME reads a string field of go test -json's events.
field() { sed -n 's/.*"'"$1"'":"\([^"]*\)".*/\1/p'; }

echo "== go test ${packages[*]} (CI unset)"
start=$(date +%s)
status=0
go test -json -count=1 "${packages[@]}" >"$work/first.json" 2>"$work/first.err" || status=$?
echo "exit status $status after $(($(date +%s) - start))s"
if [ "$status" -ne 0 ]; then
	echo "go-only-check: FAIL: go test failed on a machine with only Go; the failures:" >&2
	grep '"Action":"fail"' "$work/first.json" | while read -r ev; do
		echo "  $(field Package <<<"$ev") $(field Test <<<"$ev")" >&2
	done
	tail -n 20 "$work/first.err" >&2
	exit 1
fi
grep '"Action":"skip"' "$work/first.json" | grep '"Test":' | while read -r ev; do
	echo "$(field Package <<<"$ev") $(field Test <<<"$ev")"
done | sort -u >"$work/skipped"
# The lines that name what to install (internal/needs: "skipped: needs <what>: <install>").
grep -o 'skipped: needs [^"]*' "$work/first.json" | sed 's/\\n$//; s/\\t/ /g' | sort | uniq -c | sort -rn >"$work/needs"
echo "skipped $(wc -l <"$work/skipped") tests (subtests counted); what they need, with the number of skip lines:"
sed 's/^/  /' "$work/needs"
echo "the skipped tests:"
sed 's/^/  /' "$work/skipped"
if [ ! -s "$work/needs" ]; then
	echo "go-only-check: FAIL: nothing was skipped for a missing tool: is anything hidden?" >&2
	exit 1
fi
# Every skip is a named one: a test skipped without a needs line is skipped silently.
unnamed=$(grep '"Action":"skip"' "$work/first.json" | grep '"Test":' | while read -r ev; do
	pkg=$(field Package <<<"$ev") test=$(field Test <<<"$ev")
	if ! grep -F "\"Package\":\"$pkg\"" "$work/first.json" | grep -F "\"Test\":\"$test\"" | grep -q -e 'skipped: needs' -e 'needs [^:]*: '; then
		echo "$pkg $test"
	fi
done | sort -u)
if [ -n "$unnamed" ]; then
	echo "tests skipped for another reason than a missing tool (their own skip lines say why):"
	sed 's/^/  /' <<<"$unnamed"
fi

echo "== the skipped tests again, with CI=true"
start=$(date +%s)
ci_status=0
: >"$work/second.json"
# Top-level tests only: -run matches a test and its subtests.
awk '{ split($2, t, "/"); print $1, t[1] }' "$work/skipped" | sort -u >"$work/rerun"
for pkg in $(awk '{print $1}' "$work/rerun" | sort -u); do
	tests=$(awk -v p="$pkg" '$1 == p { printf "%s%s", sep, $2; sep = "|" }' "$work/rerun")
	CI=true go test -json -count=1 -run "^($tests)\$" "$pkg" >>"$work/second.json" 2>>"$work/second.err" || ci_status=$?
done
echo "exit status $ci_status after $(($(date +%s) - start))s"
ci_skips=$(grep '"Action":"skip"' "$work/second.json" | grep -c '"Test":' || true)
ci_fails=$(grep '"Action":"fail"' "$work/second.json" | grep -c '"Test":' || true)
ci_lines=$(grep -c 'CI is set, so this test may not skip' "$work/second.json" || true)
echo "under CI: $ci_fails tests failed, $ci_lines failure lines name what to install, $ci_skips tests skipped"
grep -o 'needs [^"]*(CI is set, so this test may not skip)' "$work/second.json" | sort | uniq -c | sort -rn | sed 's/^/  /'
if [ "$ci_status" -eq 0 ] || [ "$ci_lines" -eq 0 ]; then
	echo "go-only-check: FAIL: with CI=true the tests that skipped did not fail naming what to install" >&2
	exit 1
fi
if grep '"Action":"skip"' "$work/second.json" | grep '"Test":' | grep -q .; then
	echo "go-only-check: note: under CI these still skipped (for a reason other than a missing tool):"
	grep '"Action":"skip"' "$work/second.json" | grep '"Test":' | while read -r ev; do
		echo "  $(field Package <<<"$ev") $(field Test <<<"$ev")"
	done
fi
echo "go-only-check: ok: go test passes with only Go, naming what it skipped; with CI=true those tests fail"
