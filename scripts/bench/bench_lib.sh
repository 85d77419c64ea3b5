# Sourced by the scripts of scripts/bench that load one Caddy on scripts/bench/Caddyfile (run.sh, steady.sh,
# c1pair.sh).

CADDY_PID=

# start_caddy BIN DIR starts BIN on scripts/bench/Caddyfile with DIR for its data, its temporary files and its log
# (DIR/caddy.log), a receiver authorizer key drawn for it (it signs the claims of the batch route's vouchers), and
# sets CADDY_PID. It returns once the batch route answers 402: the dev chain and the engine start after the site
# listens. The caller stops it (kill -INT).
start_caddy() {
	local bin=$1 d=$2 here root
	here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd); root=$(cd "$here/../.." && pwd)
	X402_BENCH_RECEIVER_AUTHORIZER_KEY=$(python3 -c 'import secrets; print(secrets.token_hex(32))') \
	X402_BENCH_SITE=$root/examples/site XDG_DATA_HOME=$d/data XDG_CONFIG_HOME=$d/cfg TMPDIR=$d \
		"$bin" run --config "$here/Caddyfile" > "$d/caddy.log" 2>&1 &
	CADDY_PID=$!
	for _ in $(seq 1 150); do
		[ "$(curl -s -o /dev/null -w '%{http_code}' http://127.0.0.1:18080/batch/index.html)" = 402 ] && return 0
		sleep 0.2
	done
	echo "the Caddy under load did not answer its batch route's 402 within 30 s: see $d/caddy.log" >&2
	return 1
}
