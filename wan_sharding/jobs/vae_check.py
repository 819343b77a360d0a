"""The VAE's PCC check: ``shard_vae``'s decode and encode against the VAE's own, on CPU virtual
meshes (``xla``, ``jax``) or Tenstorrent chips (``tt``).

The same worker path as the DiT's check (:mod:`.check`): one worker per backend and mesh (on
``jax``, one for every mesh: :func:`run_meshes`) runs every case, each graded by
:func:`~wan_sharding.jobs.pcc.grade`. A case is a tiny random-weight
``AutoencoderKLWan`` of the real structure (``models.TINY_VAE_CONFIGS``), a part (decode or
encode), a latent size and a dtype; the worker keeps one sharded VAE per mesh, kind, dtype and
strategy for all its cases.

CPU workers compile at XLA's backend optimization level 0 (:data:`FAST_COMPILE`): a tiny VAE's
step is ~2500 small ops, whose LLVM optimization costs ~7x the rest of the compile (jax, 2x4:
8.5 s -> 1.2 s) and nothing that shows at these sizes. The grade is the same.
"""

from __future__ import annotations

import copy
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any, Iterable, Mapping

from ..runtime.workers import WorkerError, run_worker, worker_main
from .launch import prepare_worker, stall_seconds, worker_env
from .pcc import compare, grade

FAST_COMPILE = "--xla_backend_optimization_level=0"
PARTS = ("decode", "encode")


@dataclass(frozen=True)
class VaeCase:
    """One comparison: ``vae`` kind, ``part``, latent ``frames,height,width`` (an encode's video has
    ``4 * (frames - 1) + 1`` frames of ``height x width`` latent rows times the VAE's compression),
    ``dtype``, the sharding ``strategy`` and the halo ``exchange`` (``none``: no neighbour rows,
    each shard convolved alone: wrong at the shard borders, the case that shows the grade fails)."""

    vae: str = "wan2.1"
    part: str = "decode"
    latent: str = "3,5,8"
    dtype: str = "fp32"
    strategy: str = "halo"
    exchange: str = ""

    @property
    def shape(self) -> tuple[int, int, int]:
        f, h, w = (int(v) for v in self.latent.split(","))
        return f, h, w

    @classmethod
    def parse(cls, text: str) -> "VaeCase":
        return cls(*text.split(":"))

    def __str__(self) -> str:
        parts = [self.vae, self.part, self.latent, self.dtype, self.strategy, self.exchange]
        while parts[-1] in ("", "halo") and len(parts) > 4:
            parts.pop()
        return ":".join(parts)


def run_in_subprocess(backend: str, mesh: str, cases: Iterable[VaeCase], timeout: float = 3600) -> list[dict[str, Any]]:
    """Run ``cases`` for one backend on one mesh in a fresh process; the result dicts, each graded
    (``ok``, ``threshold``, ``max_abs_bound``) as the DiT's check grades its rows."""
    return run_meshes(backend, {mesh: list(cases)}, timeout)


def run_meshes(backend: str, share: Mapping[str, Iterable[VaeCase]], timeout: float = 3600) -> list[dict[str, Any]]:
    """Run each mesh's cases of ``share`` (``{mesh: cases}``) for one backend in one fresh process:
    on ``jax`` several meshes share it (each over the first devices of the largest: one start-up
    and one import of the stacks for all of them); the other backends take one mesh per process.
    The result dicts in order, graded as :func:`run_in_subprocess` grades them."""
    from ..mesh import mesh_from_preset

    if len(share) > 1 and backend != "jax":
        raise WorkerError(f"one {backend} worker runs one mesh; got {', '.join(share)}")
    env = worker_env(backend, max(mesh_from_preset(m).num_devices for m in share))
    if backend != "tt" and FAST_COMPILE not in env.get("XLA_FLAGS", ""):
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {FAST_COMPILE}".strip()
    params = {"backend": backend, "share": [[m, [str(c) for c in cases]] for m, cases in share.items()]}
    where = ", ".join(share)
    run = run_worker("wan_sharding.jobs.vae_check", params, env, label=f"{backend} VAE check worker on {where}",
                     timeout=timeout, stall_s=stall_seconds(backend))
    if not run.ok:
        raise WorkerError(f"{backend} VAE worker on {where} failed (exit {run.returncode}):\n{run.output[-4000:]}")
    for r in run.results:
        g = grade(backend, r["dtype"])
        r["threshold"], r["max_abs_bound"] = g.pcc, g.max_abs
        r["ok"] = g.passes(r["pcc"], r["max_abs"])
    return run.results


def case_inputs(vae: Any, case: VaeCase, seed: int = 1) -> Any:
    """The random latents (decode) or video (encode) of ``case`` for ``vae``."""
    import torch

    from ..options import torch_dtype

    frames, h, w = case.shape
    g = torch.Generator().manual_seed(seed)
    if case.part == "decode":
        x = torch.randn(1, vae.config.z_dim, frames, h, w, generator=g)
    else:
        s = vae.config.scale_factor_spatial
        x = torch.rand(1, 3, 4 * (frames - 1) + 1, h * s, w * s, generator=g) * 2 - 1
    return x.to(torch_dtype(case.dtype))


def run_case(handle: Any, reference_vae: Any, case: VaeCase) -> dict[str, Any]:
    """The unsharded and sharded call of ``case``, compared."""
    import torch

    x = case_inputs(reference_vae, case)
    with torch.no_grad():
        if case.part == "decode":
            reference = reference_vae.decode(x).sample
        else:
            reference = reference_vae.encode(x).latent_dist.parameters
    start = time.perf_counter()
    out = handle.decode(x).sample if case.part == "decode" else handle.encode(x).latent_dist.parameters
    seconds = time.perf_counter() - start
    frame = handle.plan_decode(tuple(x.shape)) if case.part == "decode" else handle.plan_encode(tuple(x.shape))
    value, max_abs = compare(reference, out)
    info = handle.describe()
    return {"backend": handle.backend.name, "mesh": handle.mesh.name, "case": str(case), **asdict(case),
            "shape": list(out.shape), "pcc": value, "max_abs": max_abs, "seconds": round(seconds, 2),
            "frame": list(frame.logical), "padded": list(frame.padded),
            "split": frame.split.describe() if frame.split is not None else "-",
            "halo_modules": info["halo_modules"]}


def _job(params: dict[str, Any]):
    import torch

    from ..models import build_vae
    from ..options import torch_dtype
    from ..vae import shard_vae
    from .launch import mesh_arg

    prepare_worker(params["backend"])
    torch.set_grad_enabled(False)
    references: dict[tuple, Any] = {}
    for mesh, texts in params["share"]:
        handles: dict[tuple, Any] = {}
        try:
            for text in texts:
                case = VaeCase.parse(text)
                if (case.vae, case.dtype) not in references:
                    references[(case.vae, case.dtype)] = build_vae(case.vae, dtype=torch_dtype(case.dtype))
                reference = references[(case.vae, case.dtype)]
                key = (case.vae, case.dtype, case.strategy, case.exchange)
                if key not in handles:
                    sharded = copy.deepcopy(reference)  # the device move acts on the copy
                    handles[key] = shard_vae(sharded, mesh_arg(params["backend"], mesh), backend=params["backend"],
                                             strategy=case.strategy, exchange=case.exchange or None)
                yield run_case(handles[key], reference, case)
        finally:
            for handle in handles.values():
                handle.remove()


if __name__ == "__main__":
    from ..backends import BackendError

    sys.exit(worker_main(_job, expected=(BackendError,)))
