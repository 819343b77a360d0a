"""The VAE on the mesh, measured side by side in one run: host vs sharded decode on CPU, the
compiled bills of one decode step through tt-mlir (the package's halo beside its alternatives),
the CPU PCC matrix, and the per-video stage estimates beside tt-metal's published figures.

1. CPU (``profile --what vae``): the tiny VAE of each pipeline decoding a latent of
   ``--latent`` (default 3 latent frames of 16x24, a 128x192 video) on the host and sharded on
   each mesh, per latent frame. A CPU comparison only: the mesh's virtual devices share the host's
   cores, so this says what sharding costs on a CPU, not what a chip does.
2. Compile-only (``compile --component vae``): the real Wan 2.1 VAE (A14B) on meta weights, the
   first latent frame's decode step at 480p and 720p on 2x4 and 8x4 with each strategy (``halo``,
   ``halo-permute``, ``annotate``, ``channels``) through torchax; then ``halo`` for both VAEs (the
   Wan 2.2 VAE of TI2V-5B too), the first step, the second and the steady one (the program every
   latent frame from the third reuses), through torchax and torch-xla (real, uninitialised weights: a trace
   that would not fit this host's memory is reported as skipped).
3. The CPU PCC matrix (``check --component vae``: both VAEs, decode and encode, padded and not, on
   1x4, 2x4 and 8x4, jax and xla): what the suite's ``slow`` VAE test checks, in full.
4. The stage table (``planner/stages.py``): text encoder, denoising and VAE per video for BH 2x4 480p,
   BH Galaxy 720p and BH 4x32 720p beside tt-metal's bounds and measured figures.

    python scripts/bench_vae.py                 # everything (19 min on a quiet 2-core host)
    python scripts/bench_vae.py --skip-check --skip-compile

Writes ``results/vae.json`` (1-3; a part skipped keeps its last run, marked ``carried_over``) and
``results/stages.json`` (4), then rewrites the figure blocks of docs/vae.md and
docs/pipeline-stages.md from them (``scripts/docs_figures.py``).
"""

from __future__ import annotations

import argparse
import datetime
from dataclasses import asdict
import json
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT))

from wan_sharding.runtime.workers import install_signal_handlers  # noqa: E402

MESHES = ("2x4", "8x4")
RESOLUTIONS = ("480p", "720p")
STRATEGIES = ("halo", "halo-permute", "annotate", "channels")


def cpu_rows(latent: str, meshes: list[str]) -> list[dict]:
    from wan_sharding.jobs.profile import run_profile

    rows = []
    for variant in ("t2v-a14b", "ti2v-5b"):
        for mesh in meshes:
            params = {"backend": "jax", "mesh": mesh, "what": ["vae"], "variant": variant, "warmup": 1, "iters": 2,
                      "latent": latent, "resolution": "tiny", "dtype": "fp32"}
            run = run_profile(params, echo=False)
            if not run.ok:
                raise SystemExit(f"profile worker failed:\n{run.output[-3000:]}")
            rows += run.results
            r = run.results[-1]
            print(f"cpu  {r['vae']} {mesh}: host {r['host_per_frame_s']:.3f} s/latent frame, sharded "
                  f"{r['per_frame_s']:.3f} s/latent frame (first call {r['first_iter_s']:.1f} s)", flush=True)
    return rows


def compile_rows(arch: str) -> list[dict]:
    from wan_sharding.cli.vae import format_vae_reports
    from wan_sharding.compile import CompileError
    from wan_sharding.compile.vae import STEPS, VaeCompileRequest, check_vae_request, compile_vae

    reports = []
    for resolution in RESOLUTIONS:
        for mesh in MESHES:
            reqs = []
            for kind in ("wan2.1", "wan2.2"):
                for frontend in ("torchax", "torch-xla"):
                    for step in STEPS:  # first, second, steady: one trace of the decode for all (torchax)
                        reqs.append(VaeCompileRequest(kind, mesh, resolution, "halo", frontend=frontend, step=step))
                    if kind == "wan2.1" and frontend == "torchax":  # the alternatives, the first step's
                        reqs += [VaeCompileRequest("wan2.1", mesh, resolution, s) for s in STRATEGIES if s != "halo"]
            refused = {}
            for r in reqs:  # said, not left out: a torch-xla trace this host's memory does not hold
                try:
                    check_vae_request(r)
                except CompileError as e:
                    refused[r] = str(e)
            out = compile_vae([r for r in reqs if r not in refused], arch)
            for r in out:
                r.pop("ttnn_path", None)
                r.pop("out_dir", None)
            out += [{"request": asdict(r), "ok": False, "skipped": why} for r, why in refused.items()]
            groups: dict[tuple, list] = {}
            for r in out:
                q = r["request"]
                groups.setdefault((q["kind"], q["frontend"], q["step"]), []).append(r)
            for group in groups.values():
                if "skipped" in group[0]:
                    q = group[0]["request"]
                    print(f"VAE {q['kind']} {q['frontend']} {q['step']} on {mesh} {resolution}: {group[0]['skipped']}")
                else:
                    print(format_vae_reports(group), flush=True)
            reports += out
    return reports


def check_rows() -> list[dict]:
    from wan_sharding.cli.vae import CHECK_CASES
    from wan_sharding.jobs.vae_check import VaeCase, run_meshes

    rows = []
    cases = [VaeCase.parse(c.format(vae=k, dtype=d)) for k in ("wan2.1", "wan2.2") for d in ("fp32", "bf16")
             for c in CHECK_CASES]
    meshes = ("1x4", "2x4", "8x4")
    for backend in ("jax", "xla"):
        for group in ([meshes] if backend == "jax" else [[m] for m in meshes]):  # jax: one worker for all
            for r in run_meshes(backend, {m: cases for m in group}):
                rows.append(r)
                print(f"check {backend} {r['mesh']} {r['case']} ({r['split']}): PCC {r['pcc']:.9f} max|diff| "
                      f"{r['max_abs']:.2e} {'ok' if r['ok'] else 'FAIL'}", flush=True)
    return rows


def main() -> int:
    install_signal_handlers()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--latent", default="3,16,24", help="the CPU comparison's latent F,H,W (default 3,16,24)")
    ap.add_argument("--arch", default="wormhole_b0", choices=["wormhole_b0", "blackhole"])
    ap.add_argument("--skip-cpu", action="store_true")
    ap.add_argument("--skip-compile", action="store_true")
    ap.add_argument("--skip-check", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "results"))
    args = ap.parse_args()
    command = "python scripts/bench_vae.py " + " ".join(sys.argv[1:])
    date = datetime.date.today().isoformat()
    t0 = time.perf_counter()

    from wan_sharding.planner.stages import stage_table

    stages = stage_table(plan_runs=ROOT / "results")  # denoising: the compiled ranking where a plan run is kept
    for r in stages:
        s = r["stages"]
        print(f"stages {r['system']} {r['resolution']}: text encoder {s['text_encoder']['seconds']:.3f} s, denoising "
              f"{s['denoising']['seconds']:.0f} s, VAE {s['vae']['seconds']:.2f} s (tt-metal bounds "
              f"{r['tt_metal_bound_s']}, measured {r['tt_metal_measured_s']})", flush=True)
    host = {"machine": platform.machine(), "cpus": __import__("os").cpu_count(), "python": platform.python_version()}
    import docs_figures  # scripts/, beside this one: the pages quote these files

    # a re-run whose figures are the same leaves the file (and its date) as it was
    docs_figures.write_result(Path(args.out) / "stages.json",
                              {"command": command, "date": date, "host": host, "rows": stages})
    result = {"command": command, "date": date, "host": host, "arch": args.arch}
    if not args.skip_cpu:
        result["cpu"] = cpu_rows(args.latent, list(MESHES))
    if not args.skip_compile:
        result["compile"] = compile_rows(args.arch)
    if not args.skip_check:
        result["check"] = check_rows()
    result["seconds"] = round(time.perf_counter() - t0, 1)
    pages = Path(args.out).resolve() == ROOT / "results"  # the docs quote results/, not another --out

    if args.skip_cpu and args.skip_compile and args.skip_check:  # the stage table alone: vae.json stays as it was
        if pages:
            print("\n".join(docs_figures.update(["stages"])) or "docs/pipeline-stages.md unchanged")
        return 0
    previous = Path(args.out) / "vae.json"
    old = json.loads(previous.read_text()) if previous.exists() else {}
    for part in ("cpu", "compile", "check"):  # a part skipped keeps its last run, which says so
        if part not in result and part in old:
            result[part] = old[part]
            result.setdefault("carried_over", {})[part] = old.get("carried_over", {}).get(part, old.get("date"))
    docs_figures.write_result(previous, result)
    print(f"wrote {args.out}/vae.json and stages.json in {result['seconds']:.0f} s")
    if pages:
        print("\n".join(docs_figures.update(["stages", "vae-strategies", "vae-bills", "vae-check", "vae-cpu"]))
              or "docs/vae.md and docs/pipeline-stages.md unchanged")
    return 0


if __name__ == "__main__":
    sys.exit(main())
