#!/usr/bin/env bash
# Set up a virtual environment in .venv with the CPU build of torch and rwinterp (editable, with Ray).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
# torch first, pinned: an unpinned torch requirement would pull a multi-GB CUDA build.
.venv/bin/pip install -q --disable-pip-version-check torch==2.13.0
# The package with its Ray extra (sweeps and reproductions on Ray; the tests run them on a local instance).
.venv/bin/pip install -q --disable-pip-version-check -e '.[ray]'
