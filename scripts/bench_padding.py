"""Side by side: what each padding mode costs in the compiled TTNN graph of the full DiT.

Full-size T2V-A14B (40 blocks, abstract weights, bf16) compiled through tt-mlir in compile-only
mode at 480p and 720p on 1x4, 2x4 and 8x4, for the unpadded graph, ``slice`` (K/V sliced back in
every block) and ``mask`` (one additive key mask per forward). Each configuration is also
compiled with 1 block: the difference of the two depths splits every op count into what one block
adds and what the forward adds once. Against the unpadded graph that gives the ops present only
because of padding, per block and per forward (deallocations not counted).

    .venv/bin/python scripts/bench_padding.py            # all 6 (resolution, mesh) pairs, ~20 min
    .venv/bin/python scripts/bench_padding.py --meshes 8x4 --resolutions 480p

Writes results/padding.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from wan_sharding.compile import CompileRequest, TTNNModule, bill_ok, compile_many, latent_for, per_block_bill
from wan_sharding.compile.bill import DATA_MOVEMENT_OPS, masked_attention_per_block, padding_cost, split_ops, tile_alignment
from wan_sharding.mesh import mesh_from_preset
from wan_sharding.runtime.workers import atomic_write

MODES = ("none", "slice", "mask")
DEPTHS = (1, 40)


def collective_bytes(module: TTNNModule) -> int:
    """Bytes per device the collectives of one graph produce (gathered / reduced results)."""
    return sum(c.bytes for c in module.collectives if c.kind != "mesh_partition")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--meshes", nargs="+", default=["1x4", "2x4", "8x4"])
    ap.add_argument("--resolutions", nargs="+", default=["480p", "720p"])
    ap.add_argument("--arch", default="wormhole_b0")
    ap.add_argument("--out", default="results/padding.json")
    args = ap.parse_args()

    start = time.perf_counter()
    requests = []
    for res in args.resolutions:
        for mesh in args.meshes:
            for mode in MODES:
                for depth in DEPTHS:
                    requests.append(CompileRequest(variant="t2v-a14b", mesh=mesh, latent=latent_for(res, None),
                                                   blocks=depth, size="full", padding=mode,
                                                   resolution=res).validate())
    results = compile_many(requests, args.arch, timeout=3 * 3600)
    by_key = {(r.request.resolution, r.request.mesh, r.request.padding, r.request.num_blocks): r for r in results}

    rows = []
    for res in args.resolutions:
        for mesh in args.meshes:
            mods = {}
            for mode in MODES:
                pair = [by_key[(res, mesh, mode, d)] for d in DEPTHS]
                mods[mode] = [TTNNModule.from_file(r.ttnn_path) if r.ok else None for r in pair]
            for mode in MODES:
                shallow, deep = mods[mode]
                r = by_key[(res, mesh, mode, DEPTHS[1])]
                row = {"resolution": res, "mesh": mesh, "padding": mode, "compiled": r.ok,
                       "tokens": r.tokens, "padded_tokens": r.padded_tokens,
                       "compile_seconds": r.compile_seconds}
                if not r.ok or shallow is None:
                    row["error"] = (r.error or "")[:300]
                    rows.append(row)
                    continue
                hist = deep.histogram()
                per_block, per_forward = split_ops(shallow, deep, *DEPTHS)
                m = mesh_from_preset(mesh)
                bill = per_block_bill(shallow, deep, *DEPTHS, m)
                row.update(
                    total_ops=sum(hist.values()),
                    ops={k: hist.get(k, 0) for k in ("slice_static", "pad", "concat", "mesh_partition",
                                                     "all_gather", "all_reduce")},
                    data_movement_ops=sum(hist.get(k, 0) for k in DATA_MOVEMENT_OPS),
                    per_block_ops_total=sum(per_block.values()), per_forward_ops_total=sum(per_forward.values()),
                    bill=bill.totals(), bill_ok=bill_ok(bill, m),
                    collective_bytes_per_device=collective_bytes(deep),
                    tile_aligned=tile_alignment(deep, m)["aligned"],
                )
                if mode != "none" and all(mods["none"]):
                    # The mask's add inside compile-only TTNN's decomposition of the fused SDPA is the
                    # fused op's operand on hardware: counted apart, as `wan-sharding compile` does.
                    ttir = [Path(p.ttir_path).read_text() for p in (by_key[(res, mesh, mode, d)] for d in DEPTHS)]
                    masks = masked_attention_per_block(*ttir, DEPTHS)
                    cost = padding_cost((shallow, deep), tuple(mods["none"]), DEPTHS, masks)
                    row.update(padding_ops_per_block=cost["per_block"], padding_ops_per_forward=cost["per_forward"],
                               padding_ops_in_fused_attention=cost["in_fused_attention"])
                rows.append(row)

    wall = time.perf_counter() - start
    atomic_write(args.out, json.dumps({
        "what": "full T2V-A14B, 40 blocks, bf16, fused SDPA, tt-mlir compile-only; per block / per forward from 1- vs 40-block graphs",
        "arch": args.arch, "command": " ".join(["scripts/bench_padding.py", *sys.argv[1:]]),
        "wall_seconds": round(wall, 1), "rows": rows}, indent=1) + "\n")

    fmt = lambda d: ", ".join(f"{k} {v:+g}" for k, v in d.items()) if d else "none"  # noqa: E731
    print("| res | mesh | padding | tokens | tile-aligned | slice_static | pad | data-movement ops | total ops "
          "| bill/block | collective GB/device | padding ops per block | in fused SDPA per block | padding ops per forward |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if not r["compiled"]:
            print(f"| {r['resolution']} | {r['mesh']} | {r['padding']} | {r['tokens']} | does not compile: "
                  f"{r.get('error', '')[:80]} ||||||||||")
            continue
        tokens = r["tokens"] if r["padded_tokens"] == r["tokens"] else f"{r['tokens']}->{r['padded_tokens']}"
        b = r["bill"]
        print(f"| {r['resolution']} | {r['mesh']} | {r['padding']} | {tokens} | {'yes' if r['tile_aligned'] else 'NO'} "
              f"| {r['ops']['slice_static']} | {r['ops']['pad']} | {r['data_movement_ops']} | {r['total_ops']} "
              f"| {b['large']:g}+{b['small']:g} | {r['collective_bytes_per_device'] / 1e9:.2f} "
              f"| {fmt(r.get('padding_ops_per_block')) if r['padding'] != 'none' else '-'} "
              f"| {fmt(r.get('padding_ops_in_fused_attention')) if r['padding'] != 'none' else '-'} "
              f"| {fmt(r.get('padding_ops_per_forward')) if r['padding'] != 'none' else '-'} |")
    print(f"\n{len(requests)} compiles in {wall:.0f} s; results in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
