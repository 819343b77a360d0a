"""CFG parallel against SP, per denoising step, side by side: 2x4 and 8x4.

For each mesh, the preset's SP plan (a step: the cond forward, then the uncond one, each on the whole
mesh) against the same mesh cut into two guidance groups with ``--cfg 2`` (a step: one forward of
the pair, one branch per group). Two measurements per layout:

- the compiled bill per step, from tt-mlir compile-only (``wan-sharding compile``: T2V-A14B at full
  width, 480p, bf16, hardware's composites, argument marking and compile options, ``--blocks``
  blocks, torchax frontend): bytes each device moves in collectives, collectives, runtime TTNN ops,
  per block and per step (forwards per step x blocks);
- the warm step time of the tiny DiT on CPU virtual devices (``wan-sharding profile --what
  step``, jax): a CPU comparison of the two layouts on this host only, not a hardware figure.

Prints one table and writes ``results/cfg.json``.

    python scripts/bench_cfg.py                      # 2x4 and 8x4, 2 blocks, CPU steps x 5
    python scripts/bench_cfg.py --meshes 2x4 --iters 3 --no-compile
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT))

from wan_sharding.jobs.profile import CPU_NOTE, run_profile  # noqa: E402
from wan_sharding.mesh import with_cfg  # noqa: E402
from wan_sharding.plan import ShardingPlan  # noqa: E402
from wan_sharding.runtime.workers import WorkerError, atomic_write, install_signal_handlers  # noqa: E402

CLI = [sys.executable, "-m", "wan_sharding.cli"]


def layouts(mesh: str) -> list[tuple[str, ShardingPlan | None]]:
    """The preset's SP layout and its cfg cut, as (label, plan or None for the preset)."""
    return [(f"{mesh} SP", None), (f"{mesh} cfg", ShardingPlan.from_mesh(with_cfg(mesh)))]


def cpu_step(mesh: str, plan: ShardingPlan | None, args: argparse.Namespace) -> dict:
    """Warm step time of the tiny DiT on CPU virtual devices (jax)."""
    params = dict(backend="jax", mesh=mesh, padding=plan.padding if plan else "mask", what=["step"],
                  variant="t2v-a14b", warmup=args.warmup, iters=args.iters, resolution="small", latent=None,
                  dtype="fp32", patches=[], cache="none",
                  plan=plan.to_dict() if plan else None, plan_name=plan.name if plan else None)
    run = run_profile(params, echo=False, timeout=1800)
    if not run.ok:
        raise WorkerError(f"profile {mesh} ({'cfg' if plan else 'SP'}) failed:\n{run.output[-3000:]}")
    (r,) = run.results
    return {k: r[k] for k in ("median_s", "min_s", "max_s", "times_s", "forwards_per_iter", "tokens", "padded_tokens")}


def compiled_step(mesh: str, plan: ShardingPlan | None, args: argparse.Namespace, out: Path) -> dict:
    """The tt-mlir compile-only report of this layout (``wan-sharding compile --json``)."""
    cmd = [*CLI, "compile", "--mesh", mesh, "--blocks", str(args.blocks), "--resolution", args.resolution,
           "--json", "--out", str(out)]
    if plan is not None:
        cmd += ["--cfg", "2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    try:
        report = json.loads(proc.stdout)
    except ValueError:
        return {"ok": False, "error": (proc.stderr or proc.stdout)[-600:]}
    return {"ok": proc.returncode == 0, "command": " ".join(cmd[2:]), "report": report}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--meshes", nargs="+", default=["2x4", "8x4"])
    p.add_argument("--blocks", type=int, default=2)
    p.add_argument("--resolution", default="480p")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--no-compile", action="store_true", help="CPU step times only")
    p.add_argument("--out", default=str(ROOT / "results" / "cfg.json"))
    args = p.parse_args(argv)
    install_signal_handlers()
    start = time.time()
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-cfg-") as tmp:
        for mesh in args.meshes:
            for label, plan in layouts(mesh):
                row = {"mesh": mesh, "layout": label, "plan": plan.name if plan else None,
                       "cpu": cpu_step(mesh, plan, args)}
                if not args.no_compile:
                    row["compiled"] = compiled_step(mesh, plan, args, Path(tmp) / label.replace(" ", "-"))
                rows.append(row)
                print(summary_line(row), flush=True)
    print()
    print(markdown(rows))
    result = {"date": time.strftime("%Y-%m-%d"), "host": platform.node(), "cpus": os.cpu_count(),
              "command": "python scripts/bench_cfg.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "seconds": round(time.time() - start, 1), "cpu_note": CPU_NOTE, "rows": rows}
    atomic_write(Path(args.out), json.dumps(result, indent=1) + "\n")
    print(f"\nwrote {args.out} ({result['seconds']:.0f} s)")
    return 0


def step(row: dict) -> dict | None:
    """The compiled report's per-step figures (``report["step"]``), when it compiled."""
    c = row.get("compiled")
    if not c or not c.get("ok"):
        return None
    return c["report"].get("step")


def summary_line(row: dict) -> str:
    cpu, s = row["cpu"], step(row)
    compiled = "" if s is None else (
        f"; compiled per step: {s['per_step']['collectives']:g} collectives, "
        f"{s['per_step']['collective_bytes'] / 2**30:.1f} GiB moved per device, {s['per_step']['runtime_ops']:g} runtime ops")
    return (f"{row['layout']:9} CPU warm step median {cpu['median_s']:.4f} s ({cpu['forwards_per_iter']} forwards)"
            + compiled)


def markdown(rows: list[dict]) -> str:
    head = ["mesh", "layout", "compiled as", "bill", "per block: collectives (large)", "MiB / device / block",
            "forwards / step", "per step: collectives", "GiB / device", "runtime ops", "CPU warm step s", "x SP"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    base: dict[str, float] = {}
    for r in rows:
        med = r["cpu"]["median_s"]
        base.setdefault(r["mesh"], med)
        s = step(r)
        if s is None:
            compiled = ["not compiled" if "compiled" not in r else "FAILED: " + r["compiled"].get("error", "")[:60],
                        "", "", "", "", "", "", ""]
        else:
            rep = r["compiled"]["report"]
            how = (rep.get("cfg") or {}).get("how") or "whole mesh"
            mesh = "x".join(map(str, (rep.get("cfg") or {}).get("compiled_mesh") or [rep["mesh"]]))
            b, st = s["per_block"], s["per_step"]
            compiled = [f"{how} ({mesh})", "OK" if rep.get("bill_ok") else "FAILS",
                        f"{b['collectives']:g} ({b['large_collectives']:g})", f"{b['collective_bytes'] / 2**20:.1f}",
                        str(s["forwards_per_step"]), f"{st['collectives']:g}", f"{st['collective_bytes'] / 2**30:.1f}",
                        f"{st['runtime_ops']:g}"]
        out.append("| " + " | ".join([r["mesh"], r["layout"], *compiled, f"{med:.4f}", f"{med / base[r['mesh']]:.2f}"])
                   + " |")
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
