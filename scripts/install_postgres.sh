#!/usr/bin/env bash
# The registry tests start a real PostgreSQL server on loopback from Debian's packages (initdb and
# pg_ctl under /usr/lib/postgresql/<major>/bin). Install them once; a second run does nothing.
set -euo pipefail
if ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then
    exit 0
fi
if [ "$(id -u)" != 0 ]; then
    echo "warning: PostgreSQL server binaries are missing and this is not root:" \
         "run 'sudo apt-get install postgresql' (the registry's PostgreSQL tests need them)" >&2
    exit 0
fi
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends postgresql >/dev/null
ls /usr/lib/postgresql/*/bin/initdb
