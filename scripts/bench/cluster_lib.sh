# The setup scripts/bench/cluster.sh and scripts/bench/cpu.sh share, sourced with BIN and D set: a fresh PostgreSQL
# on 127.0.0.1:15432 with its DSN in $DSN (PGOPTS adds server settings), and the functions devchain, gateway,
# balancer, stop_all, wait402 and bench. The caller's EXIT trap stops every process they started.
rm -rf "$D"; mkdir -p "$D"; chmod 777 "$D"
CLIENT=${X402_BENCH_CLIENT:-$BIN}
N8=${X402_BENCH_N8:-300}; N32=${X402_BENCH_N32:-600} # requests of the rounds at concurrency 8 and 32
PGBIN=$(dirname "$(command -v initdb 2>/dev/null || ls -d /usr/lib/postgresql/*/bin/initdb | tail -1)")
as_pg() { if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi; }
GW=()
cleanup() {
	for p in "${GW[@]}"; do kill -INT "$p" 2>/dev/null || true; done
	for p in "${GW[@]}"; do wait "$p" 2>/dev/null || true; done
	as_pg "$PGBIN/pg_ctl" -D "$D/pg" -m fast -w stop >/dev/null 2>&1 || true
}
trap cleanup EXIT

as_pg "$PGBIN/initdb" -D "$D/pg" -U postgres --auth=trust -E UTF8 --no-locale >/dev/null
as_pg "$PGBIN/pg_ctl" -D "$D/pg" -l "$D/pg.log" -w -o "-c listen_addresses=127.0.0.1 -p 15432 -c unix_socket_directories=$D -c max_connections=300 -c fsync=on ${PGOPTS:-}" start >/dev/null
DSN="postgres://postgres@127.0.0.1:15432/postgres?sslmode=disable"

# devchain starts a fresh dev chain. Each round has its own: a chain sealing a block per transaction burst runs
# its clock ahead of the wall clock by a second a block, and the payments bench signs are valid ten minutes.
CHAINS=0
devchain() {
	CHAINS=$((CHAINS + 1))
	XDG_DATA_HOME=$D/chain$CHAINS-data XDG_CONFIG_HOME=$D/chain$CHAINS-cfg "$BIN" x402 devchain --listen 127.0.0.1:18645 --wallets 12 >> "$D/devchain.log" 2>&1 &
	GW+=($!)
	for i in $(seq 1 150); do curl -s -o /dev/null -X POST -H 'content-type: application/json' \
		--data '{"jsonrpc":"2.0","id":1,"method":"eth_chainId","params":[]}' http://127.0.0.1:18645 && break; sleep 0.2; done
}
# gateway N JOURNAL starts gateway N (port 1818N) on JOURNAL, a DSN or a bbolt file.
gateway() {
	local n=$1 journal=$2
	cat > "$D/gw$n.Caddyfile" <<EOF
{
	admin off
	auto_https off
	x402 {
		dev_chain {
			rpc http://127.0.0.1:18645
			wallets 0-11
		}
		journal $journal
	}
}
:1818$n {
	bind 127.0.0.1
	x402 \$0.01 {
		pay_to 0x5e11e75e11e75e11e75e11e75e11e75e11e75e11
		max_timeout 24h
	}
	respond "paid content"
}
EOF
	XDG_DATA_HOME=$D/gw$n-data XDG_CONFIG_HOME=$D/gw$n-cfg "$BIN" run --config "$D/gw$n.Caddyfile" >> "$D/gw$n.log" 2>&1 &
	GW+=($!)
}
# balancer N starts the round-robin Caddy on 18180 in front of gateways 1..N.
balancer() {
	local ups=""
	for i in $(seq 1 "$1"); do ups="$ups 127.0.0.1:1818$i"; done
	cat > "$D/lb.Caddyfile" <<EOF
{
	admin off
	auto_https off
}
:18180 {
	bind 127.0.0.1
	reverse_proxy $ups {
		lb_policy round_robin
	}
}
EOF
	XDG_DATA_HOME=$D/lb-data XDG_CONFIG_HOME=$D/lb-cfg "$BIN" run --config "$D/lb.Caddyfile" >> "$D/lb.log" 2>&1 &
	GW+=($!)
}
stop_all() {
	for p in "${GW[@]}"; do kill -INT "$p" 2>/dev/null || true; done
	for p in "${GW[@]}"; do wait "$p" 2>/dev/null || true; done
	GW=()
	sleep 1
}
wait402() { for i in $(seq 1 300); do [ "$(curl -s -o /dev/null -w '%{http_code}' "$1")" = 402 ] && return 0; sleep 0.2; done; echo "no 402 from $1" >&2; exit 1; }
B="$CLIENT x402 bench --dev --rpc http://127.0.0.1:18645 --json --max-failures 1000000"
# bench NAME C N URL writes the report of one load to NAME.json.
bench() { $B -c "$2" -n "$3" "$4" > "$D/$1.json" 2>> "$D/bench.err" || echo "bench $1 exited $?" >&2; }

