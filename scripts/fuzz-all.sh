#!/usr/bin/env bash
# fuzz-all.sh runs every fuzz target of the module at the same time, each for the given duration, and prints
# what each did: package, target, executions, new interesting inputs, and PASS or FAIL.
#
#   scripts/fuzz-all.sh [duration]     duration as -fuzztime takes it (10m, 30s, 5000x); default 10m
#
# Targets are found by grep (func FuzzXxx(f *testing.F) in *_test.go files), so a new one is picked up without
# editing this script. Each package's fuzzing test binary (instrumented, as go test -fuzz builds it) is built
# once before any target starts, so that compiling takes none of the fuzzing time. Then every target runs in a
# process of its own, all started together with one worker each: the same run as
#   go test -run '^$' -fuzz '^Name$' -fuzztime <duration> -parallel 1 ./pkg
# without the build. The corpus a run grows is kept where go test keeps it ($GOCACHE/fuzz/<import path>), and a
# failing input is written to the package's testdata/fuzz/<Name>/, as go test writes it. Execution counts are
# those of the last progress line; they reflect how many cores the targets share.
#
# Environment: FUZZ_MINIMIZE_TIME, when set, is passed as -fuzzminimizetime (go test's default is 60s).
#
# Results: PASS; FAIL (an input failed: the table is followed by the input and how to re-run it); DEADLINE (Go's
# fuzzing coordinator reported the end of -fuzztime as an error, a known race of Go before 1.27, go.dev/issue/75804:
# the target fuzzed for the whole time and no input failed); NO-FUZZ (the time ran out before the target had run
# its corpus: give it longer).
# Exit status: 0 when every target passed or hit DEADLINE; 1 on FAIL, NO-FUZZ or a failed build. The logs stay in
# the folder printed at the end.
set -euo pipefail
cd "$(dirname "$0")/.."

duration=${1:-10m}
logs=$(mktemp -d "${TMPDIR:-/tmp}/fuzz-all.XXXXXX")
bin="$logs/bin"
mkdir -p "$bin"
fuzzcache="$(go env GOCACHE)/fuzz"

pids=()
cleanup() {
	for pid in "${pids[@]}"; do
		kill "$pid" 2>/dev/null || true
	done
	rm -rf "$bin"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# Every target, as "package-dir target", in a stable order.
mapfile -t targets < <(
	grep -rlE --include='*_test.go' --exclude-dir=node_modules --exclude-dir=.git '^func Fuzz[A-Za-z0-9_]*\([A-Za-z_][A-Za-z0-9_]* \*testing\.F\)' . |
		while read -r file; do
			sed -nE 's/^func (Fuzz[A-Za-z0-9_]*)\([A-Za-z_][A-Za-z0-9_]* \*testing\.F\).*/\1/p' "$file" |
				while read -r name; do echo "$(dirname "${file#./}") $name"; done
		done | sort -u
)
if [ ${#targets[@]} -eq 0 ]; then
	echo "fuzz-all: no fuzz targets found" >&2
	exit 1
fi
mapfile -t dirs < <(printf '%s\n' "${targets[@]}" | cut -d' ' -f1 | sort -u)

# One instrumented test binary per package, built before anything runs.
echo "building ${#dirs[@]} fuzzing test binaries for ${#targets[@]} targets (logs in $logs)"
declare -A importpath
for dir in "${dirs[@]}"; do
	first=$(printf '%s\n' "${targets[@]}" | awk -v d="$dir" '$1 == d { print $2; exit }')
	importpath[$dir]=$(go list -f '{{.ImportPath}}' "./$dir")
	start=$(date +%s)
	if ! go test -c -fuzz "^${first}\$" -o "$bin/${dir//\//_}.test" "./$dir" >"$logs/build-${dir//\//_}.log" 2>&1; then
		echo "fuzz-all: building the fuzzing test binary of ./$dir failed:" >&2
		cat "$logs/build-${dir//\//_}.log" >&2
		exit 1
	fi
	echo "  ./$dir ($(($(date +%s) - start))s)"
done

minimize=()
if [ -n "${FUZZ_MINIMIZE_TIME:-}" ]; then
	minimize=(-test.fuzzminimizetime "$FUZZ_MINIMIZE_TIME")
fi

echo "fuzzing ${#targets[@]} targets for $duration each, all at once"
declare -A pidOf
for t in "${targets[@]}"; do
	read -r dir name <<<"$t"
	(
		cd "$dir"
		exec "$bin/${dir//\//_}.test" -test.run '^$' -test.fuzz "^${name}\$" -test.fuzztime "$duration" -test.parallel 1 \
			-test.fuzzcachedir "$fuzzcache/${importpath[$dir]}" "${minimize[@]}"
	) >"$logs/${dir//\//_}.$name.log" 2>&1 &
	pids+=($!)
	pidOf[$t]=$!
done

# A target that exits non-zero with no input written and only "context deadline exceeded" to say hit the race in
# Go's fuzzing coordinator at the end of -fuzztime (go.dev/issue/75804, fixed in Go 1.27): it fuzzed for the whole
# time and found nothing, so it is DEADLINE, not a failure, unless it never got past its baseline coverage.
failed=0
declare -A status
for t in "${targets[@]}"; do
	read -r dir name <<<"$t"
	log="$logs/${dir//\//_}.$name.log"
	if wait "${pidOf[$t]}"; then
		status[$t]=PASS
	elif ! grep -q 'Failing input written' "$log" && [ "$(grep -cvE '^(fuzz: elapsed: |--- FAIL: |FAIL$|exit status )' "$log")" = 1 ] &&
		grep -qx '[[:space:]]*context deadline exceeded' "$log"; then
		if grep -q 'now fuzzing' "$log"; then
			status[$t]=DEADLINE
		else
			status[$t]=NO-FUZZ
			failed=1
		fi
	else
		status[$t]=FAIL
		failed=1
	fi
done
pids=()

printf '\n%-18s %-55s %12s %16s  %s\n' package target execs "new interesting" result
total=0
for t in "${targets[@]}"; do
	read -r dir name <<<"$t"
	log="$logs/${dir//\//_}.$name.log"
	progress=$(grep -E '^fuzz: elapsed: .*, execs: [0-9]+' "$log" | tail -n 1 || true)
	execs=$(sed -nE 's/.*, execs: ([0-9]+).*/\1/p' <<<"$progress")
	interesting=$(sed -nE 's/.*new interesting: ([0-9]+).*/\1/p' <<<"$progress")
	total=$((total + ${execs:-0}))
	printf '%-18s %-55s %12s %16s  %s\n' "$dir" "$name" "${execs:--}" "${interesting:--}" "${status[$t]}"
done
printf '%-18s %-55s %12s\n' "" "total" "$total"

for t in "${targets[@]}"; do
	read -r dir name <<<"$t"
	log="$logs/${dir//\//_}.$name.log"
	case ${status[$t]} in
	DEADLINE)
		echo
		echo "DEADLINE $dir $name: Go's coordinator reported its own -fuzztime deadline as an error (go.dev/issue/75804); no input failed"
		continue
		;;
	NO-FUZZ)
		echo
		echo "NO-FUZZ $dir $name: the time ran out while it was still running its corpus for baseline coverage; give it longer (log: $log)"
		continue
		;;
	FAIL) ;;
	*) continue ;;
	esac
	echo
	echo "FAIL $dir $name (log: $log)"
	input=$(sed -nE 's/.*Failing input written to (.*)$/\1/p' "$log" | tail -n 1)
	if [ -n "$input" ]; then
		echo "  failing input: $dir/$input"
		echo "  re-run: go test -run '^$name/$(basename "$input")\$' ./$dir"
	fi
	grep -E -- '--- FAIL|_test\.go:[0-9]+:' "$log" | head -n 10 | sed 's/^/  /'
done
echo
echo "logs: $logs"
exit "$failed"
