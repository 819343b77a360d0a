"""Each step cache (``wan_sharding.caching``) on the sharded tiny pipeline, side by side.

The tiny T2V-A14B pipeline (random weights, fp32), enough steps for every cache to act, sharded on
each backend's mesh; per cache kind: DiT forwards run, cache-hooked modules computed / skipped,
warm pipeline time against the same sharded pipeline without a cache, drift against it (max-abs
and PCC of the final latents), and agreement with the unsharded pipeline under the same cache
(decisions, max-abs). CPU virtual devices: the time ratios compare configurations on this host;
the op-by-op host Python between the jitted pieces costs far more here, relative to a tiny block,
than it would next to a full-size block on hardware.

    python scripts/bench_cache.py                       # jax and xla, 2x4, 12 steps
    python scripts/bench_cache.py --backends jax --steps 20
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
from wan_sharding.workers import atomic_write, install_signal_handlers  # noqa: E402


def markdown(rows: list[dict]) -> str:
    head = ["backend", "mesh", "cache", "forwards", "computed / calls", "skipped", "warm s (no cache)",
            "x no cache", "drift max-abs", "drift PCC", "same decisions as unsharded", "max-abs vs unsharded"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for x in rows:
        out.append("| " + " | ".join([
            x["backend"], x["mesh"], x["cache"], str(x["forwards"]), f"{x['computed']} / {x['calls']}",
            f"{x['skipped'] / x['calls']:.0%}", f"{x['warm_seconds']:.3f} ({x['uncached_warm_seconds']:.3f})",
            f"{x['warm_ratio']:.2f}", f"{x['drift_max_abs']:.2e}", f"{x['drift_pcc']:.6f}",
            "yes" if x["decisions_match"] else "NO", f"{x['max_abs_vs_unsharded_cached']:.1e}",
        ]) + " |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backends", default="jax,xla")
    p.add_argument("--mesh", default="2x4")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--caches", default=",".join(k for k in CACHE_KINDS if k != "none"))
    p.add_argument("--out", default=str(ROOT / "results" / "cache.json"))
    args = p.parse_args(argv)
    install_signal_handlers()

    t0 = time.perf_counter()
    rows = []
    for backend in args.backends.split(","):
        print(f"... {backend} {args.mesh}: {args.caches}, {args.steps} steps", file=sys.stderr, flush=True)
        rows += cache_compare_in_subprocess(backend, [args.mesh], args.caches.split(","), steps=args.steps,
                                            timing=True, timeout=3600)
    wall = time.perf_counter() - t0
    path = atomic_write(args.out, json.dumps({
        "what": f"tiny T2V-A14B pipeline (random weights, fp32, 5 frames 64x96), {args.steps} steps, CFG; "
                "each cache with its Wan defaults (wan_sharding.caching.wan_cache_config) on both experts",
        "host": f"{platform.machine()}, {platform.python_version()}, CPU virtual devices",
        "command": "python scripts/bench_cache.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "wall_seconds_all": round(wall, 1), "runs": rows}, indent=1) + "\n")
    print(markdown(rows))
    print(f"\n{len(rows)} runs in {wall:.0f} s; written to {path}")
    return 0 if all(x["decisions_match"] and x["skipped"] > 0 for x in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
