"""``wan-sharding``: the command line.

With no subcommand it runs the main job, ``check``: the embedded tiny Wan 2.2 DiT, sharded on
each mesh with each executing backend (CPU virtual devices), against the unsharded model.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, Callable

from .check import Case, run_in_subprocess
from .mesh import PRESET_MACHINES, PRESETS

DEFAULT_MESHES = ("1x4", "2x4", "8x4")


def _check(args: argparse.Namespace) -> int:
    cases = [Case(args.variant, length, args.dtype, args.padding) for length in args.lengths]
    rows: list[dict[str, Any]] = []
    failed = False
    start = time.perf_counter()
    for backend in args.backends:
        for mesh in args.meshes:
            for r in run_in_subprocess(backend, mesh, cases):
                threshold = 0.99999 if r["dtype"] == "fp32" else 0.99
                r["ok"] = r["pcc"] >= threshold
                failed |= not r["ok"]
                rows.append(r)
                if not args.json:
                    _print_row(r, header=len(rows) == 1)
    if args.json:
        print(json.dumps({"results": rows, "ok": not failed}, indent=1))
    else:
        print(f"\n{len(rows)} checks in {time.perf_counter() - start:.0f} s: "
              + ("all within PCC threshold (fp32 >= 0.99999, bf16 >= 0.99)" if not failed else "SOME FAILED"))
    return 1 if failed else 0


def _print_row(r: dict[str, Any], header: bool) -> None:
    if header:
        print(f"{'backend':7} {'mesh':5} {'variant':9} {'dtype':5} {'tokens':>11} {'padding':7} "
              f"{'PCC':>12} {'max|diff|':>9}  params col/row/norm/rep  SP points  collectives")
    p = r["params"]
    tokens = f"{r['tokens']}->{r['padded_tokens']}" if r["padded_tokens"] != r["tokens"] else str(r["tokens"])
    coll = ", ".join(f"{k} {v}" for k, v in (r.get("collectives") or {}).items()) or "-"
    print(f"{r['backend']:7} {r['mesh']:5} {r['variant']:9} {r['dtype']:5} {tokens:>11} {r['padding']:7} "
          f"{r['pcc']:12.9f} {r['max_abs']:9.2e}  {p['colwise']}/{p['rowwise']}/{p['norm_colwise']}/{p['replicate']:<14} "
          f"{r['sp_points']:^9}  {coll}{'' if r['ok'] else '  <-- FAIL'}", flush=True)


def _specs(args: argparse.Namespace) -> int:
    from .models import build_dit
    from .specs import shard_dit_specs

    dit = build_dit(args.variant, args.size, device="meta")
    specs = shard_dit_specs(dit, args.mesh)
    if args.json:
        print(json.dumps({"mesh": args.mesh, "variant": args.variant, "counts": specs.counts(),
                          "specs": {n: list(s) for n, s in specs.by_name().items()}}, indent=1))
    else:
        print(specs)
        print("counts:", specs.counts())
    return 0


def _meshes(args: argparse.Namespace) -> int:
    from .mesh import mesh_from_preset

    for name in PRESETS:
        m = mesh_from_preset(name)
        print(f"{name:4}  {PRESET_MACHINES[name]:24} devices {m.num_devices:2}  sp={m.sp} tp={m.tp}  "
              f"tokens padded to a multiple of {m.seq_multiple}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from .attention import PADDING_MODES
    from .plan import DEFAULT_PADDING
    from .models import VARIANTS

    ap = argparse.ArgumentParser(prog="wan-sharding", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command")

    check = sub.add_parser("check", help="PCC of the sharded tiny DiT vs unsharded (the default job)")
    check.add_argument("--meshes", nargs="+", default=list(DEFAULT_MESHES), choices=list(PRESETS))
    check.add_argument("--backends", nargs="+", default=["xla", "jax"], choices=["xla", "jax"])
    check.add_argument("--variant", default="t2v-a14b", choices=VARIANTS)
    check.add_argument("--lengths", nargs="+", default=["aligned", "padded"],
                       help="'aligned' (256 tokens), 'padded' (105 tokens) or a latent shape F,H,W")
    check.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    check.add_argument("--padding", default=DEFAULT_PADDING, choices=sorted(PADDING_MODES))
    check.add_argument("--json", action="store_true")
    check.set_defaults(func=_check)

    specs = sub.add_parser("specs", help="print the partition spec of every parameter")
    specs.add_argument("--mesh", default="8x4")
    specs.add_argument("--variant", default="t2v-a14b", choices=VARIANTS)
    specs.add_argument("--size", default="full", choices=["full", "tiny"])
    specs.add_argument("--json", action="store_true")
    specs.set_defaults(func=_specs)

    meshes = sub.add_parser("meshes", help="list the mesh presets")
    meshes.set_defaults(func=_meshes)

    for register in _extensions():
        register(sub)
    return ap


def _extensions() -> list[Callable[[Any], None]]:
    """Subcommands that live with their subsystem (compile, ...)."""
    import importlib
    import importlib.util

    modules = ["wan_sharding.compile.commands", "wan_sharding.pipeline_commands", "wan_sharding.planner.commands"]
    return [importlib.import_module(m).add_subcommands for m in modules if importlib.util.find_spec(m)]


def main(argv: list[str] | None = None) -> int:
    import os

    # This CLI only ever drives torch-xla on CPU virtual devices (in its worker processes); say so
    # up front instead of letting torch-xla warn about defaulting to it on import.
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    if not argv or argv[0].startswith("-") and argv[0] not in ("-h", "--help"):
        argv = ["check", *argv]
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
