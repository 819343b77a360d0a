"""LoRA adapters on sharded experts, measured: results/lora.json (docs/lora.md).

    .venv/bin/python scripts/bench_lora.py                # everything below (~30 min on 2 cores)
    .venv/bin/python scripts/bench_lora.py --only bill distilled memory   # the quick parts

- ``exactness``: the tiny LoRA pipeline sharded against unsharded through every switch
  (``wan_sharding.jobs.lora_check``): jax and xla, 1x4 / 2x4 / 8x4, T2V-A14B, I2V-A14B and TI2V-5B;
  on 2x4 also CFG parallel, FirstBlockCache, and the adapters merged before sharding; the compiles
  after each switch.
- ``bill``: what a LoRA on every Linear of the blocks adds to one compiled forward per block
  (instructions, all-reduces and their bytes), jax on 2x4 and 8x4, ranks 4 and 16.
- ``compile``: ``wan-sharding compile --size tiny --mesh 2x4 --blocks 1`` through tt-mlir (compile-only)
  without an adapter and with ``--lora-rank 4`` and ``16``: runtime and const-eval TTNN ops per block,
  by cause, the per-block collectives and whether the bill matches the design's.
- ``memory``: a rank-R adapter's bytes per chip at full size (T2V-A14B expert, bf16), its specs
  beside the base's, against the base's bytes per chip.
- ``distilled``: forwards per video and the planner's seconds per video, 40 steps with guidance
  against a step-distilled LoRA's 4 steps at guidance 1.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from wan_sharding.jobs.launch import worker_env  # noqa: E402
from wan_sharding.mesh import mesh_from_preset  # noqa: E402

OUT = ROOT / "results" / "lora.json"
VARIANTS = ("t2v-a14b", "i2v-a14b", "ti2v-5b")
PARTS = ("exactness", "bill", "compile", "memory", "distilled")


def _worker(backend: str, devices: int, code: str) -> list[dict]:
    proc = subprocess.run([sys.executable, "-c", code], env=worker_env(backend, devices), capture_output=True,
                          text=True, timeout=3600, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(proc.stdout[-2000:] + proc.stderr[-3000:])
    return [json.loads(line[7:]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]


def exactness(meshes: list[str], save=lambda rows: None) -> list[dict]:
    """Every case, one worker per backend and mesh; ``save(rows)`` after each worker (a long run
    keeps what it finished)."""
    rows = []
    for mesh in meshes:
        for backend in ("jax", "xla"):
            cases = [{"variant": v, "backend": backend, "mesh": mesh} for v in VARIANTS]
            if mesh == "2x4":
                cases += [{"variant": "t2v-a14b", "backend": backend, "mesh": mesh, "cfg": True},
                          {"variant": "ti2v-5b", "backend": backend, "mesh": mesh, "cache": "fbc"}]
                cases += [{"variant": v, "backend": backend, "mesh": mesh, "fuse": True} for v in VARIANTS]
            code = f"from wan_sharding.jobs.lora_check import main; main([{json.dumps(json.dumps(cases))}])"
            print(f"exactness: {backend} {mesh} ({len(cases)} cases)", flush=True)
            rows += _worker(backend, mesh_from_preset(mesh).num_devices, code)
            save(rows)
    return rows


def bill() -> list[dict]:
    rows = []
    for mesh in ("2x4", "8x4"):
        code = ("import json\nfrom wan_sharding.jobs.lora_check import block_bill\n"
                + "".join(f"print('RESULT ' + json.dumps(block_bill(rank={r}, mesh={mesh!r})), flush=True)\n"
                          for r in (4, 16)))
        print(f"bill: {mesh}", flush=True)
        rows += _worker("jax", mesh_from_preset(mesh).num_devices, code)
    return rows


def compile() -> list[dict]:
    import tempfile

    rows = []
    for rank in (None, 4, 16):
        with tempfile.TemporaryDirectory(prefix="bench-lora-") as out:
            cmd = [sys.executable, "-m", "wan_sharding.cli", "compile", "--size", "tiny", "--mesh", "2x4", "--blocks", "1",
                   "--out", out, *(["--lora-rank", str(rank)] if rank else [])]
            print("compile: " + " ".join(cmd[3:]), flush=True)
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, cwd=ROOT)
            if proc.returncode != 0:
                raise RuntimeError(proc.stdout[-2000:] + proc.stderr[-2000:])
            r = json.loads((Path(out) / "report.json").read_text())
        rows.append({"lora_rank": rank or 0, "mesh": "2x4", "size": "tiny", "frontend": r["frontend"],
                     **{k: r[k] for k in ("runtime_ops_per_block", "const_eval_ops_per_block",
                                          "runtime_ops_per_block_by_cause", "per_block_totals", "design", "bill_ok")}})
    return rows


def memory(ranks=(32, 64, 128), meshes=("2x4", "8x4")) -> list[dict]:
    """Bytes per chip of the base weights and of a rank-R adapter on every Linear a Wan LoRA targets
    (blocks, condition embedder, proj_out), full-size T2V-A14B expert on the meta device, bf16: what
    the planner counts (``plan --lora-rank R``)."""
    from wan_sharding.plan import ShardingPlan
    from wan_sharding.planner.weights import adapter_bytes_per_expert, weight_bytes_per_expert

    rows = []
    for rank in ranks:
        for m in meshes:
            plan = ShardingPlan.from_mesh(mesh_from_preset(m))
            base, adapter = weight_bytes_per_expert("t2v-a14b", plan), adapter_bytes_per_expert("t2v-a14b", plan, rank)
            rows.append({"variant": "t2v-a14b", "rank": rank, "mesh": m, "base_bytes_per_chip": int(base),
                         "adapter_bytes_per_chip": int(adapter), "adapter_share": round(adapter / base, 5)})
    return rows


def distilled() -> list[dict]:
    """Forwards per video and the planner's seconds per video (one expert's forward estimate x
    forwards; the A14B pipelines run one expert per step), 40 guided steps against 4 at guidance 1."""
    from wan_sharding.plan import ShardingPlan
    from wan_sharding.planner.analytic import estimate
    from wan_sharding.planner.hardware import chip as chip_for, fabric_for
    from wan_sharding.planner.workload import Workload

    rows = []
    for system, mesh, arch, resolution in (("bh-2x4", "2x4", "blackhole", "480p"),
                                           ("bh-galaxy", "8x4", "blackhole", "720p")):
        spec = mesh_from_preset(mesh)
        est = estimate(Workload.build("t2v-a14b", resolution), ShardingPlan.from_mesh(spec), chip_for(arch),
                       fabric_for(arch, spec.shape))
        for label, steps, guidance in (("40 steps, guidance 4", 40, True), ("distilled LoRA: 4 steps, guidance 1", 4, False)):
            forwards = steps * (2 if guidance else 1)
            rows.append({"system": system, "mesh": mesh, "arch": arch, "resolution": resolution, "run": label,
                         "steps": steps, "forwards_per_video": forwards,
                         "seconds_per_forward": round(est.seconds_per_forward, 4),
                         "denoising_seconds_per_video": round(est.seconds_per_forward * forwards, 2)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="+", choices=PARTS, default=list(PARTS))
    ap.add_argument("--meshes", nargs="+", default=["1x4", "2x4", "8x4"], help="exactness meshes")
    args = ap.parse_args()
    old = json.loads(OUT.read_text()) if OUT.exists() else {}
    out = {**old, "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), "host": platform.node(),
           "date": datetime.date.today().isoformat()}
    def save(part: str, rows: list[dict]) -> None:  # under a temporary name, then renamed: always a whole file
        out[part] = rows
        tmp = OUT.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(out, indent=1) + "\n")
        os.replace(tmp, OUT)

    # exactness on some meshes replaces those meshes' rows and keeps the others'
    kept = [r for r in old.get("exactness", []) if r.get("mesh") not in args.meshes]
    for part in args.only:
        save(part, kept + exactness(args.meshes, lambda rows: save("exactness", kept + rows)) if part == "exactness"
             else globals()[part]())
    print(f"wrote {OUT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
