#!/usr/bin/env bash
# xcaddy-check.sh builds Caddy with this module the way a user would, with xcaddy as xcaddy.json describes,
# and checks that the binary has the x402 modules.
#
#   scripts/xcaddy-check.sh
#
# Exit status: 0 when the build lists x402, http.handlers.x402, http.handlers.x402_facilitator and x402.facilitators.*, or when
# xcaddy itself cannot be installed and CI is not set (it then prints "skipped: <why>"); non-zero when the build or
# the check fails, and when xcaddy cannot be installed under CI (CI set to anything but "", "false" or "0", as
# internal/needs reads it), where a skipped check would let CI pass without it. Everything it makes lives in a
# temporary folder that is removed at the end.
set -euo pipefail
cd "$(dirname "$0")/.."

module=github.com/x402-gateway/caddy-x402

# The versions come from xcaddy.json, so that this script checks what the file promises.
json_string() {
	sed -n 's/^[[:space:]]*"'"$1"'":[[:space:]]*"\([^"]*\)".*/\1/p' xcaddy.json | head -n 1
}
xcaddy_version=$(json_string xcaddy_version)
caddy_version=$(json_string caddy_version)
if [ -z "$xcaddy_version" ] || [ -z "$caddy_version" ]; then
	echo "xcaddy-check: xcaddy.json must name xcaddy_version and caddy_version, found '$xcaddy_version' and '$caddy_version'" >&2
	exit 1
fi

work=$(mktemp -d)
trap 'chmod -R u+w "$work" 2>/dev/null; rm -rf "$work"' EXIT
# xcaddy writes its build folder under TMPDIR; keep it inside ours.
export TMPDIR="$work"

# The environment of xcaddy.json. The module is not published: GOPRIVATE keeps its path away from the
# public proxy and checksum database, and GOVCS stops Go from asking its would-be git repository for
# versions. xcaddy runs `go get <module>` after replacing it with this folder; Go then takes the zero
# pseudo-version for it only when the lookup says "does not exist", and a git host that is unreachable,
# or asks for credentials for a repository that is not there, says something else and fails the build.
export GOPRIVATE="$module"
export GOVCS="$module:off"
export CGO_ENABLED=1

elapsed() { echo $(($(date +%s) - $1))s; }

# Installing xcaddy. `go install ...@version` consults the module's version list for deprecation notices,
# which some proxies refuse while serving the pinned version itself; building it in a scratch module needs
# only the pinned version.
start=$(date +%s)
mkdir -p "$work/bin"
if ! GOBIN="$work/bin" GOFLAGS=-buildvcs=false go install "github.com/caddyserver/xcaddy/cmd/xcaddy@$xcaddy_version" >"$work/install.log" 2>&1; then
	mkdir -p "$work/xcaddy-mod"
	printf 'module xcaddycheck\n\ngo %s\n\nrequire github.com/caddyserver/xcaddy %s\n' "$(go env GOVERSION | sed 's/^go//')" "$xcaddy_version" >"$work/xcaddy-mod/go.mod"
	if ! (cd "$work/xcaddy-mod" && GOFLAGS='-mod=mod -buildvcs=false' go build -o "$work/bin/xcaddy" github.com/caddyserver/xcaddy/cmd/xcaddy) >>"$work/install.log" 2>&1; then
		case "${CI:-}" in
		"" | false | FALSE | False | 0)
			echo "skipped: xcaddy $xcaddy_version could not be installed from the Go module proxy:"
			sed 's/^/  /' "$work/install.log" | tail -n 8
			exit 0
			;;
		esac
		echo "FAIL: xcaddy $xcaddy_version could not be installed from the Go module proxy, and CI is set, so this check may not skip:" >&2
		sed 's/^/  /' "$work/install.log" | tail -n 8 >&2
		exit 1
	fi
fi
echo "xcaddy $xcaddy_version installed in $(elapsed "$start")"

start=$(date +%s)
if ! "$work/bin/xcaddy" build "$caddy_version" --with "$module=./" --output "$work/caddy" >"$work/build.log" 2>&1; then
	echo "FAIL: xcaddy build $caddy_version --with $module=./ failed after $(elapsed "$start"); the end of its log:" >&2
	tail -n 40 "$work/build.log" >&2
	exit 1
fi
echo "xcaddy build $caddy_version --with $module=./ took $(elapsed "$start")"

version=$("$work/caddy" version)
case "$version" in
"$caddy_version"*) ;;
*)
	echo "FAIL: the built binary reports version '$version', expected $caddy_version" >&2
	exit 1
	;;
esac

modules=$("$work/caddy" list-modules)
missing=()
for m in x402 http.handlers.x402 http.handlers.x402_facilitator x402.facilitators.embedded x402.facilitators.http; do
	if ! grep -qx "$m" <<<"$modules"; then
		missing+=("$m")
	fi
done
if [ ${#missing[@]} -gt 0 ]; then
	echo "FAIL: the xcaddy build lacks the module(s) ${missing[*]}; list-modules shows:" >&2
	grep -i x402 <<<"$modules" >&2 || echo "  (no x402 module at all)" >&2
	exit 1
fi
echo "ok: Caddy $caddy_version built by xcaddy $xcaddy_version lists x402, http.handlers.x402, http.handlers.x402_facilitator and the x402.facilitators modules"
