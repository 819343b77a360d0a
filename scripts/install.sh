#!/usr/bin/env bash
# Create the project's virtual environment and install wan_sharding with its pinned stack.
# VENV (default .venv in the repository) can point elsewhere to share one environment.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
venv="${VENV:-$root/.venv}"
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
# torch 2.9.0 from PyPI is a CUDA build (several GB of nvidia wheels); it runs on the CPU.
"$venv/bin/python" -m pip install -q -e "$root[dev]"
echo "installed into $venv"
