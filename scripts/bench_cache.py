"""Each step cache (``wan_sharding.caching``) on the sharded tiny pipeline, side by side.

The tiny T2V-A14B pipeline (random weights, fp32) made deep enough that the blocks dominate a
forward as they do at full size (``--blocks``, default 16 per expert), enough steps for every cache
to act, sharded on each backend's mesh; per cache kind: DiT forwards run, cache-hooked modules
computed / skipped, warm time per video cached and uncached (measured interleaved in one process,
``--repeats`` times, medians, the median of the adjacent pairs' ratios, and the spread as
(max - min) / median), the share of an uncached video's time in the blocks (the same pipeline with
one block per expert timed beside it) and the share of the work a cache computed, the goal for the block caches
(cached / uncached <= computed fraction + 0.15), the cached time against the whole forward run as
one program of the cache path (a MagCache that never skips: on ``xla`` the uncached forward is
traced lazily at every call, the cache's programs are compiled through dynamo, so this is the
like-for-like ratio there), the host seconds per cached forward outside the
compiled programs, quality against the uncached sharded run (PSNR of the decoded frames, max-abs and
PCC of the final latents) and agreement with the unsharded pipeline under the same cache (decisions,
max-abs). CPU virtual devices: the ratios compare configurations on this host.

    python scripts/bench_cache.py                       # jax and xla, 2x4, 16 blocks, 12 steps
    python scripts/bench_cache.py --backends jax --caches fbc,mag --repeats 5
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT))

from wan_sharding.caching import CACHE_KINDS  # noqa: E402
from wan_sharding.jobs.generate import cache_compare_in_subprocess  # noqa: E402
from wan_sharding.runtime.workers import atomic_write, install_signal_handlers  # noqa: E402


BLOCK_CACHES = ("fbc", "mag")  # the kinds with a speed goal: cached / uncached <= computed fraction + 0.15


def meets_goal(x: dict) -> bool | None:
    """Whether a block cache's run meets its speed goal (``None`` for the other kinds)."""
    return x["warm_ratio"] <= x["goal_ratio"] if x["cache"] in BLOCK_CACHES else None


def markdown(rows: list[dict]) -> str:
    head = ["backend", "cache", "computed / calls", "warm s cached (uncached)", "cached / uncached (paired)",
            "goal (computed + 0.15)", "cached / whole-forward program", "spread", "blocks' share; work computed", "host s / cached forward",
            "PSNR dB", "drift max-abs", "same decisions as unsharded", "max-abs vs unsharded"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for x in rows:
        goal = meets_goal(x)
        host = x.get("host_overhead_s")
        out.append("| " + " | ".join([
            x["backend"], x["cache"], f"{x['computed']} / {x['calls']} ({x['computed_fraction']:.0%})",
            f"{x['warm_seconds']:.3f} ({x['uncached_warm_seconds']:.3f})", f"{x['warm_ratio']:.2f} ({x['paired_ratio']:.2f})",
            f"{x['goal_ratio']:.2f} {'met' if goal else 'NOT met'}" if goal is not None else "-",
            f"{x['whole_program_ratio']:.2f}",
            f"{x['spread']:.0%}", f"{x['blocks_share']:.0%}; {x['work_fraction']:.0%}",
            "-" if host is None else f"{host * 1e3:.2f} ms",
            f"{x['psnr_db_vs_uncached']:.1f}", f"{x['drift_max_abs']:.2e}",
            "yes" if x["decisions_match"] else "NO", f"{x['max_abs_vs_unsharded_cached']:.1e}",
        ]) + " |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backends", default="jax,xla")
    p.add_argument("--mesh", default="2x4")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--blocks", type=int, default=16,
                   help="transformer blocks per expert (the tiny config has 2; 16 put 84-89%% of a video's time in the blocks here)")
    p.add_argument("--repeats", type=int, default=3, help="interleaved warm runs, cached and uncached, per kind")
    p.add_argument("--caches", default=",".join(k for k in CACHE_KINDS if k != "none"))
    p.add_argument("--out", default=str(ROOT / "results" / "cache.json"))
    args = p.parse_args(argv)
    install_signal_handlers()

    t0 = time.perf_counter()
    rows = []
    for backend in args.backends.split(","):
        print(f"... {backend} {args.mesh}: {args.caches}, {args.blocks} blocks, {args.steps} steps",
              file=sys.stderr, flush=True)
        rows += cache_compare_in_subprocess(backend, [args.mesh], args.caches.split(","), steps=args.steps,
                                            timing=True, timeout=7200, blocks=args.blocks, repeats=args.repeats)
    wall = time.perf_counter() - t0
    path = atomic_write(args.out, json.dumps({
        "what": f"tiny T2V-A14B pipeline (random weights, fp32, 5 frames 64x96, {args.blocks} blocks per expert), "
                f"{args.steps} steps, CFG; each cache with its Wan defaults (wan_sharding.caching.wan_cache_config) "
                f"on both experts; warm times: medians of {args.repeats} interleaved runs",
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "host": f"{platform.machine()}, {platform.python_version()}, CPU virtual devices",
        "command": "python scripts/bench_cache.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "wall_seconds_all": round(wall, 1), "runs": rows}, indent=1) + "\n")
    print(markdown(rows))
    print(f"\n{len(rows)} runs in {wall:.0f} s; written to {path}")
    return 0 if all(x["decisions_match"] and x["skipped"] > 0 and meets_goal(x) is not False for x in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
