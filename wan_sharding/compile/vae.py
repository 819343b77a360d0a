"""tt-mlir compile-only of the sharded VAE: one decode step (a latent frame) through the real
compiler, and its collective bill.

The VAE is built at its real config on the ``meta`` device (weights are shape stand-ins), sharded
with ``shard_vae`` on the tt devices of a system descriptor, and one of a decode's step programs
(:mod:`wan_sharding.vae.programs`), the very ``jax.jit`` the JAX backend runs for that step
(``JaxBackend.step_program``), is lowered through torchax and compiled by ``jax-tt-plugin`` (with
``--frontend torch-xla``: the lazy trace the ``xla`` backend runs, ``XlaBackend.step_program``):
``first``, the first latent frame's (what ``handle.decode`` runs for a one-frame latent), or
``steady``, the third's, which every later latent frame reuses: its cache holds two frames and its
upsampled stages four frames per latent frame, so its halos are the largest of a decode (the
steps before it are traced for their cache's shapes, not compiled). The TTNN module is read with
the one TTNN parser (:mod:`.ttnn_ir`); the bill rule for a decode step (``vae_bill``): no collective
may move more than one latent-resolution frame at the mid block's width (the mid-block attention's
K and V gathers, a frame each); every other collective is a halo (a few boundary rows).

The worker (``python -m wan_sharding.compile.vae``) runs in its own process with the descriptor
set before JAX starts, as the DiT's compile worker does (:mod:`.runner`).
"""

from __future__ import annotations

import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from ..mesh import mesh_from_preset
from ..models import VIDEO_PIXELS, vae_config, vae_latent_hw
from ..vae.layout import frame_values, plan_frame, widest_scale
from .request import CompileError

PIXELS = VIDEO_PIXELS  # the resolutions a compile takes (models.py's one table)
# The decode steps a compile can take, by the index of the latent frame whose program it is: the
# first (no cache yet), the second (a cache of one frame) and the third (a full cache: the program
# every later frame reuses). A decode of three latent frames or more runs all three.
STEPS = {"first": 0, "second": 1, "steady": 2}
# Kinds the parser lists beside the collectives that move nothing between chips: ``mesh_partition``
# keeps each chip's own piece of a replicated tensor (a local slice).
LOCAL_KINDS = ("mesh_partition",)


@dataclass(frozen=True)
class VaeCompileRequest:
    """One compile: the VAE ``kind`` at its real config, the ``mesh``, a ``resolution`` (its latent
    frame) and the ``strategy``."""

    kind: str = "wan2.1"
    mesh: str = "2x4"
    resolution: str = "480p"
    strategy: str = "halo"
    dtype: str = "bf16"
    frontend: str = "torchax"  # or "torch-xla": traced lazily with real (uninitialised) weights
    step: str = "first"  # or "steady" (STEPS)
    size: str = "full"  # or "tiny": the tests' VAE of the same structure, at the same frame

    def latent_hw(self) -> tuple[int, int]:
        """The latent frame of the resolution's video for this VAE (8x or 16x spatial compression)."""
        return vae_latent_hw(self.kind, self.resolution)

    def label(self) -> str:
        return f"vae {self.kind} {self.mesh} {self.resolution} {self.strategy} {self.frontend} {self.step}"


def frame_bytes(req: VaeCompileRequest) -> int:
    """Bytes of one latent-resolution frame at the mid block's width, as it lies on the mesh (H and W
    padded to whole shards, in the orientation the handle picks for it): what each of the mid-block
    attention's K and V gathers."""
    cfg = vae_config(req.kind, req.size)
    frame = plan_frame(*req.latent_hw(), mesh_from_preset(req.mesh), "mask", 1, "latent frame",
                       widest_scale(cfg, "decode"))
    return frame_values(cfg, "decode", frame) * (2 if req.dtype == "bf16" else 4)


def xla_trace_bytes(req: VaeCompileRequest) -> int:
    """Host bytes a torch-xla trace of one decode step holds: the decoder's weights (:func:`_decoder_only`)
    as real buffers once per virtual CPU device, and 70 % more for the step's cache and activations
    (measured peak: 14.3 GB for Wan 2.2's steady step on 2x4 at 720p, whose weights alone count 8.3 GiB).
    Wan 2.2's 555 M bf16 decoder parameters on 8x4: 56 GiB."""
    import torch
    from diffusers import AutoencoderKLWan

    with torch.device("meta"):  # shapes only; built as is (a cast here would log diffusers' fp32 notice)
        vae = _decoder_only(AutoencoderKLWan(**vae_config(req.kind, req.size)))
    per_copy = sum(p.numel() for p in vae.parameters()) * (2 if req.dtype == "bf16" else 4)
    return per_copy * mesh_from_preset(req.mesh).num_devices * 17 // 10


def check_vae_request(req: VaeCompileRequest) -> None:
    """What a compile request can be refused for before any worker starts: a torch-xla trace that
    would not fit this host's memory (CompileError naming the way out)."""
    from .request import host_memory_bytes

    if req.frontend == "torch-xla" and xla_trace_bytes(req) > host_memory_bytes() * 3 // 4:
        raise CompileError(
            f"the torch-xla frontend holds the VAE decoder's weights once per virtual device "
            f"({mesh_from_preset(req.mesh).num_devices}) in host memory: about {xla_trace_bytes(req) / 2**30:.0f} GiB "
            f"for {req.kind} on {req.mesh}, more than 3/4 of this host's {host_memory_bytes() / 2**30:.0f} GiB; "
            "use --frontend torchax (abstract weights: the same program) or a smaller --mesh")


def _decoder_only(vae: Any) -> Any:
    """``vae`` without its encoder and ``quant_conv``, which a decode step never runs: a torch-xla
    trace then places only the decoder's weights on its devices (555 M of Wan 2.2's 705 M)."""
    del vae.encoder, vae.quant_conv
    return vae


def _dims(tensor: str) -> list[int]:
    """The shape of a collective table's tensor type (``"1152x1x32x4x2xbf16"`` -> ``[1152, 1, 32, 4, 2]``)."""
    return [int(d) for d in tensor.split("x")[:-1]]


def _halo_axis_size(c: dict[str, Any]) -> int | None:
    """For a halo collective, how many shards its gather collects: the gathered dim's length in the
    result over the payload's, where each chip contributes one shard's block of boundary rows (the
    ``(lead, nh, rows, nw, cols)`` view of ``vae/halo.py``: a 1 on the shard dim). 1 for a
    point-to-point transfer (neighbour-only by nature); ``None``: not a halo (the mid-block
    attention's K and V gathers contribute a whole shard of the frame, not a block of rows)."""
    if c["kind"] == "point_to_point":
        return 1
    if c["kind"] != "all_gather":
        return None
    payload, result = _dims(c["payload"]), _dims(c["result"])
    grown = [(p, r) for p, r in zip(payload, result) if p != r] if len(payload) == len(result) else []
    return grown[0][1] if len(grown) == 1 and grown[0][0] == 1 else None


def halo_traffic(collectives: list[dict[str, Any]]) -> dict[str, Any]:
    """The halo of one compiled step against the neighbour-only minimum, per chip: ``halo_bytes``,
    what the halo all-gathers hand each chip (every shard's boundary rows on the axis: the gathered
    result); ``halo_neighbour_bytes``, what the chip needs of them (the rows of its two neighbours:
    one shard's worth of boundary rows, the gather's payload); ``halo_ratio``, the one over the
    other (the axis length, averaged over the step's bytes: 2 and 4 on 2x4, 4 and 8 on 8x4)."""
    halos = [(c, n) for c in collectives for n in [_halo_axis_size(c)] if n is not None]
    moved = sum(c["bytes"] * c["count"] for c, _ in halos)
    needed = sum(c["bytes"] * c["count"] // n for c, n in halos)
    return {"halo_bytes": moved, "halo_neighbour_bytes": needed, "halo_collectives": sum(c["count"] for c, _ in halos),
            "halo_ratio": round(moved / needed, 2) if needed else None}


def vae_bill(collectives: list[dict[str, Any]], limit: int) -> dict[str, Any]:
    """The bill of one decode step: the largest collective, the halo (:func:`halo_traffic`), the
    mid-block attention's gathers (``attention_gathers`` / ``attention_gather_bytes``: every
    all-gather that is no halo, K and V over each split axis), and whether it holds (nothing above
    ``limit`` bytes). Local ops (``LOCAL_KINDS``) are counted apart and move nothing."""
    local = sum(c["count"] for c in collectives if c["kind"] in LOCAL_KINDS)
    collectives = [c for c in collectives if c["kind"] not in LOCAL_KINDS]
    attention = [c for c in collectives if c["kind"] == "all_gather" and _halo_axis_size(c) is None]
    largest = max((c["bytes"] for c in collectives), default=0)
    problems = [f"{c['kind']} of {c['bytes']} bytes ({c['result']}) moves more than one latent frame ({limit} bytes)"
                for c in collectives if c["bytes"] > limit]
    return {"largest_collective_bytes": largest, "frame_limit_bytes": limit, **halo_traffic(collectives),
            "collective_bytes": sum(c["bytes"] * c["count"] for c in collectives),
            "collective_count": sum(c["count"] for c in collectives), "local_slices": local,
            "attention_gathers": sum(c["count"] for c in attention),
            "attention_gather_bytes": sum(c["bytes"] * c["count"] for c in attention),
            "bill_ok": not problems, "bill_problems": problems}


def refusal(error: str | None, limit: int = 300) -> str:
    """tt-mlir's refusal in one line of at most about ``limit`` characters: its last line, whole
    clauses (``; ``-separated) while they fit, never cut inside a word; the rest is in the report."""
    lines = [line.strip() for line in (error or "").strip().splitlines() if line.strip()]
    clauses = (lines[-1] if lines else "no error text").split("; ")
    kept = [clauses[0]]
    for clause in clauses[1:]:
        if len("; ".join([*kept, clause])) > limit:
            break
        kept.append(clause)
    if len(kept[0]) > limit:  # one long clause: cut at the last space that fits
        kept = [kept[0][:limit].rsplit(" ", 1)[0]]
    more = len(clauses) - len(kept)
    return "; ".join(kept) + (f" (and {more} more in the report)" if more else "")


# ---- parent side --------------------------------------------------------------------------------


def compile_vae(requests: list[VaeCompileRequest], arch: str = "wormhole_b0", timeout: float = 3600.0,
                keep_irs: str | None = None) -> list[dict[str, Any]]:
    """Compile ``requests`` in one worker; a report per request (the worker's result plus the bill)."""
    from ..runtime.workers import WorkerError, run_worker
    from .bill import collective_table
    from ..runtime import scratch
    from .runner import check_plugin, prepare_descriptor, trace_env, worker_env
    from .ttnn_ir import TTNNModule

    for req in requests:
        check_vae_request(req)
    check_plugin()
    chips = max(mesh_from_preset(r.mesh).num_devices for r in requests)
    with scratch.folder(None, "vae-compile-") as work_dir:  # the worker runner gives each worker its TMPDIR
        desc = prepare_descriptor(arch, chips, work_dir)
        out_root = Path(keep_irs) if keep_irs else work_dir / "irs"
        params = {"requests": [asdict(r) for r in requests], "out_root": str(out_root), "stage": "compile"}
        xla = [i for i, r in enumerate(requests) if r.frontend == "torch-xla"]
        if xla:  # the torch-xla frontend: traced on CPU devices first, in a process of its own
            traced = run_worker("wan_sharding.compile.vae", {**params, "stage": "trace", "only": xla},
                                trace_env(chips), label="VAE torch-xla trace worker", timeout=timeout)
            for i, t in zip(xla, traced.results):
                params["requests"][i]["traced"] = t
        run = run_worker("wan_sharding.compile.vae", params, worker_env(desc), label="VAE compile worker",
                         timeout=timeout, stall_s=None)
        if not run.results:
            raise WorkerError(f"the VAE compile worker gave no result (exit {run.returncode}):\n{run.output[-4000:]}")
        reports = []
        for req, raw in zip(requests, run.results):
            report = {"request": asdict(req), "arch": arch, **raw}
            if raw.get("ok") and raw.get("ttnn_path"):
                module = TTNNModule.from_file(raw["ttnn_path"])
                table = collective_table(module, mesh_from_preset(req.mesh))
                report.update(collectives=table, runtime_ops=len(module.runtime_ops()),
                              **vae_bill(table, frame_bytes(req)))
            reports.append(report)
        return reports


# ---- worker side --------------------------------------------------------------------------------


def _compile_steps(reqs: list[VaeCompileRequest], out_dirs: list[Path]) -> list[dict[str, Any]]:
    """Requests that differ only in their ``step`` (torchax): one sharded VAE, the decode's steps
    traced once in order (a step no request asks for only for its cache's shapes), each asked-for
    one lowered and compiled. A result per request, in order."""
    import jax
    import jax.numpy as jnp

    from ..backends.jax import JaxBackend
    from ..models import build_vae
    from ..options import torch_dtype
    from ..vae import shard_vae

    t0 = time.perf_counter()
    req = reqs[0]
    mesh = mesh_from_preset(req.mesh)
    backend = JaxBackend(mesh, devices=list(jax.devices()[: mesh.num_devices]))
    vae = build_vae(req.kind, req.size, device="meta", dtype=torch_dtype(req.dtype))
    handle = shard_vae(vae, mesh, backend=backend, strategy=req.strategy)
    try:
        h, w = req.latent_hw()
        act = {"bf16": jnp.bfloat16, "fp32": jnp.float32}[req.dtype]
        shape = (1, vae.config.z_dim, 1, h, w)
        frame = handle.plan_decode(shape)
        spec = _cache_spec(handle, shape)
        # the input as decode uploads it: padded to the frame and split over the mesh
        z = jax.ShapeDtypeStruct((*shape[:3], *frame.padded), act, sharding=backend.sharding(spec(5)))
        wanted = {STEPS[r.step]: (r, d) for r, d in zip(reqs, out_dirs)}
        results: dict[int, dict[str, Any]] = {}
        step, cache = handle.step_function("decode", shape), ()
        with handle.tracing("decode", frame):
            for index in range(max(wanted) + 1):
                program = backend.step_program(vae, step)  # the very program decode runs for this step
                if index in wanted:
                    lowered = program.lower(handle.placed, (z, *cache))
                    results[index] = _compiled(lowered, wanted[index][1], time.perf_counter() - t0,
                                               _step_facts(handle, step, shape))
                    out = lowered.out_info[1]
                else:
                    _, out = jax.eval_shape(program, handle.placed, (z, *cache))
                cache = tuple(jax.ShapeDtypeStruct(c.shape, c.dtype, sharding=backend.sharding(spec(len(c.shape))))
                              for c in out)
                step = handle.step_function("decode", after=step)
        return [results[STEPS[r.step]] for r in reqs]
    finally:
        handle.remove()


def _compiled(lowered: Any, out_dir: Path, lower_seconds: float, facts: dict[str, Any]) -> dict[str, Any]:
    """``lowered`` compiled by tt-mlir with its IRs exported under ``out_dir``; the result."""
    t1 = time.perf_counter()
    out_dir.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"out_dir": str(out_dir), "lower_seconds": round(lower_seconds, 2), **facts}
    try:
        lowered.compile(compiler_options={"export_path": str(out_dir)})
        result["ok"] = True
    except Exception as e:  # tt-mlir's refusal, as the plugin raises it
        result.update(ok=False, error=f"{type(e).__name__}: {e}"[:8000])
    result["compile_seconds"] = round(time.perf_counter() - t1, 2)
    return _with_ttnn(result, out_dir)


def _cache_spec(handle: Any, z_shape: tuple) -> Any:
    """The spec of a step's cache tensors by rank: split like the frame (replicated when the frame
    stays whole)."""
    split = handle.plan_decode(tuple(z_shape)).split
    return (lambda ndim: split.frame_spec(ndim)) if split is not None else (lambda ndim: (None,) * ndim)


def _step_facts(handle: Any, step: Any, z_shape: tuple) -> dict[str, Any]:
    """What the compiled step is: its halo'd modules, how the frame lies on the mesh, and whether
    its cache leaves the same structure it came with (the program every later frame reuses)."""
    split = handle.plan_decode(tuple(z_shape)).split
    part, _, pattern, first = handle.steps.key(step)
    return {"halo_modules": len(handle.hooks.halo_modules), "frame_split": split.describe() if split else None,
            "reused_by_later_frames": handle.steps.next_pattern(step) == pattern and not first}


def _trace_one(req: VaeCompileRequest, out_dir: Path) -> dict[str, Any]:
    """The torch-xla frontend: the decode step's program as the ``xla`` backend runs it
    (``XlaBackend.step_program``), traced lazily with torch-xla SPMD on CPU devices
    (uninitialised weights: a compile reads shapes, never values), its GSPMD module converted to
    Shardy as Tenstorrent's torch-xla does, written for the compile worker. The steps before a
    ``steady`` step are traced for their cache's shapes only; the compiled step takes fresh device
    buffers of those shapes, so its graph holds that step alone."""
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.distributed.spmd as xs

    from ..runtime import workers
    from ..backends.xla import XlaBackend, enable_spmd
    from ..models import build_vae
    from ..options import torch_dtype
    from ..vae import shard_vae
    from .shardy import gspmd_to_shardy

    enable_spmd()
    t0 = time.perf_counter()
    mesh = mesh_from_preset(req.mesh)
    dtype = torch_dtype(req.dtype)
    vae = _decoder_only(build_vae(req.kind, req.size, device="meta", dtype=dtype)).to_empty(device="cpu")
    backend = XlaBackend(mesh)
    handle = shard_vae(vae, mesh, backend=backend, strategy=req.strategy, keep_host_weights=False)
    try:
        h, w = req.latent_hw()
        shape = (1, vae.config.z_dim, 1, h, w)
        frame = handle.plan_decode(shape)
        spec = _cache_spec(handle, shape)
        z = backend.upload(torch.zeros(*shape[:3], *frame.padded, dtype=dtype), spec(5))  # as decode uploads it
        step, lazy = handle.step_function("decode", shape), ()
        torch_xla._XLAC._set_xla_all_numbers_special_scalars(True)  # scalars inlined, as torch-xla exports
        try:
            with torch.no_grad(), handle.tracing("decode", frame):
                for _ in range(STEPS[req.step]):
                    lazy = backend.step_program(vae, step)(z, *lazy)[1]  # lazy: shapes, nothing runs
                    step = handle.step_function("decode", after=step)
                shapes = [(c.shape, c.dtype) for c in lazy]
                del lazy  # the steps before hold no tensor now: materialising the buffers runs nothing of theirs
                cache = _device_buffers(shapes, backend, spec, xs) if shapes else ()
                # the very program decode runs for this step (XlaBackend.run_step), not yet materialised
                frame, out = backend.step_program(vae, step)(z, *cache)
            gspmd = xm.get_stablehlo([frame, *out])
        finally:
            torch_xla._XLAC._set_xla_all_numbers_special_scalars(False)
        shardy = gspmd_to_shardy(gspmd, mesh.shape, mesh.axis_names)
        out_dir.mkdir(parents=True, exist_ok=True)
        path = workers.atomic_write(out_dir / "stablehlo_shardy.mlir", shardy)
        return {"ok": True, "stablehlo_path": str(path), "trace_seconds": round(time.perf_counter() - t0, 2),
                **_step_facts(handle, step, shape)}
    finally:
        handle.remove()


def _device_buffers(shapes: list[tuple], backend: Any, spec: Any, xs: Any) -> tuple:
    """Fresh device tensors of ``shapes``, each split as ``spec`` gives for its rank: the compiled
    step's inputs, not values traced from the steps before (the lazy graphs of those are dropped
    first, so materialising these runs nothing else). Zeros made on the devices, each its own
    piece (a host tensor moved there would go whole to every device first)."""
    import torch
    import torch_xla

    buffers = []
    for shape, dtype in shapes:
        t = torch.zeros(shape, dtype=dtype, device=backend.device)
        xs.mark_sharding(t, backend.native_mesh, spec(len(shape)))
        buffers.append(t)
    torch_xla.sync()  # now device data: program inputs (a lazy zero would be a constant the compiler folds)
    return tuple(buffers)


def _compile_traced(req: VaeCompileRequest, traced: dict[str, Any], out_dir: Path) -> dict[str, Any]:
    from .tt_client import compile_stablehlo_text

    result: dict[str, Any] = {"out_dir": str(out_dir), "lower_seconds": traced.get("trace_seconds"),
                              **{k: traced.get(k) for k in ("halo_modules", "frame_split", "reused_by_later_frames")}}
    if not traced.get("ok"):
        return {**result, "ok": False, "error": traced.get("error")}
    t1 = time.perf_counter()
    try:
        compile_stablehlo_text(Path(traced["stablehlo_path"]).read_text(), mesh_from_preset(req.mesh).num_devices,
                               out_dir, None)
        result["ok"] = True
    except Exception as e:  # tt-mlir's refusal, as the plugin raises it
        result.update(ok=False, error=f"{type(e).__name__}: {e}"[:8000])
    result["compile_seconds"] = round(time.perf_counter() - t1, 2)
    return _with_ttnn(result, out_dir)


def _with_ttnn(result: dict[str, Any], out_dir: Path) -> dict[str, Any]:
    ttnn = sorted((out_dir / "irs").glob("ttnn_[0-9]*.mlir"))
    result["ttnn_path"] = str(ttnn[-1]) if ttnn else None
    if result["ok"] and not ttnn:
        result.update(ok=False, error=f"compiled but no TTNN IR was exported under {out_dir}/irs")
    return result


def _job(params: dict[str, Any]):
    out_root = Path(params["out_root"])
    name = lambda i, r: out_root / f"{i}-{r.kind}-{r.mesh}-{r.resolution}-{r.strategy}-{r.frontend}-{r.step}"  # noqa: E731
    if params["stage"] == "trace":  # torch-xla on CPU devices: no JAX, no plugin here
        for i in params["only"]:
            req = VaeCompileRequest(**{k: v for k, v in params["requests"][i].items() if k != "traced"})
            try:
                yield _trace_one(req, name(i, req))
            except Exception as e:
                yield {"ok": False, "error": f"torch-xla trace failed: {type(e).__name__}: {e}"[:8000]}
        return
    import jax

    devices = jax.devices()
    if devices[0].platform != "tt":
        raise CompileError(f"JAX platform is {devices[0].platform!r}, not 'tt': TT_COMPILE_ONLY_SYSTEM_DESC was not honoured")
    reqs = [VaeCompileRequest(**{k: v for k, v in raw.items() if k != "traced"}) for raw in params["requests"]]
    i = 0
    while i < len(reqs):
        traced = params["requests"][i].get("traced")
        # torchax: the next requests that differ only in their step share one trace of the decode
        j = i + 1
        while (traced is None and j < len(reqs) and params["requests"][j].get("traced") is None
               and replace(reqs[j], step=reqs[i].step) == reqs[i] and reqs[j].step not in {r.step for r in reqs[i:j]}):
            j += 1
        try:
            if traced is not None:
                yield _compile_traced(reqs[i], traced, name(i, reqs[i]))
            else:
                yield from _compile_steps(reqs[i:j], [name(k, reqs[k]) for k in range(i, j)])
        except Exception as e:  # a setup error: reported, the next requests go on
            yield from [{"ok": False, "error": f"{type(e).__name__}: {e}"[:8000]}] * (j - i)
        i = j


if __name__ == "__main__":
    from ..runtime.workers import worker_main

    sys.exit(worker_main(_job))
