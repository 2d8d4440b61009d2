#!/usr/bin/env bash
# The test suite: set up .venv, then pytest (arguments pass through, e.g. -m slow or a test path).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Built task environments for the tests, which never download: the Debian bases (trixie; bookworm for a
# SWE-bench row's own environment, whose pytest 7.2 is older than kiln's) and the pandas fixture's apt
# layer, built once into ~/.cache/kiln/envs (later runs find them there and do nothing). Without
# mmdebstrap (apt-get install mmdebstrap uidmap) the tests over a built root skip, and say why.
if command -v mmdebstrap >/dev/null; then
  .venv/bin/kiln env build-base --suite trixie --suite bookworm
  .venv/bin/kiln env build tests/tasks/fixtures/pandas-total
fi
exec .venv/bin/python -m pytest -q "$@"
