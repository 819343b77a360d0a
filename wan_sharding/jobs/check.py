"""The PCC check: the sharded DiT against the unsharded one, on CPU virtual meshes (``xla``,
``jax``) or on Tenstorrent chips (``tt``, with Tenstorrent's stack).

One worker runs one backend on one mesh (torch-xla and JAX both read ``XLA_FLAGS`` and must not
share a process). :func:`run_in_subprocess` starts ``python -m wan_sharding.jobs.check``; the
worker emits one result per case and, with ``save``, writes the reference and sharded outputs so a
caller can compute its own comparison.
"""

from __future__ import annotations

import copy
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterable

from ..options import DEFAULT_PADDING
from ..runtime.workers import WorkerError, run_worker, worker_main
from .launch import plan_devices, prepare_worker, stall_seconds, worker_env
from .pcc import compare, grade, save_pair
from .text_encoder import ENCODER_CASE_PREFIX, EncoderCase
from .text_encoder import run_case as run_encoder_case

# Latent shapes of the embedded tiny cases. ``aligned``: 256 tokens, a multiple of SP*32 for every
# preset up to SP 8. ``padded``: 105 tokens, padded to 128 (SP 1, 2) or 256 (SP 8).
CASE_LATENTS = {"aligned": (1, 32, 32), "padded": (3, 10, 14)}


@dataclass(frozen=True)
class Case:
    variant: str = "t2v-a14b"
    length: str = "padded"  # a key of CASE_LATENTS, or "F,H,W"
    dtype: str = "fp32"
    padding: str = DEFAULT_PADDING
    patches: str = ""  # model rewrites for the sharded model, "+"-joined (wan_sharding.patches)
    config: str = ""  # overrides of the tiny config, "name=int,..." (the fuzz's random models)
    batch: int = 1

    @property
    def key(self) -> str:
        extra = [self.patches, self.config.replace("=", "").replace(",", "-"), f"b{self.batch}" if self.batch != 1 else ""]
        return "-".join([self.variant, self.length, self.dtype, self.padding, *(e for e in extra if e)])

    def latent(self):
        from ..models import LatentShape

        dims = CASE_LATENTS.get(self.length) or tuple(int(v) for v in self.length.split(","))
        return LatentShape(*dims)

    def overrides(self) -> dict[str, int]:
        """The tiny-config overrides as keyword arguments of ``build_dit``."""
        return {k: int(v) for k, v in (item.split("=") for item in self.config.split(",") if item)}

    @classmethod
    def parse(cls, text: str) -> "Case":
        parts: list = text.split(":")
        if len(parts) > 6:
            parts[6] = int(parts[6])
        return cls(*parts)

    def __str__(self) -> str:
        parts = [self.variant, self.length, self.dtype, self.padding, self.patches, self.config, str(self.batch)]
        defaults = [None] * 4 + ["", "", "1"]  # the optional fields are left off when at their default
        while parts[-1] == defaults[len(parts) - 1]:
            parts.pop()
        return ":".join(parts)


# ------------------------------------------------------------------------------------ parent side


def run_in_subprocess(backend: str, mesh: str, cases: Iterable[Any], save: Path | None = None,
                      timeout: float = 1200, plan: Any = None,
                      distributed: dict[str, Any] | None = None, lora: list[dict[str, Any]] | None = None,
                      lora_mode: str = "layers") -> list[dict[str, Any]]:
    """Run ``cases`` for one backend on one mesh in a fresh process; returns the result dicts,
    each with ``ok``: PCC at or above the dtype's threshold (``threshold``) and, fp32 on CPU, the
    largest |difference| within ``max_abs_bound`` (:func:`~wan_sharding.jobs.pcc.grade`; on ``tt``
    the hardware PCC table alone). BackendError, before any process
    starts, when the backend's stack is missing (``tt`` without Tenstorrent's stack).
    ``plan``: a ShardingPlan applied instead of the preset's roles (``mesh`` is then its mesh name;
    each case's padding must be the plan's). ``cases``: the DiT's (:class:`Case`) and the text
    encoder's (:class:`~wan_sharding.jobs.text_encoder.EncoderCase`), in any mix: one worker runs them all.
    ``distributed``: a tt launch over several hosts (:func:`~wan_sharding.jobs.launch.worker_env`).
    ``lora``: adapters (:class:`~wan_sharding.lora.files.LoraRequest` fields) loaded into each DiT
    case before it runs, unsharded and sharded; ``lora_mode="fuse"``: merged first."""
    from ..mesh import mesh_from_preset

    params = {"backend": backend, "mesh": mesh, "cases": [str(c) for c in cases],
              "save": None if save is None else str(save), "plan": None if plan is None else plan.to_dict(),
              "lora": list(lora or []), "lora_mode": lora_mode}
    devices = plan_devices(plan) if plan is not None else mesh_from_preset(mesh).num_devices
    run = run_worker("wan_sharding.jobs.check", params, worker_env(backend, devices, distributed),
                     label=f"{backend} check worker on {mesh}", timeout=timeout, stall_s=stall_seconds(backend))
    if not run.ok:
        raise WorkerError(f"{backend} worker on {mesh} failed (exit {run.returncode}):\n{run.output[-4000:]}")
    for r in run.results:
        g = grade(backend, r["dtype"])  # tt: the hardware table (tt vs the CPU reference)
        r["threshold"], r["max_abs_bound"] = g.pcc, g.max_abs
        r["ok"] = g.passes(r["pcc"], r["max_abs"])
    return run.results


# ------------------------------------------------------------------------------------ worker side


def run_case(backend_name: str, mesh_name: str, case: Case, save: Path | None = None, plan: Any = None,
             lora: list[dict[str, Any]] | None = None, lora_mode: str = "layers") -> dict[str, Any]:
    """Build the tiny DiT (with ``lora``'s adapters: the high-noise expert's), run it unsharded and
    sharded on this process's devices, compare."""
    import torch

    from ..compose import shard_dit
    from ..models import build_dit, dit_inputs, guidance_pair
    from ..options import torch_dtype

    dtype = torch_dtype(case.dtype)
    dit = build_dit(case.variant, "tiny", dtype=dtype, **case.overrides())
    if lora:
        from ..lora.files import LoraRequest
        from ..lora.load import load_into_dit

        load_into_dit(dit, [LoraRequest(**r) for r in lora], fuse=lora_mode == "fuse")
    inputs = dit_inputs(case.variant, case.latent(), dtype=dtype, batch=case.batch)
    with torch.no_grad():
        if plan is not None and plan.cfg_axes:
            # CFG parallel: the step's cond and uncond calls as one batch, against the two unsharded
            # forwards the pipeline would make one after the other
            cond, uncond, inputs = guidance_pair(inputs)
            reference = torch.cat([dit(**cond, return_dict=False)[0], dit(**uncond, return_dict=False)[0]])
        else:
            reference = dit(**inputs, return_dict=False)[0]

    start = time.perf_counter()
    sharded = copy.deepcopy(dit)  # rewrites and the device move act on the copy: the reference stays vanilla
    handle = shard_dit(sharded, plan if plan is not None else mesh_name, backend=backend_name, padding=case.padding,
                       patches=case.patches.split("+") if case.patches else ())
    backend = handle.backend
    with torch.no_grad():
        # Compile once and run that program, so the collectives are read off what ran.
        program = backend.compile(sharded, handle.placed, **inputs)
        out = backend.to_host(program())
        collectives = backend.collective_counts(program)
    seconds = time.perf_counter() - start
    info = handle.sp.describe()
    specs = handle.specs
    handle.remove()

    value, max_abs = compare(reference, out)
    result = {
        "component": "dit", "backend": backend_name, "mesh": mesh_name, "plan": None if plan is None else plan.name,
        "case": str(case), **asdict(case),
        "shape": list(out.shape), "pcc": value, "max_abs": max_abs, "seconds": round(seconds, 2),
        "params": specs.counts(), "tokens": info["last_tokens"], "padded_tokens": info["last_padded_tokens"],
        "sp_points": len(info["sp_points"]),
        "collectives": collectives,
    }
    if save is not None:
        result["saved"] = save_pair(save, f"{backend_name}-{mesh_name}-{case.key}", reference, out)
    return result


def _job(params: dict[str, Any]):
    import torch

    prepare_worker(params["backend"])
    torch.set_grad_enabled(False)  # inference only, in the whole worker (its forwards are no_grad too)
    save = Path(params["save"]) if params.get("save") else None
    plan = None
    if params.get("plan"):
        from ..plan import ShardingPlan

        plan = ShardingPlan.from_dict(params["plan"])
    for text in params["cases"]:
        if text.startswith(ENCODER_CASE_PREFIX):  # the UMT5 text encoder's cases, in the same worker
            yield run_encoder_case(params["backend"], params["mesh"], EncoderCase.parse(text), save, plan=plan)
        else:
            yield run_case(params["backend"], params["mesh"], Case.parse(text), save, plan=plan,
                           lora=params.get("lora"), lora_mode=params.get("lora_mode", "layers"))


if __name__ == "__main__":
    from ..backends import BackendError

    sys.exit(worker_main(_job, expected=(BackendError,)))
