"""Standing fuzz: N random small Wan DiTs x meshes x backends, sharded vs unsharded (fp32 max-abs).

    .venv/bin/python scripts/fuzz_sharding.py --cases 200 [--seed 0] [--backends jax xla]
                                              [--meshes 1x2 1x4 2x4 1x8 8x4] [--out results/fuzz.json]

Every variant, random heads / head dim / FFN width / blocks, batch 1-2, aligned and unaligned latents
down to 1-2 tokens, every padding mode (``wan_sharding.jobs.fuzz``); the cases of one backend and
mesh run in one check worker. Prints each worker's worst difference, writes the summary (every
mismatch in full) and exits 1 when any case differs by more than the bound.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from wan_sharding.jobs.fuzz import MAX_ABS, MESHES, fuzz_cases, run_fuzz  # noqa: E402
from wan_sharding.options import CPU_BACKENDS  # noqa: E402
from wan_sharding.runtime.workers import atomic_write  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--backends", nargs="+", default=list(CPU_BACKENDS), choices=list(CPU_BACKENDS))
    ap.add_argument("--meshes", nargs="+", default=list(MESHES))
    ap.add_argument("--max-abs", type=float, default=MAX_ABS)
    ap.add_argument("--out", default="results/fuzz.json")
    args = ap.parse_args()
    if args.cases < 1:
        ap.error("--cases must be >= 1")
    cases = fuzz_cases(args.cases, args.seed, args.backends, args.meshes)
    summary = run_fuzz(cases, args.max_abs, progress=lambda s: print(s, flush=True))
    summary = {"command": "python scripts/fuzz_sharding.py " + shlex.join(sys.argv[1:]), "seed": args.seed,
               "date": time.strftime("%Y-%m-%d"), **summary}
    atomic_write(args.out, json.dumps(summary, indent=1) + "\n")
    if Path(args.out).resolve() == (ROOT / "results" / "fuzz.json").resolve():  # the file docs/check.md quotes
        import docs_figures  # scripts/, beside this one

        print("\n".join(docs_figures.update(["fuzz"])) or "docs/check.md unchanged")
    print(f"{summary['cases']} cases in {summary['seconds']:.0f} s: {summary['mismatches']} mismatches "
          f"(bound {args.max_abs:g}); worst max-abs {summary['worst_max_abs']:.2e} ({summary['worst_case']}), "
          f"min PCC {summary['min_pcc']:.9f}; summary: {args.out}")
    for r in summary["failed"]:
        if "error" in r:
            print(f"WORKER FAILED {r['backend']} {r['mesh']} ({len(r['cases'])} cases): {r['error'][-300:]}")
        else:
            print(f"MISMATCH {r['backend']} {r['mesh']} {r['case']}: max-abs {r['max_abs']:.2e}, PCC {r['pcc']:.9f}")
    return 1 if summary["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
