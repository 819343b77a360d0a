"""The torch-xla frontend: the StableHLO that Tenstorrent hardware compiles, made on the CPU.

Tenstorrent's torch stack traces a model with torch-xla SPMD, lowers it with GSPMD shardings,
converts those to Shardy (their torch-xla build does it when ``CONVERT_SHLO_TO_SHARDY=1``) and
wraps bf16 attention in the fused SDPA composite; tt-mlir then compiles that module. This module
does the same with stock torch-xla on CPU virtual devices, in its own worker process
(``python -m wan_sharding.compile.xla_lowering``, started by :mod:`.runner`):

1. build the DiT, shard it the ordinary way (``shard_dit_specs`` + ``xs.mark_sharding`` through
   :class:`~wan_sharding.backends.xla.XlaBackend`, ``apply_dit_sp_activation_sharding(...,
   backend="xla")``);
2. trace one forward lazily (nothing executes) under :class:`.composites.HardwareComposites`,
   with every scalar inlined as a constant (the composite's body may not use values from
   outside it; torch-xla's own exporter does the same);
3. take the pre-partitioning module (``xm.get_stablehlo``: global shapes, GSPMD shardings),
   convert it to Shardy (:func:`.shardy.gspmd_to_shardy`) and write it next to the IRs.

The compile worker then compiles that text (:func:`.tt_client.compile_stablehlo_text`). torch-xla
needs weights in memory (there is no abstract-weight path): they are left uninitialised (values
do not matter to a compile), but a full-width block still costs ~0.7 GB in bf16 on the host plus
torch-xla's device copy, so keep full-width traces to a few blocks.
"""

from __future__ import annotations

import contextlib
import resource
import sys
import time
from pathlib import Path
from typing import Any, Iterator

from .. import workers
from .request import CompileRequest

GSPMD_FILE = "stablehlo_gspmd.mlir"
SHARDY_FILE = "stablehlo_shardy.mlir"


def trace_in_process(req: CompileRequest) -> dict[str, Any]:
    """Trace one request with torch-xla SPMD and write its Shardy module; worker side only."""
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm

    from ..activation import apply_dit_sp_activation_sharding
    from ..backends.xla import XlaBackend
    from .composites import HardwareComposites
    from ..models import PER_TOKEN_TIMESTEPS, PROMPT_TOKENS, build_dit, config_for
    from ..options import torch_dtype
    from ..specs import shard_dit_specs
    from .shardy import gspmd_to_shardy

    t0 = time.perf_counter()
    mesh = req.mesh_spec()
    dtype = torch_dtype(req.dtype)
    overrides = {} if req.blocks is None else {"num_layers": req.blocks}
    # Uninitialised host weights: a compile reads shapes and dtypes, never values.
    dit = build_dit(req.variant, req.size, device="meta", dtype=dtype, **overrides).to_empty(device="cpu")
    if req.patches:  # rewrites first, then specs and SP (wan_sharding.patches)
        from ..patches import apply_patches

        apply_patches(dit, req.patches, mesh=req.plan if req.plan is not None else mesh)
    specs = shard_dit_specs(dit, req.plan) if req.plan is not None else shard_dit_specs(dit, mesh)
    backend = XlaBackend(mesh)
    backend.place(dit, specs)
    handle = apply_dit_sp_activation_sharding(dit, mesh, backend=backend, padding=req.padding, plan=req.plan,
                                              anchor=req.anchor)
    try:
        cfg = config_for(req.variant, req.size)
        dev = backend.device
        f, h, w = req.latent
        ts_shape = (req.batch, req.tokens) if req.variant in PER_TOKEN_TIMESTEPS else (req.batch,)
        inputs = {
            "hidden_states": torch.zeros(req.batch, cfg["in_channels"], f, h, w, dtype=dtype).to(dev),
            "timestep": torch.zeros(ts_shape, dtype=getattr(torch, req.timestep_dtype)).to(dev),
            "encoder_hidden_states": torch.zeros(req.batch, PROMPT_TOKENS[req.size], cfg["text_dim"],
                                                 dtype=dtype).to(dev),
        }
        fused = HardwareComposites(backend, dit, req.composites, split_tokens=lambda: handle.state.padded_len) if req.composites != "none" else None
        t1 = time.perf_counter()
        torch_xla._XLAC._set_xla_all_numbers_special_scalars(True)
        try:
            with torch.no_grad(), (fused if fused is not None else contextlib.nullcontext()):
                out = dit(**inputs, return_dict=False)[0]
            gspmd = xm.get_stablehlo([out])
        finally:
            torch_xla._XLAC._set_xla_all_numbers_special_scalars(False)
        shardy = gspmd_to_shardy(gspmd, mesh.shape, mesh.axis_names)
        t2 = time.perf_counter()
        out_dir = Path(req.out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        workers.atomic_write(out_dir / GSPMD_FILE, gspmd)
        workers.atomic_write(out_dir / SHARDY_FILE, shardy)
        return {
            "ok": True, "stablehlo_path": str(out_dir / SHARDY_FILE), "trace_seconds": round(t2 - t0, 3),
            "build_seconds": round(t1 - t0, 3), "sp_points": handle.points, "tokens": handle.state.valid_len,
            "padded_tokens": handle.state.padded_len, "sdpa_fused": fused.fused if fused is not None else 0,
            "sdpa_plain": fused.plain if fused is not None else None,
            "composites_marked": fused.counts() if fused is not None else {},
            "trace_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        }
    finally:
        handle.remove()


def trace_batch(params: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """The worker's job: trace every request (all on this process's device count)."""
    from ..backends.xla import enable_spmd

    enable_spmd()
    for raw in params["requests"]:
        raw = dict(raw)
        index = raw.pop("index")
        req = CompileRequest.from_json(raw)
        print(f"tracing {req.label()}", flush=True)
        try:
            yield {"index": index, **trace_in_process(req)}
        except Exception as e:  # a model the frontend cannot trace: a failed result, not a dead batch
            import traceback

            traceback.print_exc()
            yield {"index": index, "ok": False, "error": f"torch-xla trace failed: {type(e).__name__}: {e}"[:8000]}


if __name__ == "__main__":
    sys.exit(workers.worker_main(trace_batch))
