"""Worker: the patched, sharded tiny DiT against the vanilla unsharded one, in a process of its own.

``python -m wan_sharding.jobs.patch_check`` (the :mod:`wan_sharding.runtime.workers` protocol: parameters as
JSON on stdin, one ``RESULT`` line per case). One backend and one mesh per process, as for
``wan_sharding.jobs.check``: torch-xla and JAX must not share a process, and a mesh needs its
device count. :func:`run_in_subprocess` is the parent side.

Each case: build the tiny model, run it eagerly (the reference, for the case's prompt and for a
second prompt), then shard it with the patches (``shard_dit``: patches, specs, placement, SP hooks
with the case's padding mode) and run it through a pipeline's stand-in
(:class:`~wan_sharding.pipeline.ShardedTransformer`) twice (the second run reuses the cached rope
tables, the prompt state of ``prompt_kv`` and the compiled program), then once with the second
prompt (a new prompt state); report the worst PCC and max-abs of the three against their
references, fp32, and how many prompt programs ran (``prompt_kv``: 2 for the 3 forwards).
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

    from ..compose import shard_dit
    from ..models import LatentShape, build_dit, dit_inputs
    from ..patches.prompt_kv import prompt_cache
    from ..pipeline import ShardedTransformer
    from .pcc import compare

    dit = sharpen(build_dit(variant), sharpen_by)
    inputs = dit_inputs(variant, LatentShape(*latent))
    generator = torch.Generator().manual_seed(1)
    other = {**inputs, "encoder_hidden_states": torch.randn(inputs["encoder_hidden_states"].shape,
                                                            generator=generator)}
    with torch.no_grad():
        reference, reference_other = (dit(**x, return_dict=False)[0] for x in (inputs, other))
    references = [reference, reference, reference_other]
    start = time.perf_counter()
    sharding = shard_dit(dit, mesh, backend=backend, padding=padding, patches=patches)
    model = ShardedTransformer(dit, backend, sharding.placed, "transformer", padding, sp=sharding.sp)
    with torch.no_grad():  # the second run reuses what the first cached (rope tables, prompt state, programs)
        outs = [model(**x, return_dict=False)[0] for x in (inputs, inputs, other)]
    cache = prompt_cache(dit)
    programs = cache.computed if cache is not None else None
    sharding.remove()
    compared = [compare(ref, out) for ref, out in zip(references, outs)]
    return {"backend": backend.name, "mesh": mesh, "patches": list(patches), "variant": variant,
            "latent": list(latent), "padding": padding, "pcc": min(c[0] for c in compared),
            "max_abs": max(c[1] for c in compared), "prompt_programs": programs,
            "seconds": round(time.perf_counter() - start, 2)}


def _job(params: dict[str, Any]) -> Iterable[dict[str, Any]]:
    from ..backends import get_backend
    from .launch import prepare_worker

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
    from .launch import stall_seconds, worker_env
    from ..mesh import mesh_from_preset
    from ..runtime.workers import WorkerError, run_worker

    params = {"backend": backend, "mesh": mesh, "patches": list(patches), "cases": list(cases)}
    run = run_worker("wan_sharding.jobs.patch_check", params, worker_env(backend, mesh_from_preset(mesh).num_devices),
                     label=f"{backend} patches worker on {mesh}", timeout=timeout, stall_s=stall_seconds(backend))
    if not run.ok:
        raise WorkerError(f"{backend} patches worker on {mesh} failed (exit {run.returncode}):\n{run.output[-4000:]}")
    return run.results


if __name__ == "__main__":
    from ..runtime.workers import worker_main

    sys.exit(worker_main(_job))
