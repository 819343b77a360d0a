"""The standing fuzz: random small Wan DiTs, sharded against unsharded (``scripts/fuzz_sharding.py``).

Each case is a :class:`~wan_sharding.jobs.check.Case` with a random tiny config (variant, heads,
head dim, FFN width, blocks), batch 1-2, a random latent (aligned to SP x 32 tokens or not, down to
1-2 tokens) and a padding mode; every case of one backend and mesh runs in one check worker
(:func:`wan_sharding.jobs.check.run_in_subprocess`), so the fuzz reuses the check's own path.
A case fails when its fp32 max-abs difference to the unsharded model exceeds ``MAX_ABS``.
"""

from __future__ import annotations

import random
import time
from collections import defaultdict
from typing import Any, Sequence

from ..mesh import TILE, mesh_from_preset
from ..models import VARIANTS
from ..options import PADDING_NAMES
from ..runtime.workers import WorkerError
from .check import Case, run_in_subprocess
from .pcc import MAX_ABS_BOUNDS

MAX_ABS = MAX_ABS_BOUNDS["fp32"]  # the fp32 grade (a padded key leaking into attention is ~1e-3)
# Meshes with every TP size the presets have (2, 4, 8) and SP 1, 2, 4, 8, at most 8 devices per
# worker except 8x4 (32): it is kept, the Galaxy layout, but drawn less often.
MESHES = ("1x2", "1x4", "2x4", "1x8", "8x4")
MESH_WEIGHTS = (2, 2, 3, 2, 1)
HEAD_DIMS = (12, 16, 24)  # Wan's rope splits head_dim in three (t, h, w), each part even


def random_latent(rng: random.Random, sp: int) -> str:
    """``"F,H,W"``: a third aligned to SP x 32 tokens, a sixth with 1-2 tokens, the rest any size."""
    roll = rng.random()
    if roll < 1 / 3:  # aligned: F * h * w == SP * 32 * m
        tokens = sp * TILE * rng.choice((1, 2))
        frames = rng.choice([f for f in (1, 2, 4) if tokens % f == 0])
        rest = tokens // frames
        h = rng.choice([d for d in range(1, 33) if rest % d == 0 and rest // d <= 64])
        return f"{frames},{2 * h},{2 * (rest // h)}"
    if roll < 1 / 2:  # 1 or 2 tokens
        return rng.choice(("1,2,2", "2,2,2", "1,2,4", "1,4,2"))
    return f"{rng.randint(1, 4)},{2 * rng.randint(1, 9)},{2 * rng.randint(1, 9)}"


def random_case(rng: random.Random, mesh: str) -> Case:
    """One random tiny Wan DiT and input for ``mesh`` (heads and FFN width divisible by its TP)."""
    m = mesh_from_preset(mesh)
    heads = m.tp * rng.choice((1, 2))
    config = {"num_attention_heads": heads, "attention_head_dim": rng.choice(HEAD_DIMS),
              "ffn_dim": m.tp * 8 * rng.randint(1, 4), "num_layers": rng.randint(1, 3)}
    return Case(variant=rng.choice(VARIANTS), length=random_latent(rng, m.sp), dtype="fp32",
                padding=rng.choice(PADDING_NAMES), config=",".join(f"{k}={v}" for k, v in config.items()),
                batch=rng.randint(1, 2))


def fuzz_cases(n: int, seed: int, backends: Sequence[str], meshes: Sequence[str] = MESHES,
               weights: Sequence[float] | None = None) -> list[tuple[str, str, Case]]:
    """``n`` (backend, mesh, case) triples, the same for the same arguments; backends alternate.
    ``weights``: how often each mesh is drawn (default: ``MESH_WEIGHTS`` for ``MESHES``, else even)."""
    if weights is None and tuple(meshes) == MESHES:
        weights = MESH_WEIGHTS
    out = []
    for i in range(n):
        rng = random.Random(f"{seed}:{i}")
        mesh = rng.choices(meshes, weights)[0]
        out.append((backends[i % len(backends)], mesh, random_case(rng, mesh)))
    return out


def run_fuzz(cases: list[tuple[str, str, Case]], max_abs: float = MAX_ABS, progress=None) -> dict[str, Any]:
    """Run every case, one worker per backend and mesh; a summary with every mismatch."""
    groups: dict[tuple[str, str], list[Case]] = defaultdict(list)
    for backend, mesh, case in cases:
        groups[(backend, mesh)].append(case)
    start = time.perf_counter()
    results: list[dict[str, Any]] = []
    crashed: list[dict[str, Any]] = []  # a worker that failed: every case it had counts as failed
    for (backend, mesh), group in sorted(groups.items()):
        t = time.perf_counter()
        try:
            rows = run_in_subprocess(backend, mesh, group, timeout=3600)
        except WorkerError as e:
            crashed.append({"backend": backend, "mesh": mesh, "cases": [str(c) for c in group], "error": str(e)[-3000:]})
            if progress:
                progress(f"{backend} {mesh}: WORKER FAILED after {time.perf_counter() - t:.0f} s")
            continue
        results += rows
        if progress:
            worst = max(r["max_abs"] for r in rows)
            progress(f"{backend} {mesh}: {len(rows)} cases in {time.perf_counter() - t:.0f} s, worst max-abs {worst:.2e}")
    mismatches = [r for r in results if not r["max_abs"] <= max_abs or not r["ok"]] + crashed
    worst = max(results, key=lambda r: r["max_abs"]) if results else {"max_abs": float("nan"), "backend": "-",
                                                                      "mesh": "-", "case": "-"}
    return {
        "cases": len(results), "mismatches": len(mismatches), "crashed_workers": len(crashed), "max_abs_bound": max_abs,
        "worst_max_abs": worst["max_abs"], "worst_case": f"{worst['backend']} {worst['mesh']} {worst['case']}",
        "min_pcc": min((r["pcc"] for r in results), default=float("nan")), "seconds": round(time.perf_counter() - start, 1),
        "by_group": {f"{b} {m}": len(g) for (b, m), g in sorted(groups.items())},
        "coverage": _coverage(results), "failed": mismatches,
    }


def _coverage(results: list[dict[str, Any]]) -> dict[str, Any]:
    """What the cases spanned, so a summary shows the fuzz reached every corner it should."""
    def count(key):
        c: dict[str, int] = defaultdict(int)
        for r in results:
            c[str(key(r))] += 1
        return dict(sorted(c.items()))

    return {
        "variant": count(lambda r: r["variant"]), "padding": count(lambda r: r["padding"]),
        "batch": count(lambda r: r["batch"]),
        "tokens": {"1-2": sum(r["tokens"] <= 2 for r in results),
                   "aligned": sum(r["tokens"] % mesh_from_preset(r["mesh"]).seq_multiple == 0 for r in results),
                   "unaligned, > 2": sum(r["tokens"] % mesh_from_preset(r["mesh"]).seq_multiple != 0 and r["tokens"] > 2
                                         for r in results)},
        "blocks": count(lambda r: Case(config=r["config"]).overrides()["num_layers"]),
    }
