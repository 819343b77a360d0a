"""Worker: the patched, sharded tiny DiT against the vanilla unsharded one, in a process of its own.

``python -m wan_sharding.patches.check`` (the :mod:`wan_sharding.workers` protocol: parameters as
JSON on stdin, one ``RESULT`` line per case). One backend and one mesh per process, as for
``wan_sharding.jobs.check``: torch-xla and JAX must not share a process, and a mesh needs its
device count. :func:`run_in_subprocess` is the parent side.

Each case: build the tiny model, run it eagerly (the reference), then apply the patches (with the
mesh), ``shard_dit_specs``, ``apply_dit_sp_activation_sharding`` with the case's padding mode, run it
sharded twice (the second run reuses the cached rope tables and the compiled program) and report
the worse PCC and max-abs of the two against the reference, fp32.
"""

from __future__ import annotations

import sys
import time
from typing import Any, Iterable, Sequence


def sharpen(dit, factor: float):
    """Scale every self-attention's q / k RMSNorm weights by ``factor`` (in place; returns ``dit``).
    The tiny models' random weights give nearly uniform attention behind small adaLN gates, where
    RoPE moves the output by ~5e-5 only; sharper attention makes a wrong q / k layout or rotary
    visible far above the fp32 bounds, while exact rewrites stay at ~1e-7."""
    import torch

    if factor != 1:
        with torch.no_grad():
            for block in dit.blocks:
                block.attn1.norm_q.weight.mul_(factor)
                block.attn1.norm_k.weight.mul_(factor)
    return dit


def run_case(backend: Any, mesh: str, patches: Sequence[str], variant: str, latent: Sequence[int],
             padding: str, sharpen_by: float = 1.0) -> dict[str, Any]:
    import torch

    from .. import apply_dit_sp_activation_sharding, shard_dit_specs
    from ..jobs.pcc import compare
    from ..models import LatentShape, build_dit, dit_inputs
    from . import apply_patches

    dit = sharpen(build_dit(variant), sharpen_by)
    inputs = dit_inputs(variant, LatentShape(*latent))
    with torch.no_grad():
        reference = dit(**inputs, return_dict=False)[0]
    start = time.perf_counter()
    patched = apply_patches(dit, patches, mesh=mesh)
    specs = shard_dit_specs(dit, mesh)
    placed = backend.place(dit, specs)
    sp = apply_dit_sp_activation_sharding(dit, mesh, backend=backend, padding=padding)
    with torch.no_grad():  # twice: the second run reuses what the first cached (rope tables, programs)
        outs = [backend.run(dit, placed, **inputs) for _ in range(2)]
    sp.remove()
    patched.remove()
    backend.release(dit)
    (value, max_abs), (value2, max_abs2) = (compare(reference, out) for out in outs)
    value, max_abs = min(value, value2), max(max_abs, max_abs2)
    return {"backend": backend.name, "mesh": mesh, "patches": list(patches), "variant": variant,
            "latent": list(latent), "padding": padding, "pcc": value, "max_abs": max_abs,
            "seconds": round(time.perf_counter() - start, 2)}


def _job(params: dict[str, Any]) -> Iterable[dict[str, Any]]:
    from .. import get_backend
    from ..jobs.launch import prepare_worker

    prepare_worker(params["backend"])
    backend = get_backend(params["backend"], params["mesh"])
    for case in params["cases"]:
        yield run_case(backend, params["mesh"], params["patches"], case["variant"], case["latent"], case["padding"],
                       case.get("sharpen", 1.0))


def run_in_subprocess(backend: str, mesh: str, patches: Sequence[str], cases: Sequence[dict[str, Any]],
                      timeout: float = 600) -> list[dict[str, Any]]:
    """Run ``cases`` (dicts with ``variant``, ``latent`` ``[F, H, W]``, ``padding`` and optionally
    ``sharpen``, see :func:`sharpen`) for one backend on one mesh in a fresh worker process; returns
    one result dict per case."""
    from ..jobs.launch import stall_seconds, worker_env
    from ..mesh import mesh_from_preset
    from ..workers import WorkerError, run_worker

    params = {"backend": backend, "mesh": mesh, "patches": list(patches), "cases": list(cases)}
    run = run_worker("wan_sharding.patches.check", params, worker_env(backend, mesh_from_preset(mesh).num_devices),
                     label=f"{backend} patches worker on {mesh}", timeout=timeout, stall_s=stall_seconds(backend))
    if not run.ok:
        raise WorkerError(f"{backend} patches worker on {mesh} failed (exit {run.returncode}):\n{run.output[-4000:]}")
    return run.results


if __name__ == "__main__":
    from ..workers import worker_main

    sys.exit(worker_main(_job))
