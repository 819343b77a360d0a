"""The two compile frontends side by side: torchax vs torch-xla (the lowering hardware compiles).

For T2V-A14B at full width, each (mesh, resolution) is compiled with tt-mlir (compile-only,
Wormhole descriptor, bf16, default padding and fused SDPA) through both frontends at 1 and 2
blocks; the difference is one block's bill. Printed side by side per configuration: TTNN ops per
block, the per-block collectives with bytes and whether they meet the design's bf16 minimum, the
fused attention calls that reached TTIR (and whether Q stays split over SP), the flatbuffer and
TTNN text sizes, the bytes of constants baked into the program, and the compile times.

torch-xla has no abstract-weight path: its trace holds the weights in host memory (uninitialised,
but allocated) plus torch-xla's device copy. Two full-width blocks peak at ~8-9 GB on this machine,
so the frontends are compared at 2 blocks, not 40 (the torchax column at 40 blocks is
scripts/bench_compile.py).

    python scripts/bench_frontends.py                          # 480p + 720p on 1x4, 2x4, 8x4
    python scripts/bench_frontends.py --meshes 2x4 --resolutions 480p
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

from wan_sharding.compile import FRONTENDS, CompileRequest, compile_reports, latent_for, sysdesc  # noqa: E402
from wan_sharding.compile.report import comparison_row  # noqa: E402
from wan_sharding.runtime.workers import atomic_write, install_signal_handlers  # noqa: E402

def _mb(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.1f}"


def markdown(pairs: list[tuple[str, str, list[dict]]]) -> str:
    head = ["mesh", "res", "frontend", "per block", "bill (bytes)", "SP gather per block", "collective MiB/block",
            "fused SDPA (Q split)", "rows_scatter/blk", "flatbuffer MiB", "TTNN text MiB", "constants MiB",
            "trace s", "tt-mlir s", "trace peak GB"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for mesh, res, rows in pairs:
        for x in rows:
            if not x["ok"]:
                out.append(f"| {mesh} | {res} | {x['frontend']} | FAILED: {x['error'][:80]} |" + " |" * (len(head) - 4))
                continue
            pb = x["per_block"] or {}
            out.append("| " + " | ".join([
                mesh, res, x["frontend"], f"{pb.get('large', '?'):g}+{pb.get('small', '?'):g}" if pb else "?",
                "ok" if x["bill_ok"] else "FAILS", "; ".join(x["sp_gather"]) or "-",
                f"{x['collective_bytes_per_block'] / 2**20:.1f}",
                f"{x['sdpa_fused']} ({'yes' if x['q_split'] else 'NO'})" if x["sdpa_fused"] is not None else "-",
                f"{x['ops_per_block']['rows_scatter']:g}", _mb(x["flatbuffer_bytes"]), _mb(x["ttnn_ir_bytes"]),
                _mb(x["constant_bytes"]), f"{x['trace_seconds']:.1f}", f"{x['compile_seconds']:.1f}",
                f"{(x['trace_rss_mb'] or 0) / 1024:.1f}",
            ]) + " |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--meshes", default="1x4,2x4,8x4")
    p.add_argument("--resolutions", default="480p,720p")
    p.add_argument("--variant", default="t2v-a14b")
    p.add_argument("--blocks", type=int, default=2, help="the deep graph's blocks (the bill uses it and blocks-1)")
    p.add_argument("--arch", default="wormhole_b0", choices=list(sysdesc.ARCHS))
    p.add_argument("--out", default=str(ROOT / "results" / "frontends.json"))
    p.add_argument("--timeout", type=float, default=7200.0)
    p.add_argument("-v", "--verbose", action="store_true")
    args = p.parse_args(argv)
    install_signal_handlers()

    configs = [(m, res) for res in args.resolutions.split(",") for m in args.meshes.split(",")]
    t0 = time.perf_counter()
    pairs, runs = [], []
    with tempfile.TemporaryDirectory(prefix="wan_frontends_") as tmp:
        # One batch per configuration: its IRs (the torch-xla flatbuffers run to hundreds of MB) are
        # measured and dropped before the next.
        for mesh, res in configs:
            reqs = [CompileRequest(variant=args.variant, size="full", mesh=mesh, latent=latent_for(res), resolution=res,
                                   blocks=args.blocks, frontend=f) for f in FRONTENDS]
            print(f"... {mesh} {res}: {', '.join(FRONTENDS)}", file=sys.stderr, flush=True)
            work = Path(tmp) / f"{mesh}-{res}"
            reports = compile_reports(reqs, args.arch, timeout=args.timeout, work_dir=work, verbose=args.verbose,
                                      padding_cost=False)
            rows = [comparison_row(r) for r in reports]
            pairs.append((mesh, res, rows))
            runs += rows
            print("\n".join(markdown([(mesh, res, rows)]).splitlines()[2:]), file=sys.stderr, flush=True)
    wall = time.perf_counter() - t0

    out = {
        "what": f"T2V-A14B full width, {args.blocks - 1}- and {args.blocks}-block compiles per frontend, tt-mlir "
                "compile-only, bf16, default padding (mask) and fused SDPA",
        "plugin": f"{sysdesc.PLUGIN_DIST}=={sysdesc.installed_plugin_version()}", "arch": args.arch,
        "host": f"{platform.machine()}, {platform.python_version()}",
        "command": "python scripts/bench_frontends.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "wall_seconds_all": round(wall, 1), "runs": runs,
    }
    path = atomic_write(args.out, json.dumps(out, indent=1) + "\n")
    print(markdown(pairs))
    print(f"\n{len(configs)} configurations x {len(FRONTENDS)} frontends (each at {args.blocks - 1} and {args.blocks} "
          f"blocks) in {wall:.0f} s; written to {path}")
    return 0 if all(x["ok"] and x["bill_ok"] for x in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
