#!/usr/bin/env bash
# Installs what the service tests start themselves (tests/support/services.py): PostgreSQL's server
# binaries (initdb, pg_ctl) from the Debian `postgresql` package. Chroma comes with the venv.
# Never fails `make test`: when it cannot install, it prints why and records the reason in
# .kb-test-cache/install_services.log, and the PostgreSQL tests then fail with that reason.
set -u
cd "$(dirname "$0")/.."
log=.kb-test-cache/install_services.log
mkdir -p .kb-test-cache

have_pg() {
    for d in /usr/lib/postgresql/*/bin; do
        [ -x "$d/initdb" ] && [ -x "$d/pg_ctl" ] && return 0
    done
    command -v initdb >/dev/null 2>&1 && command -v pg_ctl >/dev/null 2>&1
}

give_up() {
    echo "install_services: PostgreSQL not installed: $1; the PostgreSQL tests will fail" >&2
    echo "$1" >"$log"
    exit 0
}

if have_pg; then
    rm -f "$log"
    exit 0
fi
if [ "$(id -u)" = 0 ]; then
    sudo=()
elif command -v sudo >/dev/null 2>&1; then
    sudo=(sudo -n)  # -n: fail instead of waiting for a password nobody will type
else
    give_up "not root and no sudo to run apt-get install postgresql"
fi
command -v apt-get >/dev/null 2>&1 || give_up "no apt-get on this machine; install PostgreSQL's server (initdb, pg_ctl) by hand"

echo "install_services: installing PostgreSQL (apt-get install postgresql)" >&2
out=$(mktemp)
if ! { "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -q &&
       "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends postgresql; } >"$out" 2>&1; then
    why=$(grep -E '^(E|W): ' "$out" | tail -n 3 | tr '\n' ' ' | sed 's/ *$//')
    [ -n "$why" ] || why=$(tail -n 3 "$out" | tr '\n' ' ' | sed 's/ *$//')
    reason="apt-get install postgresql failed: $why"
    rm -f "$out"
    give_up "$reason"
fi
rm -f "$out"
have_pg || give_up "apt-get installed postgresql, but no initdb/pg_ctl under /usr/lib/postgresql/*/bin"
rm -f "$log"
echo "install_services: PostgreSQL installed" >&2
