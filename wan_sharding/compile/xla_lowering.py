"""The torch-xla frontend: the StableHLO that Tenstorrent hardware compiles, made on the CPU.

Tenstorrent's torch stack traces a model with torch-xla SPMD, lowers it with GSPMD shardings,
converts those to Shardy (their torch-xla build does it when ``CONVERT_SHLO_TO_SHARDY=1``) and
wraps bf16 attention in the fused SDPA composite; tt-mlir then compiles that module. This module
does the same with stock torch-xla on CPU virtual devices, in its own worker process
(``python -m wan_sharding.compile.xla_lowering``, started by :mod:`.runner`):

1. build the DiT, shard it the ordinary way (:func:`~wan_sharding.compose.shard_dit` with an
   :class:`~wan_sharding.backends.xla.XlaBackend`: ``xs.mark_sharding`` on every weight, the SP
   hooks);
2. trace one forward lazily (nothing executes) under :class:`.composites.HardwareComposites`,
   with every scalar inlined as a constant (the composite's body may not use values from
   outside it; torch-xla's own exporter does the same) and every argument marked parameter /
   constant / input as tt-xla's torch backend marks it (:class:`.marking.XlaArgumentMarks`);
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

from ..runtime import workers
from .request import CompileError, CompileRequest

GSPMD_FILE = "stablehlo_gspmd.mlir"
SHARDY_FILE = "stablehlo_shardy.mlir"


def trace_in_process(req: CompileRequest) -> dict[str, Any]:
    """Trace one request with torch-xla SPMD and write its Shardy module; worker side only."""
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm

    from ..backends.xla import XlaBackend
    from .shardy import gspmd_to_shardy

    t0 = time.perf_counter()
    mesh = req.mesh_spec()
    if req.component == "text-encoder":
        from .text_encoder import encoder_mesh, xla_encoder

        backend = XlaBackend(encoder_mesh(mesh))
        model, handle, inputs, fused, info = xla_encoder(req, backend)
    else:
        backend = XlaBackend(mesh)
        model, handle, inputs, fused, info = _xla_dit(req, backend)
    try:
        marks = argument_marks(model, inputs) if req.mark_arguments else None
        t1 = time.perf_counter()
        torch_xla._XLAC._set_xla_all_numbers_special_scalars(True)
        try:
            # the marks inside the composites: a composite's operands are then the marked values
            with torch.no_grad(), (fused if fused is not None else contextlib.nullcontext()), \
                    (marks if marks is not None else contextlib.nullcontext()):
                out = model(**inputs, return_dict=False)[0]
            gspmd = xm.get_stablehlo([out])
        finally:
            torch_xla._XLAC._set_xla_all_numbers_special_scalars(False)
        check_marks(marks)
        shardy = gspmd_to_shardy(gspmd, mesh.shape, mesh.axis_names)
        t2 = time.perf_counter()
        out_dir = Path(req.out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        workers.atomic_write(out_dir / GSPMD_FILE, gspmd)
        workers.atomic_write(out_dir / SHARDY_FILE, shardy)
        return {
            "ok": True, "stablehlo_path": str(out_dir / SHARDY_FILE), "trace_seconds": round(t2 - t0, 3),
            "build_seconds": round(t1 - t0, 3), **info(), "sdpa_fused": fused.fused if fused is not None else 0,
            "sdpa_plain": fused.plain if fused is not None else None,
            "composites_marked": fused.counts() if fused is not None else {},
            "arguments_marked": dict(marks.counts) if marks is not None else {},
            "trace_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        }
    finally:
        handle.remove()


def _xla_dit(req: CompileRequest, backend: Any) -> tuple:
    """The DiT of ``req`` with uninitialised host weights, sharded the ordinary way on ``backend``
    (patches, specs, placement, SP hooks; with a plan, its roles, FSDP, layout and padding), its
    inputs on the device, the composites mode and what the SP hooks recorded (after the trace):
    ``(dit, handle, inputs, composites, info)``."""
    import torch
    import torch_xla.distributed.spmd as xs

    from ..compose import shard_dit
    from ..models import PER_TOKEN_TIMESTEPS, PROMPT_TOKENS, build_dit, config_for
    from ..options import torch_dtype
    from ..patches.prompt_kv import prompt_cache, prompt_state_like
    from .composites import HardwareComposites

    mesh = backend.mesh
    dtype = torch_dtype(req.dtype)
    overrides = {} if req.blocks is None else {"num_layers": req.blocks}
    # Uninitialised host weights: a compile reads shapes and dtypes, never values.
    dit = build_dit(req.variant, req.size, device="meta", dtype=dtype, **overrides)
    if req.lora_rank:  # LoRA layers, made weightless, then given storage with the rest
        from ..lora.tiny import add_wan_lora

        add_wan_lora(dit, req.lora_rank)
    dit = dit.to_empty(device="cpu")
    handle = shard_dit(dit, req.plan if req.plan is not None else mesh, backend=backend, padding=req.padding,
                       patches=req.patches or (), anchor=req.anchor, keep_host_weights=False)
    sp = handle.sp
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
        if mesh.cfg_axis is not None:  # a batch of (cond, uncond) rows, split over the cfg axis
            for t in inputs.values():
                xs.mark_sharding(t, backend.native_mesh, mesh.batch_spec(t.shape))
        if prompt_cache(dit) is not None:  # prompt_kv: the step takes the prompt's K / V, made once per prompt
            def placed_zeros(shape: tuple[int, ...], spec: tuple) -> torch.Tensor:
                t = torch.zeros(shape, dtype=dtype).to(dev)
                xs.mark_sharding(t, backend.native_mesh, spec)
                return t

            inputs["encoder_hidden_states"] = prompt_state_like(dit, req.batch, PROMPT_TOKENS[req.size], mesh,
                                                                placed_zeros)
        fused = (HardwareComposites(backend, dit, req.composites, split_tokens=lambda: sp.state.padded_len)
                 if req.composites != "none" else None)
    except BaseException:
        handle.remove()
        raise
    info = lambda: {"sp_points": sp.points, "tokens": sp.state.valid_len, "padded_tokens": sp.state.padded_len}  # noqa: E731
    return dit, handle, inputs, fused, info


def argument_marks(dit: Any, inputs: dict[str, Any]) -> Any:
    """The mode that marks every argument of the trace with its role, as tt-xla's torch backend does
    (:class:`.marking.XlaArgumentMarks`)."""
    from .marking import XlaArgumentMarks

    return XlaArgumentMarks(dit, inputs)


def check_marks(marks: Any) -> None:
    """A buffer or input the forward changed in place cannot be a constant: tt-xla would mark it an
    input. The Wan DiT changes none; say so plainly if a patch ever does."""
    if marks is not None and marks.mutated:
        raise CompileError(f"argument marking: the forward changes {', '.join(marks.mutated)} in place, which "
                           "tt-xla marks as an input, not a constant; compile with --no-argument-marks")


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
