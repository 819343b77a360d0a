"""``profile --what vae``: warm-iteration timing of the VAE's decode, sharded on the mesh, beside
the VAE's own decode on the host.

The VAE is the tiny one of the variant's pipeline (``models.VAE_OF_VARIANT``, random weights) at the
profile's latent; ``warmup`` decodes (the first compiles its step programs), then ``iters`` timed
ones, each with its copy to the host; the host decode is timed the same way. Per latent frame is
the median over the latent's frames. The mesh ``unsharded`` times the host decode alone.
"""

from __future__ import annotations

import copy
import statistics
import time
from typing import Any

from .launch import UNSHARDED, mesh_arg


def _timed(call: Any, warmup: int, iters: int) -> list[float]:
    times = []
    for _ in range(warmup + iters):
        t = time.perf_counter()
        call()
        times.append(time.perf_counter() - t)
    return times


def profile_vae(p: dict[str, Any], latent: tuple[int, int, int], note: str) -> dict[str, Any]:
    """One ``profile --what vae`` row (the worker's side; ``p`` the command's options)."""
    import torch

    from ..models import VAE_OF_VARIANT, build_vae
    from ..options import torch_dtype
    from ..vae import shard_vae

    dtype = torch_dtype(p["dtype"])
    kind = VAE_OF_VARIANT[p["variant"]]
    vae = build_vae(kind, dtype=dtype)
    z = torch.randn(1, vae.config.z_dim, *latent, generator=torch.Generator().manual_seed(1)).to(dtype)
    host = _timed(lambda: vae.decode(z), p["warmup"], p["iters"])
    frames = latent[0]
    row: dict[str, Any] = {
        "what": "vae", "backend": p["backend"], "mesh": p["mesh"], "variant": p["variant"], "vae": kind,
        "dtype": p["dtype"], "latent": list(latent), "warmup": p["warmup"], "iters": p["iters"],
        "host_median_s": statistics.median(host[p["warmup"]:]), "host_times_s": host[p["warmup"]:], "note": note,
    }
    row["host_per_frame_s"] = row["host_median_s"] / frames
    if p["mesh"] != UNSHARDED:
        handle = shard_vae(copy.deepcopy(vae), mesh_arg(p["backend"], p["mesh"]), backend=p["backend"])
        try:
            times = _timed(lambda: handle.decode(z), p["warmup"], p["iters"])
            timed = times[p["warmup"]:]
            row.update(first_iter_s=times[0], median_s=statistics.median(timed), min_s=min(timed), max_s=max(timed),
                       times_s=timed, per_frame_s=statistics.median(timed) / frames,
                       split=handle.describe().get("frame_split"))
            row["compile_s"] = max(times[0] - row["median_s"], 0.0)
        finally:
            handle.remove()
    print(format_vae_row(row), flush=True)
    return row


def format_vae_row(row: dict[str, Any]) -> str:
    """A ``profile --what vae`` row as the columns of docs/vae.md's CPU table (which
    ``scripts/bench_vae.py`` fills with these rows): VAE, mesh, split, host decode and sharded
    decode per latent frame (warm medians), the first sharded call (it compiles the step programs)."""
    sharded = "median_s" in row
    head = (f"VAE decode, {row['backend']}, {row['dtype']}, latent {' x '.join(map(str, row['latent']))}, warm median "
            f"per latent frame of {row['iters']} timed decodes after {row['warmup']} warm-up:")
    widths = (7, 10, 22, 11, 14, 29)  # columns two spaces apart
    cols = ["VAE", "mesh", "split", "host decode", "sharded decode", "first sharded call (compiles)"]
    cells = [row["vae"], row["mesh"], row.get("split") or "-", f"{row['host_per_frame_s']:.2f} s",
             f"{row['per_frame_s']:.2f} s" if sharded else "-", f"{row['first_iter_s']:.0f} s" if sharded else "-"]
    line = lambda values: "  ".join(f"{v:{w}}" for v, w in zip(values, widths)).rstrip()  # noqa: E731
    return "\n".join([head, line(cols), line(cells)])
