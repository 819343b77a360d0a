"""Each model rewrite (``wan_sharding.patches``) measured on the compiled graph, side by side.

For T2V-A14B at full width, 480p, bf16, default padding and fused SDPA, each mesh is compiled with
tt-mlir (compile-only, Wormhole descriptor) at 1 and 2 blocks with no patch, each patch alone and
all of them together, on both frontends (torchax; torch-xla, the lowering hardware compiles, where
its trace fits this machine's memory: it holds each weight shard once per virtual device, and 8x4
does not fit 24 GB). Printed per configuration: TTNN ops per block (by kind), the per-block
collectives and bytes, the fused attention, flatbuffer / TTNN text / constant bytes, compile time.

    python scripts/bench_patches.py                                   # 2x4 and 8x4
    python scripts/bench_patches.py --meshes 2x4 --frontends torch-xla
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
from wan_sharding.patches import EXACT_PATCHES, PATCHES  # noqa: E402
from wan_sharding.runtime.workers import atomic_write, install_signal_handlers  # noqa: E402

SHOWN_OPS = ("matmul", "linear", "rows_scatter", "typecast", "reshape", "permute")


def _mb(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.2f}"


def markdown(rows: list[dict]) -> str:
    head = ["mesh", "frontend", "patches", "ops/block", *(f"{o}/blk" for o in SHOWN_OPS), "bill (bytes)",
            "collective MiB/block", "fused SDPA", "flatbuffer MiB", "constants MiB", "tt-mlir s"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for x in rows:
        name = "+".join(x["patches"]) or "none"
        if not x["ok"]:
            out.append(f"| {x['mesh']} | {x['frontend']} | {name} | FAILED: {x['error'][:70]} |" + " |" * (len(head) - 4))
            continue
        out.append("| " + " | ".join([
            x["mesh"], x["frontend"], name, f"{x['ops_per_block_total']:g}",
            *(f"{x['ops_per_block'].get(o, 0):g}" for o in SHOWN_OPS),
            "ok" if x["bill_ok"] else "FAILS", f"{x['collective_bytes_per_block'] / 2**20:.1f}",
            f"{x['sdpa_fused']} ({'Q split' if x['q_split'] else 'Q GATHERED'})",
            _mb(x["flatbuffer_bytes"]), _mb(x["constant_bytes"]), f"{x['compile_seconds']:.1f}",
        ]) + " |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--meshes", default="2x4,8x4")
    p.add_argument("--resolution", default="480p")
    p.add_argument("--frontends", default=",".join(FRONTENDS))
    p.add_argument("--torch-xla-meshes", default="1x4,2x4",
                   help="meshes whose torch-xla trace fits this machine's memory (8x4 does not in 24 GB)")
    p.add_argument("--out", default=str(ROOT / "results" / "patches.json"))
    p.add_argument("--timeout", type=float, default=7200.0)
    args = p.parse_args(argv)
    install_signal_handlers()

    sets = [(), *((name,) for name in PATCHES), tuple(EXACT_PATCHES), tuple(PATCHES)]
    t0 = time.perf_counter()
    rows = []
    with tempfile.TemporaryDirectory(prefix="wan_patches_") as tmp:
        for mesh in args.meshes.split(","):
            for frontend in args.frontends.split(","):
                if frontend == "torch-xla" and mesh not in args.torch_xla_meshes.split(","):
                    rows += [{"frontend": frontend, "patches": list(s), "mesh": mesh, "resolution": args.resolution,
                              "ok": False, "error": "not run: the torch-xla trace does not fit this machine's memory"}
                             for s in sets]
                    continue
                reqs = [CompileRequest(variant="t2v-a14b", size="full", mesh=mesh, latent=latent_for(args.resolution),
                                       resolution=args.resolution, blocks=2, frontend=frontend, patches=s)
                        for s in sets]
                print(f"... {mesh} {frontend}: {len(reqs)} patch sets", file=sys.stderr, flush=True)
                reports = compile_reports(reqs, "wormhole_b0", timeout=args.timeout,
                                          work_dir=Path(tmp) / f"{mesh}-{frontend}", padding_cost=False)
                rows += [comparison_row(r) for r in reports]
    wall = time.perf_counter() - t0
    path = atomic_write(args.out, json.dumps({
        "what": f"T2V-A14B full width, {args.resolution}, 1- and 2-block compiles per patch set, tt-mlir compile-only, "
                "bf16, mask padding, fused SDPA",
        "plugin": f"{sysdesc.PLUGIN_DIST}=={sysdesc.installed_plugin_version()}",
        "host": f"{platform.machine()}, {platform.python_version()}",
        "command": "python scripts/bench_patches.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "wall_seconds_all": round(wall, 1), "runs": rows}, indent=1) + "\n")
    print(markdown(rows))
    print(f"\n{len(rows)} configurations in {wall:.0f} s; written to {path}")
    return 0 if all(x["ok"] and x["bill_ok"] for x in rows if "not run" not in x.get("error", "")) else 1


if __name__ == "__main__":
    sys.exit(main())
