"""What tt-mlir makes of each way to hand a shard its neighbours' boundary rows, side by side.

The VAE's halo (``wan_sharding/vae/halo.py``) all-gathers every shard's boundary rows over a whole
mesh axis, so on an 8-long axis each chip receives 8 shards' rows where it needs its 2 neighbours'.
This compiles, through jax-tt-plugin in compile-only mode on an 8x4 Wormhole descriptor, one small
program per candidate (a ``(512, 128, 256)`` bf16 tensor split 8 ways on its first dim, the
exchange over the 8-long axis ``sp``) and reads the collectives of the TTNN module it emits:

- ``all_gather_axis``: the package's form: an all-gather over the whole axis, then a local pick.
- ``all_gather_pairs``: an all-gather over pairs of neighbours only (``axis_index_groups``).
- ``all_reduce_pairs``: a sum over the other pairs of neighbours (the shifted pairing).
- ``sub_axis_mesh``: the 8-long axis as two axes (4 x 2), an all-gather over the 2.
- ``collective_permute``: the one-shard shift itself (``ppermute``).
- ``all_to_all``: an all-to-all over the axis.

    python scripts/probe_halo_collectives.py        # ~1 min; writes results/halo_collectives.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT))

from wan_sharding.runtime.workers import atomic_write, install_signal_handlers  # noqa: E402

SHAPE = (8 * 64, 128, 256)  # split 8 ways on dim 0 (the shard dim), 4 ways on dim 1


def _candidates():
    """(name, function, mesh axes) for each candidate; run in the worker (JAX on the tt plugin)."""
    import jax
    import jax.numpy as jnp
    from jax.experimental.shard_map import shard_map
    from jax.sharding import PartitionSpec as P

    split = P("sp", "tp")

    def manual(body):
        return lambda mesh: shard_map(body, mesh=mesh, in_specs=split, out_specs=split, check_rep=False)

    def all_gather_axis(mesh):
        from jax.sharding import NamedSharding

        def run(a):
            a = jax.lax.with_sharding_constraint(a, NamedSharding(mesh, split))
            rows = jax.lax.with_sharding_constraint(a[:, :, :1], NamedSharding(mesh, P(None, "tp")))  # gathered
            # shard p picks shard p-1's rows from the gathered copy with a constant 0/1 selection, as
            # vae/halo.py does (a shift written as a concatenate or a roll becomes point-to-point)
            pick = jnp.eye(8, k=-1, dtype=a.dtype)[:, :, None, None, None]
            prev = (pick * rows.reshape(1, 8, 64, 128, 1)).sum(1).reshape(rows.shape)
            return jax.lax.with_sharding_constraint(a + prev, NamedSharding(mesh, split))
        return run

    pairs = [[0, 1], [2, 3], [4, 5], [6, 7]]
    shifted = [[1, 2], [3, 4], [5, 6], [7, 0]]
    return [
        ("all_gather_axis", all_gather_axis, ("sp", "tp")),
        ("all_gather_pairs", manual(lambda b: jax.lax.all_gather(b, "sp", axis_index_groups=pairs, tiled=True)[:64]),
         ("sp", "tp")),
        ("all_reduce_pairs", manual(lambda b: jax.lax.psum(b, "sp", axis_index_groups=shifted)), ("sp", "tp")),
        ("sub_axis_mesh", "sub_axis", ("hi", "lo", "tp")),
        ("collective_permute", manual(lambda b: jax.lax.ppermute(b, "sp", [(i, i + 1) for i in range(7)])),
         ("sp", "tp")),
        ("all_to_all", manual(lambda b: jax.lax.all_to_all(b, "sp", 0, 0, tiled=True)), ("sp", "tp")),
    ]


def worker(out: Path) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from wan_sharding.compile.bill import collective_table
    from wan_sharding.compile.ttnn_ir import TTNNModule
    from wan_sharding.mesh import mesh_from_preset

    devices = np.array(jax.devices()[:32])
    rows = []
    for name, make, axes in _candidates():
        mesh = Mesh(devices.reshape((4, 2, 4) if len(axes) == 3 else (8, 4)), axes)
        if make == "sub_axis":
            def fn(a, mesh=mesh):
                a = jax.lax.with_sharding_constraint(a, NamedSharding(mesh, P(("hi", "lo"), "tp")))
                return jax.lax.with_sharding_constraint(a * 2, NamedSharding(mesh, P("hi", "tp")))
        else:
            fn = make(mesh)
        x = jax.ShapeDtypeStruct(SHAPE, jnp.bfloat16, sharding=NamedSharding(mesh, P(axes[0] if len(axes) == 2
                                                                                       else ("hi", "lo"), "tp")))
        export = out / name
        export.mkdir(parents=True, exist_ok=True)
        row = {"candidate": name}
        try:
            jax.jit(fn).lower(x).compile(compiler_options={"export_path": str(export)})
            ttnn = sorted((export / "irs").glob("ttnn_[0-9]*.mlir"))
            table = collective_table(TTNNModule.from_file(ttnn[-1]), mesh_from_preset("8x4"))
            row.update(ok=True, collectives=[{k: c[k] for k in ("kind", "axis", "count", "payload", "result")}
                                             for c in table if c["kind"] != "mesh_partition"])
        except Exception as e:  # tt-mlir's refusal, as the plugin raises it
            row.update(ok=False, error=f"{type(e).__name__}: {e}".split("\n")[0][:400])
        rows.append(row)
    (out / "rows.json").write_text(json.dumps(rows))


def main() -> int:
    install_signal_handlers()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=str(ROOT / "results"))
    args = ap.parse_args()
    if args.worker:
        worker(Path(args.worker))
        return 0
    from wan_sharding.compile.runner import check_plugin, prepare_descriptor, private_tmpdir, remove_assets, worker_env

    version = check_plugin()
    with tempfile.TemporaryDirectory(prefix="wan_halo_probe_") as work:
        desc = prepare_descriptor("wormhole_b0", 32, work)
        tmp = private_tmpdir(work)
        try:
            proc = subprocess.run([sys.executable, __file__, "--worker", str(Path(work) / "out")],
                                  env=worker_env(desc, tmp), capture_output=True, text=True, timeout=1800)
        finally:
            remove_assets(tmp)
        if proc.returncode:
            raise SystemExit(f"the probe's worker failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        rows = json.loads((Path(work) / "out" / "rows.json").read_text())
    for r in rows:
        what = (", ".join(f"{c['kind']} x{c['count']} on {c['axis']} ({c['payload']} -> {c['result']})"
                          for c in r["collectives"]) or "no collective") if r["ok"] else "refused: " + r["error"]
        print(f"{r['candidate']:20} {what}")
    result = {"command": "python scripts/probe_halo_collectives.py " + " ".join(sys.argv[1:]),
              "date": datetime.date.today().isoformat(), "plugin": version, "mesh": "8x4", "arch": "wormhole_b0",
              "shape": list(SHAPE), "rows": rows}
    atomic_write(Path(args.out) / "halo_collectives.json", json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}/halo_collectives.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
