"""The VAE's side of the commands: ``check --component vae``, ``compile --component vae`` and the
``--vae mesh|host`` option of ``generate``, ``serve`` and ``check`` (arguments and printing only).

``--vae`` defaults per backend (:func:`wan_sharding.options.vae_placement`): ``mesh`` on ``tt``, where the sharded decode
is what turns minutes of host decode after denoising into seconds; ``host`` on the CPU backends,
where a host decode is the reference itself and the mesh's virtual devices share the same cores,
so a sharded decode only adds the halo work and collectives to the same CPU time.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable

from ..models import VAE_KINDS
from ..options import VAE_PLACEMENTS
from .args import stack_missing
from .validate import UsageError

# check --component vae: each mesh's cases (latent F,H,W: 3 frames, so the time cache is carried
# over two steps; 5x8 is a frame 2 and 8 do not divide, padded and masked).
CHECK_CASES = ("{vae}:decode:3,5,8:{dtype}", "{vae}:decode:3,8,8:{dtype}", "{vae}:encode:2,5,8:{dtype}")


def add_vae_placement(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--vae", default=None, choices=list(VAE_PLACEMENTS),
                    help="where the VAE runs: mesh (sharded over H and W) or host (default: mesh on tt, host on the "
                         "CPU backends, where the virtual devices share the host's cores)")


def check_vae_frame(args: argparse.Namespace) -> None:
    """``generate`` / ``serve --vae mesh --padding none``: the video's latent frame (``--height`` x
    ``--width``, or the pipeline's defaults) must split over the mesh one way round, as the VAE
    then refuses to pad it; refused here, before any worker starts."""
    if getattr(args, "vae", None) != "mesh" or getattr(args, "padding", None) != "none":
        return
    from ..jobs.requests import read_json_file
    from ..mesh import mesh_from_preset
    from ..pipeline.tiny import VARIANT_PIPELINES
    from ..specs import ShardingError
    from ..vae.layout import plan_frame

    if args.model is None:
        spec = VARIANT_PIPELINES[args.variant]
        spatial, (_, height, width) = (16 if spec.vae == "wan2.2" else 8), spec.size
    else:
        config = read_json_file(Path(args.model) / "vae" / "config.json", required=False) or {}
        spatial, height, width = int(config.get("scale_factor_spatial") or 8), 480, 832
    height, width = args.height or height, args.width or width
    plan = getattr(args, "plan", None)
    mesh = plan.mesh() if plan is not None else mesh_from_preset(args.mesh)
    try:
        plan_frame(height // spatial, width // spatial, mesh, "none", 1, "latent frame")
    except ShardingError:
        raise UsageError(f"--padding none --vae mesh: the {height // spatial}x{width // spatial} latent frame of a "
                         f"{height}x{width} video does not split evenly over mesh {mesh.name} either way round, and "
                         "--padding none refuses to pad it; use --padding mask (the VAE pads and masks the frame, "
                         "exactly) or a height and width whose latent the mesh divides") from None


# ---- check --component vae ----------------------------------------------------------------------


def check_vae_request(args: argparse.Namespace) -> None:
    """``check --component vae``: no DiT-only option."""
    if args.plan is not None or args.cfg == 2 or args.patches or args.padding not in (None, "mask"):
        raise UsageError("--plan, --cfg, --patches and --padding are DiT options; with --component vae give "
                         "--meshes, --backends, --dtype and --vae-kind")
    if args.rank_binding or args.hosts or args.hostfile or args.dry_run:
        raise UsageError("--rank-binding, --hosts, --hostfile and --dry-run launch the DiT's check over several hosts; "
                         "the VAE's check runs on one host: leave them out with --component vae")


def check_vae(args: argparse.Namespace, echo: bool | None = None) -> int:
    """The VAE's PCC matrix: both VAEs (or ``--vae-kind``), decode and encode, on each mesh and backend.
    ``echo``: print the rows (default: unless ``--json``); the JSON document is printed only when
    the VAE is the command's component."""
    from ..jobs.pcc import PCC_THRESHOLDS, grade
    from ..jobs.vae_check import VaeCase, run_meshes

    if stack_missing(args.backends):
        return 1
    kinds = [args.vae_kind] if getattr(args, "vae_kind", None) else list(VAE_KINDS)
    cases = [VaeCase.parse(c.format(vae=k, dtype=args.dtype)) for k in kinds for c in CHECK_CASES]
    echo = not args.json if echo is None else echo
    rows: list[dict[str, Any]] = []
    failed = False
    start = time.perf_counter()
    meshes = list(args.meshes or ("1x4", "2x4", "8x4"))
    for backend in args.backends:
        for group in ([meshes] if backend == "jax" else [[m] for m in meshes]):  # jax: one worker for all
            for r in run_meshes(backend, {m: cases for m in group}):
                failed |= not r["ok"]
                rows.append(r)
                if echo:
                    print_row(r, header=len(rows) == 1)
    if not echo:
        if args.component == "vae":
            print(json.dumps({"results": rows, "ok": not failed}, indent=1))
    else:
        limits = "; ".join(f"{d} {grade('jax', d)}" for d in PCC_THRESHOLDS)
        print(f"\n{len(rows)} VAE checks in {time.perf_counter() - start:.0f} s: "
              + (f"all within bounds ({limits})" if not failed else "SOME FAILED"))
    return 1 if failed else 0


def print_row(r: dict[str, Any], header: bool) -> None:
    if header:
        print(f"{'backend':7} {'mesh':5} {'vae':6} {'part':6} {'dtype':5} {'latent':>7} {'frame':>11} "
              f"{'PCC':>12} {'max|diff|':>9}  split                  halo convs")
    frame = "x".join(map(str, r["frame"]))
    if r["padded"] != r["frame"]:
        frame += "->" + "x".join(map(str, r["padded"]))
    print(f"{r['backend']:7} {r['mesh']:5} {r['vae']:6} {r['part']:6} {r['dtype']:5} {r['latent']:>7} {frame:>11} "
          f"{r['pcc']:12.9f} {r['max_abs']:9.2e}  {r['split']:22} {r['halo_modules']}"
          f"{'' if r['ok'] else '  <-- FAIL'}", flush=True)


# ---- compile --component vae --------------------------------------------------------------------

COMPILE_STRATEGIES = ("halo", "halo-permute", "annotate", "channels")


def check_vae_compile(args: argparse.Namespace) -> None:
    """``compile --component vae``: a resolution the VAE's compile knows, no DiT-only option."""
    from ..compile.vae import PIXELS

    if args.resolution not in PIXELS:
        raise UsageError(f"--resolution {args.resolution} with --component vae: choose {' or '.join(PIXELS)}")
    if (args.latent is not None or args.plan is not None or args.cfg == 2 or args.patches or args.rank_binding
            or args.variant is not None or args.blocks is not None):
        raise UsageError("--latent, --plan, --cfg, --patches, --rank-binding, --variant and --blocks are DiT options; "
                         "with --component vae give --mesh, --resolution, --frontend, --vae-kind, --strategy and --step")
    if args.tokens is not None or args.vocab is not None:
        raise UsageError("--tokens and --vocab are the text encoder's; with --component vae give --mesh, --resolution, "
                         "--frontend, --vae-kind, --strategy and --step")


def compile_vae(args: argparse.Namespace, out: Path, prune: Callable[[dict[str, Any]], int]) -> int:
    """tt-mlir compile-only of one decode step of the real VAE; with ``--strategy all`` the package's
    halo beside its alternatives, bill by bill. The report and the IRs it names go to ``out``;
    ``prune(cited)`` removes the rest (unless ``--keep-irs``) and returns the bytes freed."""
    from ..compile import CompileError
    from ..compile.vae import STEPS, VaeCompileRequest, compile_vae as run
    from ..options import settings_line
    from ..runtime.workers import atomic_write

    strategy = args.strategy or "halo"
    strategies = list(COMPILE_STRATEGIES) if strategy == "all" else [strategy]
    steps = list(STEPS) if (args.step or "all") == "all" else [args.step]
    kind = args.vae_kind or "wan2.1"
    reqs = [VaeCompileRequest(kind=kind, mesh=args.mesh, resolution=args.resolution, strategy=s, dtype=args.dtype,
                              frontend=args.frontend, step=step, size=args.size) for step in steps for s in strategies]
    t0 = time.perf_counter()
    try:
        reports = run(reqs, args.arch, timeout=args.timeout, keep_irs=str(out / "irs"))
    except CompileError as e:
        print(f"wan-sharding {args.command}: error: {e}", file=sys.stderr)
        return 2
    report = {"component": "vae", "reports": reports, "wall_seconds": round(time.perf_counter() - t0, 2),
              **vae_outcome(reports, strategies[0])}
    if not args.keep_irs:  # the TTNN IR each report names stays; the other dumps go
        cited = {f"{i}_{k}": v for i, r in enumerate(reports) for k, v in r.items() if k.endswith("_path")}
        report["removed_bytes"] = prune(cited)
    report["report_path"] = str(out / "report.json")
    atomic_write(out / "report.json", json.dumps(report, indent=1))
    if args.json:
        print(json.dumps(report))
    else:
        print(settings_line(f"tt-mlir compile-only ({args.frontend} frontend)", (), None))
        for step in steps:
            print(format_vae_reports([r for r in reports if r["request"]["step"] == step]))
        print(f"report: {report['report_path']}, with " + ("every IR (--keep-irs)" if args.keep_irs
                                                            else "the IRs it names (--keep-irs: every one)"))
        print(f"(wall time with process start-up: {report['wall_seconds']:.0f} s)")
    if report["error"]:
        print(f"wan-sharding {args.command}: error: {report['error']}", file=sys.stderr)
    return 0 if report["ok"] and report["bill_ok"] else 1


def vae_outcome(reports: list[dict[str, Any]], billed: str) -> dict[str, Any]:
    """What a ``compile --component vae`` run amounts to: ``ok`` and ``bill_ok`` are the ``billed``
    strategy's (the one asked for; ``halo`` with ``--strategy all``); the alternatives it is compared
    with may be refused by tt-mlir, which is a finding (a row of ``refused``, with its reason cut at
    whole clauses), not a failure of the command. ``error``: the one line to print when the billed
    strategy itself was refused (exit 1), else ``None``."""
    from ..compile.vae import refusal

    own = [r for r in reports if r["request"]["strategy"] == billed]
    refused = [{"strategy": r["request"]["strategy"], "step": r["request"]["step"], "reason": refusal(r.get("error"))}
               for r in reports if not r.get("ok")]
    failed = [r for r in refused if r["strategy"] == billed]
    error = (f"tt-mlir refused the {billed} strategy's {', '.join(r['step'] for r in failed)} step: "
             f"{failed[0]['reason']}" if failed else None)
    return {"ok": not failed, "bill_ok": all(r.get("bill_ok", False) for r in own), "refused": refused, "error": error}


def format_vae_reports(reports: list[dict[str, Any]]) -> str:
    """One line per strategy of one decode step: the bill's figures side by side, then each refusal."""
    from ..compile.ttnn_ir import format_bytes
    from ..compile.vae import refusal

    lines = [f"{'strategy':13} {'ok':3} {'collectives':>11} {'largest':>10} {'frame limit':>11} {'halo bytes':>10} "
             f"{'neighbours':>10} {'ratio':>5} {'all bytes':>10} {'runtime ops':>11}  bill"]
    for r in reports:
        req = r["request"]
        if not r.get("ok"):
            lines.append(f"{req['strategy']:13} no  tt-mlir refused it: {refusal(r.get('error'))}")
            continue
        n, ratio = r["collective_count"], r.get("halo_ratio")
        lines.append(f"{req['strategy']:13} yes {n:>11} {format_bytes(r['largest_collective_bytes']):>10} "
                     f"{format_bytes(r['frame_limit_bytes']):>11} {format_bytes(r['halo_bytes']):>10} "
                     f"{format_bytes(r['halo_neighbour_bytes']):>10} {'-' if ratio is None else f'{ratio:.1f}x':>5} "
                     f"{format_bytes(r['collective_bytes']):>10} {r['runtime_ops']:>11}  "
                     f"{'ok' if r['bill_ok'] else 'OVER: ' + '; '.join(r['bill_problems'][:2])}")
    head = reports[0]["request"]
    which = {"first": "the first latent frame's", "second": "the second latent frame's, its cache one frame",
             "steady": "the one every latent frame from the third reuses"}
    split = next((r["frame_split"] for r in reports if r.get("frame_split")), None)
    return (f"VAE {head['kind']} decode step ({which[head.get('step', 'first')]}) at {head['resolution']} on "
            f"{head['mesh']} ({head['dtype']}, {head['frontend']} frontend{', ' + split if split else ''}):\n"
            + "\n".join(lines))


def add_vae_compile_args(c: argparse.ArgumentParser) -> None:
    c.add_argument("--vae-kind", choices=list(VAE_KINDS), default=None,
                   help="with --component vae: wan2.1 (A14B's VAE, default) or wan2.2 (TI2V-5B's)")
    c.add_argument("--strategy", choices=[*COMPILE_STRATEGIES, "all"], default=None,
                   help="with --component vae: the package's halo (default), an alternative, or all side by side")
    c.add_argument("--step", choices=["first", "second", "steady", "all"], default=None,
                   help="with --component vae: the decode step compiled: first (the first latent frame's program), "
                        "second (the second's: a cache of one frame), steady (the one every frame from the third "
                        "reuses: a full cache), or all (default: the three a decode of 3 latent frames or more runs)")
