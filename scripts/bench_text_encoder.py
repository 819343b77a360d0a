"""The text encoder stage side by side: on the host vs on a mesh (CPU), and its compiled bill.

Two parts, each printed as a table and written to ``results/text_encoder.json``:

1. **The stage on CPU** (``wan_sharding.jobs.text_encoder.stage_timing_in_subprocess``): a prompt
   pair (prompt, then the empty negative prompt, as the Wan pipelines encode them) through the tiny
   UMT5 encoder, unsharded as diffusers runs it (eager torch on the host) and sharded on 2x4 (jax: one
   compiled program; xla: traced lazily each call), at 16 tokens (the tiny pipelines') and 512 (the
   real pipelines'); warm medians. CPU virtual devices: it compares the two paths on this host; the
   eager host path pays Python per op, which a tiny model makes most of its time. No hardware figure.
2. **The compile-only bill** (``wan_sharding.compile.compile_reports``, tt-mlir through
   jax-tt-plugin, hardware's composites, argument marks and options): the tiny encoder and UMT5-XXL
   (d_model 4096, 64 heads, d_ff 10240, 512 tokens) on 1x4, 2x4 and 8x4, torchax with all 24 layers
   (abstract weights), torch-xla with 2 layers (real host weights: the replicated embedding once per
   virtual device, so on 2x4 and 8x4 with a smaller vocabulary, ``--vocab``, as the report says).

    python scripts/bench_text_encoder.py                  # both parts (~15 min on a 2-core host)
    python scripts/bench_text_encoder.py --no-compile     # the CPU stage only
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT))

from wan_sharding.compile import CompileRequest, compile_reports  # noqa: E402
from wan_sharding.jobs.text_encoder import stage_timing_in_subprocess  # noqa: E402
from wan_sharding.runtime.workers import atomic_write, install_signal_handlers  # noqa: E402

MESHES = ("1x4", "2x4", "8x4")
# torch-xla at full width: the vocabulary that keeps the trace within this host's memory per mesh
# ("full": the real 256384, ~14 GB of host memory on 1x4; CompileRequest.xla_host_bytes says what each needs)
XLA_VOCAB = "1x4=full,2x4=32768,8x4=8192"


def vocab_per_mesh(text: str) -> dict[str, int | None]:
    out = {}
    for item in text.split(","):
        mesh, _, vocab = item.partition("=")
        out[mesh] = None if vocab == "full" else int(vocab)
    return out


def requests(xla_vocab: dict[str, int | None]) -> list[CompileRequest]:
    te = dict(component="text-encoder")
    reqs = [CompileRequest(**te, size="tiny", mesh=m) for m in MESHES]
    reqs += [CompileRequest(**te, size="tiny", mesh="2x4", frontend="torch-xla")]
    reqs += [CompileRequest(**te, size="full", mesh=m) for m in MESHES]  # all 24 layers, 512 tokens
    reqs += [CompileRequest(**te, size="full", mesh=m, blocks=2, frontend="torch-xla", vocab=xla_vocab[m])
             for m in MESHES]
    return reqs


def label(r: CompileRequest | dict) -> str:
    """A compile row's key: size/frontend/mesh."""
    get = r.get if isinstance(r, dict) else lambda k: getattr(r, k)
    return f"{get('size')}/{get('frontend')}/{get('mesh')}"


def compile_row(r: dict) -> dict:
    row = {k: r.get(k) for k in ("mesh", "size", "blocks", "tokens", "frontend", "vocab", "ok", "bill_ok",
                                 "per_block", "per_forward_collectives", "runtime_ops_per_block",
                                 "const_eval_ops_per_block", "const_eval_ops", "design_reduce_bytes", "compile_seconds",
                                 "lower_seconds", "trace_seconds", "trace_rss_mb", "rss_mb", "composites_ttir",
                                 "argument_types", "notes", "error")}
    row["per_layer_entries"] = r.get("per_block_entries")
    row["sdpa_fused"] = (r.get("sdpa") or {}).get("count")
    return row


def timing_table(rows: list[dict]) -> str:
    out = ["| backend | mesh | prompt tokens | pair on the host (eager) | pair on the mesh (warm) | mesh / host | "
           "first pair on the mesh (compiles) | max-abs vs host |", "|" + "---|" * 8]
    for r in rows:
        out.append(f"| {r['backend']} | {r['mesh']} | {r['tokens']} | {r['pair_host_s'] * 1e3:.1f} ms | "
                   f"{r['pair_mesh_s'] * 1e3:.1f} ms | {r['mesh_over_host']:.2f} | {r['first_pair_mesh_s']:.2f} s | "
                   f"{r['max_abs']:.1e} |")
    return "\n".join(out)


def compile_table(rows: list[dict]) -> str:
    out = ["| model | frontend | mesh | layers | all-reduces per layer (bytes each) | once per forward | runtime ops "
           "per layer | const-eval ops | fused SDPA | bill | compile s |", "|" + "---|" * 11]
    for r in rows:
        model = ("UMT5-XXL" if r["size"] == "full" else "tiny") + (f", vocab {r['vocab']}" if r["vocab"] else "")
        if not r["ok"]:
            out.append(f"| {model} | {r['frontend']} | {r['mesh']} | {r['blocks']} | FAILED: {str(r['error'])[:80]} |"
                       + " |" * 6)
            continue
        ar = ", ".join(f"{e['count']:g} x {e['bytes'] / 2**20:.3g} MiB" if e["bytes"] >= 2**20 else
                       f"{e['count']:g} x {e['bytes'] / 2**10:.3g} KiB" for e in r["per_layer_entries"] or [])
        out.append(f"| {model} | {r['frontend']} | {r['mesh']} | {r['blocks']} | {ar} | "
                   f"{r['per_forward_collectives'] or 'none'} | {r['runtime_ops_per_block']:g} | {r['const_eval_ops']} | "
                   f"{r['sdpa_fused']} | {'OK' if r['bill_ok'] else 'DIFFERS'} | {r['compile_seconds']:.1f} |")
    return "\n".join(out)


def main() -> int:
    install_signal_handlers()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5, help="warm prompt pairs timed per configuration (default 5)")
    ap.add_argument("--no-compile", action="store_true", help="skip the compile-only bills")
    ap.add_argument("--no-timing", action="store_true", help="skip the CPU stage timing")
    ap.add_argument("--xla-vocab", default=XLA_VOCAB, type=vocab_per_mesh, metavar="MESH=N|full,...",
                    help=f"the vocabulary of each mesh's full-width torch-xla trace (default {XLA_VOCAB})")
    ap.add_argument("--only", default=None, metavar="TEXT",
                    help="compile only the rows whose label (size/frontend/mesh, e.g. full/torch-xla/8x4) contains TEXT; "
                         "their rows replace the same rows of the file")
    ap.add_argument("--out", default=str(ROOT / "results" / "text_encoder.json"))
    args = ap.parse_args()
    out = Path(args.out)
    data = json.loads(out.read_text()) if out.is_file() else {}
    data.update(host=platform.node(), python=platform.python_version())
    t0 = time.perf_counter()
    if not args.no_timing:
        rows = [r for backend in ("jax", "xla") for r in stage_timing_in_subprocess(backend, "2x4", repeats=args.repeats)]
        data["timing"] = {"command": " ".join(["python", "scripts/bench_text_encoder.py", *sys.argv[1:]]),
                          "date": time.strftime("%Y-%m-%d"), "rows": rows}
        print(timing_table(rows), flush=True)
    if not args.no_compile:
        reqs = [r for r in requests(args.xla_vocab) if args.only is None or args.only in label(r)]
        rows = [{**compile_row(r), "command": " ".join(["python", "scripts/bench_text_encoder.py", *sys.argv[1:]]),
                 "date": time.strftime("%Y-%m-%d")} for r in compile_reports(reqs, "wormhole_b0", timeout=7200)]
        kept = [r for r in (data.get("compile") or {}).get("rows", []) if args.only is not None
                and label(r) not in {label(x) for x in rows}]
        order = [label(x) for x in requests(args.xla_vocab)]
        rows = sorted(kept + rows, key=lambda r: order.index(label(r)))
        data["compile"] = {"arch": "wormhole_b0", "rows": rows}
        print(compile_table(rows), flush=True)
    data["seconds"] = round(time.perf_counter() - t0, 1)
    atomic_write(out, json.dumps(data, indent=1) + "\n")
    print(f"wrote {out} in {data['seconds']:.0f} s")
    if not args.no_timing and out.resolve() == ROOT / "results" / "text_encoder.json":  # the page quotes it
        import docs_figures  # scripts/, beside this one

        print("\n".join(docs_figures.update(["text-encoder-cpu"])) or "docs/pipeline-stages.md unchanged")
    return 0


if __name__ == "__main__":
    sys.exit(main())
