"""Compile and plan Wan 2.2 on multi-Galaxy meshes (2 and 4 Galaxies: 64 and 128 chips).

Part 1, compile (tt-mlir compile-only, torchax lowering, abstract weights): T2V-A14B and TI2V-5B at
full width, 1- and 2-block graphs (the per-block bill is their difference), at 480p and 720p, on the
64- and 128-chip meshes, for each chip architecture. Records the bill check, tile alignment, what
the padding mode adds against the unpadded graph, tt-mlir seconds and the worker's peak memory.

Part 2, plan: ``plan_sharding`` (both stages) on the same meshes at 720p for T2V-A14B, timed.

The meshes: tt-metal's views of 2 and 4 Galaxies (4x16, 4x32) on both architectures, and tt-xla's
multi-host Wormhole systems (8x8 and 8x16, rank bindings dual_galaxy and quad_galaxy). Each system
is planned on the rank binding that names it where tt-xla's plugin has one; every row says what
crosses the hosts (one per Galaxy) per denoising step.

TI2V-5B's resolutions: "720p" is its native 704 x 1280 (``704p``, 121 frames), "480p" is 480 x 832 at
121 frames through the Wan 2.2 VAE (stride 4 x 16 x 16): latent 31 x 30 x 52.

    python scripts/bench_galaxies.py                        # everything -> results/galaxies.json
    python scripts/bench_galaxies.py --archs blackhole --no-plan
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
from wan_sharding.mesh import mesh_from_preset  # noqa: E402
from wan_sharding.runtime.workers import atomic_write  # noqa: E402

MESHES = ("4x16-tt-metal", "4x32-tt-metal", "8x8-dual-galaxy", "8x16-quad-galaxy")
# tt-metal's views of the 16x4 and 32x4 systems on either chip; tt-xla's Wormhole systems on theirs
ARCHS_OF = {"8x8-dual-galaxy": ("wormhole_b0",), "8x16-quad-galaxy": ("wormhole_b0",)}
# (variant, label, resolution name or None, latent F,H,W)
WORKLOADS = (
    ("t2v-a14b", "480p", "480p", None),
    ("t2v-a14b", "720p", "720p", None),
    ("ti2v-5b", "480p", None, (31, 30, 52)),
    ("ti2v-5b", "720p", "704p", None),
)


def binding_for(mesh: str, arch: str) -> str | None:
    """The rank binding of tt-xla's plugin whose system this mesh (on these chips) is, if any."""
    from wan_sharding.systems import RANK_BINDINGS

    grid = mesh_from_preset(mesh).grid
    return next((b.name for b in RANK_BINDINGS.values() if b.serves(grid) and b.arch == arch), None)


def systems(meshes: list[str], archs: list[str]) -> list[tuple[str, str]]:
    return [(m, a) for a in archs for m in meshes if a in ARCHS_OF.get(m, archs)]


def compile_runs(meshes: list[str], archs: list[str], blocks: int, timeout: float) -> list[dict]:
    out = []
    for arch in archs:
        reqs, labels = [], []
        for mesh, _ in [s for s in systems(meshes, archs) if s[1] == arch]:
            for variant, label, res, latent in WORKLOADS:
                reqs.append(CompileRequest(variant=variant, size="full", mesh=mesh, blocks=blocks, padding="mask",
                                           latent=latent_for(res, None if latent is None else ",".join(map(str, latent))),
                                           resolution=res))
                labels.append(label)
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="wan_galaxies_") as tmp:
            reports = compile_reports(reqs, arch, timeout=timeout, work_dir=Path(tmp))
        wall = time.perf_counter() - t0
        for r, label in zip(reports, labels):
            r.pop("ttnn_path", None)
            r.update(arch=arch, label=label, batch_wall_seconds=round(wall, 1))
            out.append(r)
    return out


def plan_runs(meshes: list[str], archs: list[str], timeout: float) -> list[dict]:
    from wan_sharding.planner import plan_sharding

    out = []
    for mesh, arch in systems(meshes, archs):
        t0 = time.perf_counter()
        try:
            rep = plan_sharding(mesh, arch, "t2v-a14b", "720p", timeout=timeout, cfg_split=True,
                                rank_binding_name=binding_for(mesh, arch))
        except RuntimeError as e:  # e.g. the plugin failing to start in its worker: say so, go on
            out.append({"mesh": mesh, "arch": arch, "resolution": "720p", "error": str(e)[:300],
                        "wall_seconds": round(time.perf_counter() - t0, 1), "counts": {}, "recommended": None,
                        "ranked": []})
            continue
        data = rep.to_json()
        rec = data["recommended"]
        out.append({"mesh": mesh, "arch": arch, "resolution": "720p", "wall_seconds": round(time.perf_counter() - t0, 1),
                    "counts": data["counts"], "recommended": rec, "hosts": data["hosts"],
                    "ranked": [{k: c[k] for k in ("rank", "name", "stage", "estimated_seconds_per_forward",
                                                   "memory_per_chip_gb", "tp_crosses_hosts",
                                                   "cross_host_gb_per_step", "why_lost")}
                               for c in data["candidates"] if c["rank"] is not None and c["stage"] != "illegal"]})
    return out


def compile_table(runs: list[dict]) -> str:
    head = ["mesh", "chips", "arch", "variant", "res", "tokens -> padded", "tokens/chip", "per block", "bill",
            "tiles", "padding adds (once per forward; per block)", "crosses hosts", "GB between hosts per step",
            "tt-mlir s (1+2 blk)", "worker peak GB"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in runs:
        m = mesh_from_preset(r["mesh"])
        if not r["ok"]:
            rows.append(f"| {r['mesh']} | {m.num_devices} | {r['arch']} | {r['variant']} | {r['label']} | "
                        f"FAILED: {str(r.get('error'))[:80]} |")
            continue
        tot = r.get("per_block_totals") or {}
        pad = r.get("padding_ops_per_forward")
        if pad is None:  # the unpadded twin cannot be split: the padding is what makes the mesh usable
            pad_text = f"no unpadded twin: L/SP = {r['tokens'] / r['sp']:g}"
        else:
            per_block = r.get("padding_ops_per_block") or {}
            pad_text = (", ".join(f"{k} +{v:g}" for k, v in sorted(pad.items(), key=lambda kv: -kv[1])[:3]) or "none")
            pad_text += "; per block " + (", ".join(f"{k} +{v:g}" for k, v in per_block.items()) or "none")
        cells = [r["mesh"], str(m.num_devices), r["arch"], r["variant"], r["label"],
                 f"{r['tokens']} -> {r['padded_tokens']}", str(r["padded_tokens"] // r["sp"]),
                 f"{tot.get('large', '?'):g}+{tot.get('small', '?'):g}" if tot else "?",
                 "ok" if r["bill_ok"] else "DIFFERS", "ok" if r["tile_aligned"] else "NOT ALIGNED", pad_text,
                 *hosts_cells(r.get("hosts")),
                 f"{r['compile_seconds'] + (r.get('base_compile_seconds') or 0.0):.1f}", f"{r['rss_mb'] / 1e3:.1f}"]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def hosts_cells(hosts: dict | None) -> list[str]:
    """Which axes cross hosts (role, chips per host) and the bytes between hosts per denoising step."""
    if not hosts:
        return ["-", "-"]
    axes = ", ".join(f"{a['axis']} ({a['role'] or 'idle'}) / {a['chips_per_host']}" for a in hosts["crossing_axes"])
    return [axes, f"{hosts['cross_host_bytes_per_step'] / 1e9:.0f}"]


def plan_table(plans: list[dict]) -> str:
    """The recommendation per mesh, and where tt-metal's configuration (SP on the long axis, TP 4,
    no CFG split; FSDP off, or on where the weights need it, as tt-metal does on Wormhole) ranks."""
    head = ["mesh", "arch", "rank binding", "recommended", "s/forward", "GB/chip", "GB between hosts per step",
            "tt-metal's config: rank, s/forward", "compiled (ok)", "plan s"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for pl in plans:
        rec = pl["recommended"]
        sp = mesh_from_preset(pl["mesh"]).sp
        metal = next((c for suffix in (f"sp{sp}[cols] tp4[rows] replicated-D mask",
                                       f"sp{sp}[cols] tp4[rows] fsdp replicated-D mask")
                      for c in pl["ranked"] if c["name"].endswith(suffix)), None)
        binding = (pl.get("hosts") or {}).get("rank_binding") or "-"
        gb = rec.get("cross_host_gb_per_step") if rec else None
        cells = [pl["mesh"], pl["arch"], binding, rec["name"] if rec else "none: " + pl.get("error", "")[:80],
                 f"{rec['estimated_seconds_per_forward']:.2f}" if rec else "-",
                 f"{rec['memory_per_chip_gb']:.1f}" if rec else "-", f"{gb:.0f}" if gb is not None else "-",
                 f"{metal['rank']}, {metal['estimated_seconds_per_forward']:.2f}"
                 + (" (fsdp)" if "fsdp" in metal["name"] else "") if metal and
                 metal["estimated_seconds_per_forward"] else "-",
                 f"{pl['counts'].get('compiled', 0)} ({pl['counts'].get('compiled_ok', 0)})", f"{pl['wall_seconds']:.0f}"]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--meshes", default=",".join(MESHES))
    p.add_argument("--archs", default="blackhole,wormhole_b0")
    p.add_argument("--blocks", type=int, default=2, help="depth of the deep graph (the shallow one is 1 block)")
    p.add_argument("--no-plan", action="store_true", help="compile only (the plans already in --out are kept)")
    p.add_argument("--skip-compile", action="store_true", help="reuse the compiles in --out, run the plans again")
    p.add_argument("--out", default=str(ROOT / "results" / "galaxies.json"))
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per compile batch")
    p.add_argument("--table", action="store_true", help="print the tables of an existing --out file and stop")
    args = p.parse_args(argv)
    if args.table:
        data = json.loads(Path(args.out).read_text())
        print(compile_table(data["compiles"]))
        print(plan_table(data["plans"]))
        return 0
    meshes, archs = args.meshes.split(","), args.archs.split(",")
    # --no-plan keeps the plans of --out: the planner pins its own lowering (planner/compiled.py)
    kept_plans = json.loads(Path(args.out).read_text()).get("plans", []) if args.no_plan and Path(args.out).exists() else []

    out = {
        "what": "tt-mlir compile-only (torchax lowering, abstract weights, mask padding); per-block bill from the "
                "1- and N-block graphs; planner runs both stages",
        "plugin": f"{sysdesc.PLUGIN_DIST}=={sysdesc.installed_plugin_version()}",
        "host": f"{platform.machine()}, {platform.python_version()}",
    }
    if args.skip_compile:  # keep the compiles of an earlier run, plan again
        old = json.loads(Path(args.out).read_text())
        out.update(compile_wall_seconds=old["compile_wall_seconds"], compiles=old["compiles"])
    else:
        t0 = time.perf_counter()
        out["compiles"] = compile_runs(meshes, archs, args.blocks, args.timeout)
        out["compile_wall_seconds"] = round(time.perf_counter() - t0, 1)
        atomic_write(args.out, json.dumps({**out, "plans": kept_plans}, indent=1))  # kept even if a plan fails
    runs = out["compiles"]
    print(compile_table(runs))
    print(f"\n{len(runs)} configurations compiled in {out['compile_wall_seconds']:.0f} s (torchax lowering)")
    plans = kept_plans if args.no_plan else plan_runs(meshes, archs, args.timeout)
    print(plan_table(plans))
    path = atomic_write(args.out, json.dumps({**out, "plans": plans}, indent=1))
    print(f"written to {path}")
    ok = all(r["ok"] and r["bill_ok"] and r["tile_aligned"] for r in runs)
    return 0 if ok and all(pl["recommended"] for pl in plans) else 1


if __name__ == "__main__":
    sys.exit(main())
