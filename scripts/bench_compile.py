"""Compile the full Wan 2.2 T2V-A14B DiT (40 blocks) through tt-mlir for each mesh and resolution.

Compile-only (no hardware, abstract weights): records tt-mlir compile seconds, the TTNN op
histogram (slice_static and mesh_partition included) and the per-block collective bill (from a
1-block compile of the same configuration) into ``results/compile.json`` and prints a markdown
table. All compiles share one worker process; expect about a minute per 40-block compile on a
2-core machine, plus ~20 s of start-up.

    python scripts/bench_compile.py                       # 480p + 720p on 1x4, 2x4, 8x4
    python scripts/bench_compile.py --meshes 8x4 --resolutions 480p --blocks 4
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT))

from wan_sharding.compile import CompileRequest, compile_reports, latent_for, sysdesc  # noqa: E402
from wan_sharding.options import PADDING_NAMES  # noqa: E402
from wan_sharding.runtime.workers import atomic_write  # noqa: E402

TABLE_OPS = ("all_reduce", "all_gather", "mesh_partition", "slice_static", "pad", "matmul", "linear")


def markdown(reports: list[dict]) -> str:
    head = ["mesh", "res", "tokens/dev", "compile s", *TABLE_OPS, "per block (large+small)", "bill", "tiles"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in reports:
        if not r["ok"]:
            rows.append(f"| {r['mesh']} | {r['resolution']} | | FAILED: {str(r.get('error'))[:60]} |")
            continue
        tot = r.get("per_block_totals") or {}
        per_dev = r["padded_tokens"] // r["sp"] if r.get("padded_tokens") else ""
        cells = [r["mesh"], r["resolution"], str(per_dev), f"{r['compile_seconds']:.1f}",
                 *(str(r["ops"].get(o, 0)) for o in TABLE_OPS),
                 f"{tot.get('large', '?'):g}+{tot.get('small', '?'):g}" if tot else "?",
                 "ok" if r["bill_ok"] else "DIFFERS", "ok" if r["tile_aligned"] else "NOT ALIGNED"]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--meshes", default="1x4,2x4,8x4")
    p.add_argument("--resolutions", default="480p,720p")
    p.add_argument("--variant", default="t2v-a14b")
    p.add_argument("--blocks", type=int, default=None, help="default: all of the variant's (40)")
    # slice by default: the table in docs/compile-only.md was measured with it (the package's default is mask).
    p.add_argument("--padding", default="slice", choices=list(PADDING_NAMES))
    p.add_argument("--arch", default="wormhole_b0", choices=list(sysdesc.ARCHS))
    p.add_argument("--out", default=str(ROOT / "results" / "compile.json"))
    p.add_argument("--keep-irs", default=None, help="folder to keep the IRs in (default: a temp folder, removed)")
    p.add_argument("--timeout", type=float, default=7200.0)
    p.add_argument("-v", "--verbose", action="store_true")
    args = p.parse_args(argv)

    reqs = [
        CompileRequest(variant=args.variant, size="full", mesh=m, latent=latent_for(res), resolution=res,
                       blocks=args.blocks, padding=args.padding)
        for res in args.resolutions.split(",") for m in args.meshes.split(",")
    ]
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="wan_bench_") as tmp:
        work = Path(args.keep_irs) if args.keep_irs else Path(tmp)
        reports = compile_reports(reqs, args.arch, timeout=args.timeout, work_dir=work, verbose=args.verbose)
    wall = time.perf_counter() - t0

    for r in reports:  # paths into a removed temp folder mean nothing later
        if not args.keep_irs:
            r.pop("ttnn_path", None)
    out = {
        "what": "tt-mlir compile-only, abstract weights; compile_seconds = tt-mlir only (trace+lower apart)",
        "plugin": f"{sysdesc.PLUGIN_DIST}=={sysdesc.installed_plugin_version()}",
        "arch": args.arch, "host": f"{platform.machine()}, {platform.python_version()}",
        "wall_seconds_all": round(wall, 1),
        "runs": reports,
    }
    path = atomic_write(args.out, json.dumps(out, indent=1))
    print(markdown(reports))
    print(f"\n{len(reqs)} configurations (+ {len(reqs)} one-block twins for the bill) in {wall:.0f} s; "
          f"written to {path}")
    return 0 if all(r["ok"] and r["bill_ok"] and r["tile_aligned"] for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
