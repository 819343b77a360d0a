#!/usr/bin/env bash
# Create the project's virtual environment and install wan_sharding with its pinned CPU stack
# (the `cpu` extra: torch, torch-xla, JAX, jax-tt-plugin). On Tenstorrent hardware, add the package
# to tt-xla's environment instead, without the extra (docs/tt-backend.md).
# VENV (default .venv in the repository) can point elsewhere to share one environment.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
venv="${VENV:-$root/.venv}"
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
# torch 2.9.0 from PyPI is a CUDA build (several GB of nvidia wheels); it runs on the CPU.
"$venv/bin/python" -m pip install -q -e "$root[cpu,dev]"
echo "installed into $venv"
