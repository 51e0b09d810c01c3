#!/bin/bash
# System calls per request of one bench server configuration under load.
#
#   bash bench/server_syscalls.sh CONFIG [PATH]
#
# Starts bench/_load_server.py --config CONFIG (a key of its CONFIGS),
# warms it with wrk for 2 s, then counts its system calls (all threads,
# `strace -c -f`) during a 5 s `wrk -t1 -c16` run of PATH (default
# /api?page=2) and prints those made more than once per 100 requests.
# strace slows the server several times: compare configurations by calls
# per request, never by the request rate it shows.
set -eu
cfg=${1:?usage: server_syscalls.sh CONFIG [PATH]}
path=${2:-/api?page=2}
here=$(cd "$(dirname "$0")" && pwd)
py=${PYTHON:-$here/../.venv/bin/python}
tmp=$(mktemp -d)
trap 'kill "$spid" 2>/dev/null || true; rm -rf "$tmp"' EXIT
"$py" "$here/_load_server.py" --config "$cfg" --port 0 > "$tmp/out" 2>&1 &
spid=$!
port=
for _ in $(seq 100); do
    port=$(sed -n 's/^PORT \([0-9]*\)$/\1/p' "$tmp/out")
    [ -n "$port" ] && break
    sleep 0.1
done
[ -n "$port" ] || { echo "server did not start:" >&2; cat "$tmp/out" >&2; exit 1; }
wrk -t1 -c16 -d2s "http://127.0.0.1:$port$path" > /dev/null
strace -c -f -p "$spid" -o "$tmp/strace" 2> /dev/null &
st=$!
sleep 0.5
wrk -t1 -c16 -d5s "http://127.0.0.1:$port$path" > "$tmp/wrk"
sleep 0.3
kill -INT "$st"
wait "$st" || true
req=$(sed -n 's/^ *\([0-9]*\) requests in.*/\1/p' "$tmp/wrk")
echo "$cfg: $req requests"
awk -v r="$req" '$4 ~ /^[0-9]+$/ && ($NF == "total" || $4 / r > 0.01) {
    printf "  %-16s %7.3f per request\n", $NF, $4 / r }' "$tmp/strace"
