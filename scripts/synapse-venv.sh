#!/bin/sh
# Installs the pinned Synapse into a virtualenv at $1 (default target/synapse/venv)
# unless it is already there. Used by the test harness (tests/support/synapse.rs)
# and by .ci/run to warm the cache, so both install the same version.
set -eu
VERSION=1.163.2
VENV=${1:-target/synapse/venv}
MARKER="$VENV/.durable-outbox-synapse-$VERSION"
if [ -f "$MARKER" ]; then
  exit 0
fi
if ! command -v python3 >/dev/null 2>&1; then
  echo "synapse-venv: python3 is missing; install python3 and python3-venv (Debian/Ubuntu: apt-get install python3-venv)" >&2
  exit 2
fi
if [ ! -x "$VENV/bin/pip" ]; then
  rm -rf "$VENV"
  if ! python3 -m venv "$VENV"; then
    echo "synapse-venv: 'python3 -m venv' failed; install python3-venv (Debian/Ubuntu: apt-get install python3-venv)" >&2
    exit 2
  fi
fi
"$VENV/bin/pip" install --quiet --disable-pip-version-check "matrix-synapse==$VERSION"
touch "$MARKER"
