"""PCC check: the sharded DiT against the unsharded one, on CPU virtual meshes.

One process runs one backend on one mesh (torch-xla and JAX both read ``XLA_FLAGS`` and must not
share a process). :func:`run_in_subprocess` starts ``python -m wan_sharding.check`` with the
right environment; the worker prints one JSON line per case and, with ``--save DIR``, writes
the reference and sharded outputs so a caller can compute its own comparison.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterable

from .plan import DEFAULT_PADDING
from .workers import run_watched

# Latent shapes of the embedded tiny cases. ``aligned``: 256 tokens, a multiple of SP*32 for every
# preset up to SP 8. ``padded``: 105 tokens, padded to 128 (SP 1, 2) or 256 (SP 8).
CASE_LATENTS = {"aligned": (1, 32, 32), "padded": (3, 10, 14)}
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


@dataclass(frozen=True)
class Case:
    variant: str = "t2v-a14b"
    length: str = "padded"  # a key of CASE_LATENTS, or "F,H,W"
    dtype: str = "fp32"
    padding: str = DEFAULT_PADDING

    @property
    def key(self) -> str:
        return f"{self.variant}-{self.length}-{self.dtype}-{self.padding}"

    def latent(self):
        from .models import LatentShape

        dims = CASE_LATENTS.get(self.length) or tuple(int(v) for v in self.length.split(","))
        return LatentShape(*dims)

    @classmethod
    def parse(cls, text: str) -> "Case":
        variant, length, dtype, padding = text.split(":")
        return cls(variant, length, dtype, padding)

    def __str__(self) -> str:
        return f"{self.variant}:{self.length}:{self.dtype}:{self.padding}"


def pcc(a, b) -> float:
    """Pearson correlation of two tensors, flattened, in float64."""
    import numpy as np

    a = np.asarray(a, dtype=np.float64).ravel()
    b = np.asarray(b, dtype=np.float64).ravel()
    return float(np.corrcoef(a, b)[0, 1])


def _run_case(backend_name: str, mesh_name: str, case: Case, save: Path | None) -> dict[str, Any]:
    import torch

    from . import apply_dit_sp_activation_sharding, get_backend, shard_dit_specs
    from .models import build_dit, dit_inputs

    dtype = getattr(torch, DTYPES[case.dtype])
    dit = build_dit(case.variant, "tiny", dtype=dtype)
    inputs = dit_inputs(case.variant, case.latent(), dtype=dtype)
    with torch.no_grad():
        reference = dit(**inputs, return_dict=False)[0]

    start = time.perf_counter()
    sharded = copy.deepcopy(dit)  # the xla backend moves the model to the device
    backend = get_backend(backend_name, mesh_name)
    specs = shard_dit_specs(sharded, backend.mesh)
    placed = backend.place(sharded, specs)
    handle = apply_dit_sp_activation_sharding(sharded, backend.mesh, backend=backend, padding=case.padding)
    collectives = None
    with torch.no_grad():
        if backend.name == "jax":  # compile once, run it, and read the collectives off the same program
            from .backends.jax import collective_counts

            program = backend.compile(sharded, placed, **inputs)
            out, collectives = backend.to_host(program()), collective_counts(program.text)
        else:
            out = backend.run(sharded, placed, **inputs)
    seconds = time.perf_counter() - start
    info = handle.describe()
    handle.remove()

    ref64, out64 = reference.double(), out.double()
    result = {
        "backend": backend_name, "mesh": mesh_name, "case": str(case), **asdict(case),
        "shape": list(out.shape), "pcc": pcc(ref64, out64),
        "max_abs": float((ref64 - out64).abs().max()), "seconds": round(seconds, 2),
        "params": specs.counts(), "tokens": info["last_tokens"], "padded_tokens": info["last_padded_tokens"],
        "sp_points": len(info["sp_points"]),
        "collectives": collectives,
    }
    if save is not None:
        save.mkdir(parents=True, exist_ok=True)
        path = save / f"{backend_name}-{mesh_name}-{case.key}.pt"
        torch.save({"reference": reference, "sharded": out}, path)
        result["saved"] = str(path)
    return result


def worker(argv: list[str] | None = None) -> int:
    """Entry of the per-backend process: run the cases, print one JSON line each."""
    ap = argparse.ArgumentParser(prog="python -m wan_sharding.check")
    ap.add_argument("--backend", required=True, choices=["xla", "jax"])
    ap.add_argument("--mesh", required=True)
    ap.add_argument("--case", action="append", required=True, help="variant:length:dtype:padding")
    ap.add_argument("--save", type=Path)
    args = ap.parse_args(argv)
    if args.backend == "xla":
        from .backends.xla import enable_spmd

        enable_spmd()
    for text in args.case:
        result = _run_case(args.backend, args.mesh, Case.parse(text), args.save)
        print("RESULT " + json.dumps(result), flush=True)
    return 0


def backend_env(backend: str, num_devices: int) -> dict[str, str]:
    """The environment a process needs to run ``backend`` on ``num_devices`` CPU devices."""
    if backend == "xla":
        from .backends.xla import cpu_env
    else:
        from .backends.jax import cpu_env
    env = cpu_env(num_devices)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    # Make the package importable in the child even when run from a source checkout.
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


def run_in_subprocess(backend: str, mesh: str, cases: Iterable[Case], save: Path | None = None,
                      timeout: float = 1200) -> list[dict[str, Any]]:
    """Run ``cases`` for one backend on one mesh in a fresh process; returns the result dicts."""
    from .mesh import mesh_from_preset

    cmd = [sys.executable, "-m", "wan_sharding.check", "--backend", backend, "--mesh", mesh]
    for case in cases:
        cmd += ["--case", str(case)]
    if save is not None:
        cmd += ["--save", str(save)]
    rc, results, out = run_watched(cmd, backend_env(backend, mesh_from_preset(mesh).num_devices),
                                   label=f"{backend} check worker on {mesh}", timeout=timeout)
    if rc != 0:
        raise RuntimeError(f"{backend} worker on {mesh} failed (exit {rc}):\n{out[-4000:]}")
    return results


if __name__ == "__main__":
    sys.exit(worker())
