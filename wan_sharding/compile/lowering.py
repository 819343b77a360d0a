"""The worker side of a compile: build, shard, trace, lower and compile one request in this process.

The Tenstorrent JAX plugin (``jax-tt-plugin``) compiles for real when
``TT_COMPILE_ONLY_SYSTEM_DESC`` names a system descriptor; it never opens a chip. The model is
the unmodified diffusers DiT built on the ``meta`` device, run as a JAX function through torchax
(:class:`~wan_sharding.backends.jax.JaxBackend`): weights, buffers and inputs are
``jax.ShapeDtypeStruct`` stand-ins with their ``NamedSharding``, so the full 14B expert compiles
with ~1.5 GB of host memory and no weights. Every argument is marked with its role (weights
``parameter``, buffers ``constant``, inputs ``input``) as tt-xla's JAX plugin marks weights
(:mod:`.marking`), unless the request asks for none.

Only the compile worker (:mod:`wan_sharding.compile.worker`) calls :func:`compile_in_process`: it
imports JAX, which must already see the tt devices. The caller's side (descriptor, environment,
process, results) is :mod:`wan_sharding.compile.runner`.
"""

from __future__ import annotations

import re
import tempfile
import time
from pathlib import Path
from typing import Any

from ..models import PER_TOKEN_TIMESTEPS, PROMPT_TOKENS, config_for
from ..options import torch_dtype
from .request import CompileError, CompileRequest


def _find_ir(out_dir: Path, stage: str) -> str | None:
    # The plugin writes <out>/irs/<stage>_<timestamp>.mlir; "ttnn_runtime_*" is a second TTNN dump.
    hits = sorted(p for p in (out_dir / "irs").glob(f"{stage}_*.mlir") if re.fullmatch(rf"{stage}_\d+\.mlir", p.name))
    return str(hits[-1]) if hits else None


def compile_in_process(req: CompileRequest) -> dict[str, Any]:
    """Build, shard, lower and compile one request in this process. Worker side only: imports
    JAX, which must already see the tt devices (``TT_COMPILE_ONLY_SYSTEM_DESC`` set at start)."""
    import jax

    from ..backends.jax import JaxBackend

    t0 = time.perf_counter()
    mesh = req.mesh_spec()
    devices = jax.devices()
    if devices[0].platform != "tt":
        raise CompileError(
            f"JAX platform is {devices[0].platform!r}, not 'tt': TT_COMPILE_ONLY_SYSTEM_DESC was not honoured")
    if len(devices) < mesh.num_devices:
        raise CompileError(f"mesh {mesh.name} needs {mesh.num_devices} devices; the descriptor gives {len(devices)}")
    if req.component == "text-encoder":
        from .text_encoder import encoder_mesh, jax_encoder

        backend = JaxBackend(encoder_mesh(mesh), devices=list(devices[: mesh.num_devices]))
        model, handle, inputs, fused, info = jax_encoder(req, backend)
    else:
        backend = JaxBackend(mesh, devices=list(devices[: mesh.num_devices]))
        model, handle, inputs, fused, info = _jax_dit(req, backend)
    try:
        t1 = time.perf_counter()
        forward, marked = _marked_forward(backend.jax_forward(model, fused_sdpa=fused), model, req, inputs)
        lowered = jax.jit(forward).lower(handle.placed, (), inputs)
        t2 = time.perf_counter()
        out_dir = Path(req.out_dir or tempfile.mkdtemp(prefix="wan_ir_"))
        out_dir.mkdir(parents=True, exist_ok=True)
        result: dict[str, Any] = {
            "out_dir": str(out_dir), "lower_seconds": round(t2 - t1, 3), **info(),
            "sdpa_fused": fused.fused if fused is not None else 0,
            "sdpa_plain": fused.plain if fused is not None else None,
            "composites_marked": fused.counts() if fused is not None else {},
            "arguments_marked": marked,
        }
        _compile_with_options(lambda o: lowered.compile(compiler_options={"export_path": str(out_dir), **o}),
                             req, result)
        t3 = time.perf_counter()
        result.update(compile_seconds=round(t3 - t2, 3), total_seconds=round(t3 - t0, 3))
        return _with_irs(result, out_dir)
    finally:
        handle.remove()


def _jax_dit(req: CompileRequest, backend: Any) -> tuple:
    """The DiT of ``req`` on the meta device, sharded the ordinary way on ``backend`` (abstract
    weights), its abstract inputs, the composites mode and what the SP hooks recorded (after the
    trace): ``(dit, handle, inputs, composites, info)``."""
    import jax
    import jax.numpy as jnp

    from ..compose import shard_dit
    from ..models import build_dit
    from ..patches.prompt_kv import prompt_cache, prompt_state_like
    from .composites import HardwareComposites

    mesh = backend.mesh
    dtype = torch_dtype(req.dtype)
    overrides = {} if req.blocks is None else {"num_layers": req.blocks}
    dit = build_dit(req.variant, req.size, device="meta", dtype=dtype, **overrides)
    if req.lora_rank:  # LoRA layers on the meta model: their weights split beside their bases'
        from ..lora.tiny import add_wan_lora

        add_wan_lora(dit, req.lora_rank)
    # The ordinary composition; on a meta model the jax backend's placement is abstract (shapes and
    # shardings, no weights). With a plan, its roles, FSDP, layout and padding apply.
    handle = shard_dit(dit, req.plan if req.plan is not None else mesh, backend=backend, padding=req.padding,
                       patches=req.patches or (), anchor=req.anchor)
    sp = handle.sp
    try:
        rep = backend.sharding(())
        cfg = config_for(req.variant, req.size)
        act = {"bf16": jnp.bfloat16, "fp32": jnp.float32}[req.dtype]
        f, h, w = req.latent
        ts_shape = (req.batch, req.tokens) if req.variant in PER_TOKEN_TIMESTEPS else (req.batch,)
        # Replicated; on a cfg mesh the batch of (cond, uncond) rows split over the cfg axis.
        placed = ((lambda shape: backend.sharding(mesh.batch_spec(shape))) if mesh.cfg_axis is not None
                  else (lambda shape: rep))
        hidden_shape = (req.batch, cfg["in_channels"], f, h, w)
        text_shape = (req.batch, PROMPT_TOKENS[req.size], cfg["text_dim"])
        inputs = {
            "hidden_states": jax.ShapeDtypeStruct(hidden_shape, act, sharding=placed(hidden_shape)),
            "timestep": jax.ShapeDtypeStruct(ts_shape, getattr(jnp, req.timestep_dtype), sharding=placed(ts_shape)),
            "encoder_hidden_states": jax.ShapeDtypeStruct(text_shape, act, sharding=placed(text_shape)),
        }
        if prompt_cache(dit) is not None:  # prompt_kv: the step takes the prompt's K / V, made once per prompt
            inputs["encoder_hidden_states"] = prompt_state_like(
                dit, req.batch, PROMPT_TOKENS[req.size], mesh,
                lambda shape, spec: jax.ShapeDtypeStruct(shape, act, sharding=backend.sharding(spec)))
        fused = (HardwareComposites(backend, dit, req.composites, split_tokens=lambda: sp.state.padded_len)
                 if req.composites != "none" else None)
    except BaseException:
        handle.remove()
        raise
    info = lambda: {"sp_points": sp.points, "tokens": sp.state.valid_len, "padded_tokens": sp.state.padded_len}  # noqa: E731
    return dit, handle, inputs, fused, info


def _marked_forward(forward: Any, dit: Any, req: CompileRequest, inputs: dict[str, Any]) -> tuple[Any, dict[str, int]]:
    """The torchax forward with every argument marked with its role, as tt-xla's JAX plugin marks
    weights (:func:`.marking.mark_jax_arguments`), and the markers by role; ``forward`` itself and
    no markers when the request asks for none."""
    if not req.mark_arguments:
        return forward, {}
    from collections import Counter

    from .marking import INPUT, argument_roles, mark_jax_arguments

    roles = argument_roles(dit)
    counts = Counter(roles.values())
    counts[INPUT] += len(inputs)
    return mark_jax_arguments(forward, roles), dict(counts)


# What the plugin says when its TTIR -> TTNN pipeline fails; with DRAM space saving on, that is what
# tt-mlir 0.1.3 gives for the tiny torch-xla lowering of diffusers' RoPE at every level: its
# ttnn-memory-management patterns do not converge (no diagnostic; docs/compile-hardware.md).
_TTNN_PIPELINE_FAILED = "Failed to run TTIRToTTNNCommon pipeline"
DRAM_NOTE = ("experimental-enable-dram-space-saving-optimization=true failed in tt-mlir's TTIR -> TTNN pipeline "
             "('Failed to run TTIRToTTNNCommon pipeline', no diagnostic); compiled again with it false")


def _compile_with_options(compile: Any, req: CompileRequest, result: dict[str, Any]) -> None:
    """``compile(plugin options)`` with the request's options; where DRAM space saving makes tt-mlir's
    TTNN pipeline fail, once more without it (``options_note`` says so). Fills ``ok``, ``error``,
    ``options_used``."""
    import dataclasses

    options = req.options()
    try:
        compile(options.plugin_options())
        result.update(ok=True, options_used=options.plugin_options())
        return
    except Exception as e:  # the plugin raises XlaRuntimeError / JaxRuntimeError when tt-mlir rejects it
        result.update(ok=False, error=f"{type(e).__name__}: {e}"[:8000], options_used=options.plugin_options())
        if not (options.dram_space_saving and _TTNN_PIPELINE_FAILED in str(e)):
            return
    retry = dataclasses.replace(options, dram_space_saving=False)
    print(f"wan_sharding.compile: {DRAM_NOTE}", flush=True)
    try:
        compile(retry.plugin_options())
        result.update(ok=True, error=None, options_used=retry.plugin_options(), options_note=DRAM_NOTE)
    except Exception as e:
        result.update(error=f"{type(e).__name__}: {e}"[:8000], options_used=retry.plugin_options())


def _with_irs(result: dict[str, Any], out_dir: Path) -> dict[str, Any]:
    """Add the exported IR paths and the peak memory; a compile without TTNN IR is a failure."""
    import resource

    result.update(ttnn_path=_find_ir(out_dir, "ttnn"), ttir_path=_find_ir(out_dir, "ttir"),
                  frontend_ir_path=_find_ir(out_dir, "shlo_frontend"),
                  rss_mb=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1))
    if result["ok"] and not result["ttnn_path"]:
        result.update(ok=False, error=f"compiled but no TTNN IR was exported under {out_dir}/irs")
    return result


def compile_traced(req: CompileRequest, traced: dict[str, Any]) -> dict[str, Any]:
    """Compile what the torch-xla frontend traced (:mod:`.xla_lowering`: its result for ``req``,
    with the Shardy module's path) on the tt client; worker side only."""
    from .tt_client import compile_stablehlo_text

    out_dir = Path(req.out_dir or tempfile.mkdtemp(prefix="wan_ir_"))
    result = {k: traced[k] for k in ("stablehlo_path", "trace_seconds", "trace_rss_mb", "sp_points", "tokens",
                                     "padded_tokens", "sdpa_fused", "sdpa_plain", "composites_marked",
                                     "arguments_marked") if k in traced}
    result.update(out_dir=str(out_dir), lower_seconds=traced.get("trace_seconds"))
    t0 = time.perf_counter()
    text = Path(traced["stablehlo_path"]).read_text()
    _compile_with_options(lambda o: compile_stablehlo_text(text, req.num_devices, out_dir, o), req, result)
    seconds = round(time.perf_counter() - t0, 3)
    result.update(compile_seconds=seconds, total_seconds=round(seconds + (traced.get("trace_seconds") or 0), 3))
    return _with_irs(result, out_dir)
