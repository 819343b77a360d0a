"""Warm-iteration timing, side by side: unsharded vs sharded, and each padding mode (slice / mask).

For each backend (``jax``, ``xla``) and each configuration (``unsharded``: one device, replicated
weights, no SP hooks; then the mesh with ``slice`` and with ``mask`` padding), one worker process
runs the tiny DiT through the warm-iteration protocol: ``--warmup`` iterations (the first
compiles), then ``--iters`` timed ones, each a forward plus the copy to host; for the DiT alone
and for a whole denoising step (cond + uncond forward, CFG, UniPC step). Prints the medians and
their ratios, and writes ``results/profile.json``.

CPU virtual devices share this host's cores, so these figures compare configurations of this
implementation on this host; they are not predictions for Tenstorrent hardware.

    python scripts/bench_profile.py                        # 2x4, small latent (1950 -> 1984 tokens)
    python scripts/bench_profile.py --meshes 1x4 2x4 8x4 --backends jax --iters 5
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT))

from wan_sharding.jobs.launch import UNSHARDED  # noqa: E402
from wan_sharding.jobs.profile import CPU_NOTE, PROFILE_LATENTS, run_profile  # noqa: E402
from wan_sharding.runtime.workers import WorkerError, atomic_write, install_signal_handlers  # noqa: E402


def profile(backend: str, mesh: str, padding: str, args: argparse.Namespace) -> list[dict]:
    params = dict(backend=backend, mesh=mesh, padding=padding, what=["dit", "step"], variant=args.variant,
                  warmup=args.warmup, iters=args.iters, resolution=args.resolution, latent=args.latent,
                  dtype=args.dtype)
    run = run_profile(params, echo=False, timeout=1800)
    if not run.ok:
        raise WorkerError(f"profile worker {backend} {mesh} {padding} failed (exit {run.returncode}):\n{run.output[-3000:]}")
    return run.results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backends", nargs="+", default=["jax", "xla"], choices=["jax", "xla"])
    ap.add_argument("--meshes", nargs="+", default=["2x4"])
    ap.add_argument("--variant", default="t2v-a14b")
    ap.add_argument("--resolution", default="small", choices=sorted(PROFILE_LATENTS))
    ap.add_argument("--latent", help="F,H,W (overrides --resolution)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--out", default=str(ROOT / "results" / "profile.json"))
    args = ap.parse_args(argv)
    install_signal_handlers()

    start = time.perf_counter()
    rows: list[dict] = []
    for backend in args.backends:
        configs = [(UNSHARDED, "none")] + [(m, p) for m in args.meshes for p in ("slice", "mask")]
        for mesh, padding in configs:
            print(f"... {backend} {mesh} {padding}", file=sys.stderr, flush=True)
            rows += profile(backend, mesh, padding, args)

    base = {(r["backend"], r["what"]): r["median_s"] for r in rows if r["mesh"] == UNSHARDED}
    slice_ = {(r["backend"], r["what"], r["mesh"]): r["median_s"] for r in rows if r["padding"] == "slice"}
    for r in rows:
        r["vs_unsharded"] = r["median_s"] / base[(r["backend"], r["what"])]
        s = slice_.get((r["backend"], r["what"], r["mesh"]))
        r["vs_slice"] = r["median_s"] / s if s else None

    latent = rows[0]["latent"]
    print(f"\nwarm iterations: tiny {args.variant} DiT, latent {'x'.join(map(str, latent))} "
          f"({rows[0]['tokens']} tokens), {args.dtype}, {args.warmup} warm-up + {args.iters} timed "
          f"(forward + copy to host), medians in seconds; step = cond + uncond forward, CFG, scheduler step")
    print(f"{'backend':7} {'what':4} {'config':16} {'tokens':>11} {'compile s':>9} {'median s':>9} "
          f"{'min':>8} {'max':>8} {'x unsharded':>11} {'x slice':>8}")
    for r in rows:
        config = r["mesh"] if r["mesh"] == UNSHARDED else f"{r['mesh']} {r['padding']}"
        tokens = f"{r['tokens']}->{r['padded_tokens']}" if r["padded_tokens"] != r["tokens"] else str(r["tokens"])
        vs_slice = f"{r['vs_slice']:8.2f}" if r["vs_slice"] is not None else f"{'':8}"
        print(f"{r['backend']:7} {r['what']:4} {config:16} {tokens:>11} {r['compile_s']:9.2f} {r['median_s']:9.4f} "
              f"{r['min_s']:8.4f} {r['max_s']:8.4f} {r['vs_unsharded']:11.2f} {vs_slice}")
    shares = [r["others_cpu_share"] for r in rows if r.get("others_cpu_share") is not None]
    peak = max(shares) if shares else None
    print(f"\nnote: {CPU_NOTE}. Ratios > 1 are slower. {os.cpu_count()} host cores"
          + (f"; other processes used at most {peak:.0%} of the host's CPU during a timed run" if peak is not None else "")
          + (" (they competed for the cores: rerun on an idle host for cleaner ratios)" if (peak or 0) > 0.1 else "")
          + ".\n")

    out = Path(args.out)
    atomic_write(out, json.dumps({
        "note": CPU_NOTE, "host": {"cpus": os.cpu_count(), "machine": platform.machine(),
                                   "python": platform.python_version()},
        "command": "python scripts/bench_profile.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "seconds": round(time.perf_counter() - start, 1), "date": time.strftime("%Y-%m-%d"), "results": rows,
    }, indent=1) + "\n")
    print(f"wrote {out} ({time.perf_counter() - start:.0f} s)")
    if out.resolve() == (ROOT / "results" / "profile.json").resolve():  # the file docs/pipelines.md quotes
        import docs_figures  # scripts/, beside this one

        print("\n".join(docs_figures.update(["profile"])) or "docs/pipelines.md unchanged")
    return 0


if __name__ == "__main__":
    sys.exit(main())
