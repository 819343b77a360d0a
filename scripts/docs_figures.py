"""The docs' figures from ``results/*.json``: each quoted table is generated, never typed.

A page holds a figure block between two marks,

    <!-- figures:NAME (generated from results/...json by scripts/docs_figures.py) -->
    ...
    <!-- /figures:NAME -->

and :data:`BLOCKS` says which page and which function renders it from the results. The scripts
that write a result rewrite its blocks when they finish (:func:`update`), and
``tests/test_docs.py`` renders every block again and fails on any difference (:func:`stale`), so
an edited figure, or a re-run that left a page behind, is caught.

    python scripts/docs_figures.py            # rewrite every block from results/
    python scripts/docs_figures.py --check    # exit 1 naming the blocks that differ
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

ROOT = Path(__file__).resolve().parents[1]
MARK = re.compile(r"^<!-- figures:(?P<name>[\w-]+) (?P<note>[^\n]*?)-->\n(?P<body>.*?)^<!-- /figures:(?P=name) -->$",
                  re.M | re.S)


def _load(root: Path, name: str) -> dict:
    return json.loads((root / "results" / name).read_text())


def _date(data: dict) -> str:
    return str(data.get("date", "date not recorded"))[:10]


# ------------------------------------------------------------------------------- the planner


PLAN_RUNS = (("8x4", "wormhole_b0"), ("2x4", "wormhole_b0"), ("2x4", "blackhole"), ("8x4", "blackhole"))
CHIP_NAMES = {"wormhole_b0": "Wormhole", "blackhole": "Blackhole"}


def plan_words(c: dict) -> str:
    """A planner candidate in words: ``SP 8 (rows) / TP 4 (cols), FSDP, replicated D, mask``."""
    axes = c["mesh_axes"]
    roles = [f"{role.upper()} {c[role]} ({'+'.join(axes[role])})" for role in ("sp", "tp") if c[role] > 1]
    extra = (["FSDP"] if c["fsdp"] else []) + [f"{c['layout']} D"] + ([c["padding"]] if c["padding"] != "none" else [])
    return ", ".join([" / ".join(roles) or "no split", *extra])


def _recipe_layout(c: dict) -> bool:
    # tt-xla's recipe: SP over the rows, TP over the columns (docs/design.md)
    return c["mesh_axes"]["sp"] == ["rows"] and c["mesh_axes"]["tp"] == ["cols"]


def _compiled(run: dict) -> list[dict]:
    """A planner run's plans costed from their compiled programs, best first."""
    return sorted((c for c in run["candidates"] if c["stage"] == "compiled"
                   and c.get("estimated_seconds_per_forward") is not None), key=lambda c: c["rank"])


def plan_480p(root: Path) -> str:
    runs = {(m, a): _load(root, f"plan_{m}_{a}_480p.json") for m, a in PLAN_RUNS}
    first = runs[PLAN_RUNS[0]]
    n = first["counts"]
    lines = [
        f"Measured on this 2-core machine ({_date(first)}, `scripts/bench_plan.py --with-plans`, compile-only "
        f"tt-mlir): the full 8x4 Wormhole plan at 480p takes {first['wall_seconds']:.0f} s ({n['enumerated']} "
        f"plans, {n['legal']} legal, {n['compiled']} compiled, {n['compiled_ok']} accepted by tt-mlir). What it "
        "recommends at 480p (`wan-sharding plan --mesh 8x4 --arch wormhole_b0 --resolution 480p --json` and the "
        "same for each mesh and chip below, kept in `results/plan_*_480p.json`), the next best plan, and where "
        "tt-xla's own layout (SP over the rows, TP over the columns) ranks:",
        "",
        "| mesh, chip | recommended | GB per chip | est. s per forward | next best | tt-xla's layout |",
        "|---|---|---|---|---|---|",
    ]
    for (mesh, arch), d in runs.items():
        ranked = _compiled(d)
        rec, nxt = ranked[0], (ranked[1] if len(ranked) > 1 else None)
        assert rec["name"] == d["recommended"]["name"], "the best compiled plan is the recommendation"
        recipe = next((c for c in ranked if _recipe_layout(c)), None)
        nxt_text = "-" if nxt is None else (f"{plan_words(nxt)}: {nxt['estimated_seconds_per_forward']:.2f} s "
                                            f"({nxt['why_lost']})")
        recipe_text = ("not compiled" if recipe is None else "recommended" if recipe is rec
                       else f"#{recipe['rank']}, {plan_words(recipe)}: {recipe['estimated_seconds_per_forward']:.2f} s")
        lines.append(f"| {mesh} {CHIP_NAMES[arch]} | {plan_words(rec)} | {rec['memory_per_chip_gb']:.2f} of "
                     f"{d['chip']['dram_gb']:g} | {rec['estimated_seconds_per_forward']:.2f} | {nxt_text} | "
                     f"{recipe_text} |")
    return "\n".join(lines)


def plan_cfg_split(root: Path) -> str:
    d = _load(root, "plan_8x4_wormhole_b0_480p_cfg-split.json")
    compiled = _compiled(d)
    split = next(c for c in compiled if c.get("cfg_split"))
    whole = next(c for c in compiled if not c.get("cfg_split"))
    best, other = (split, whole) if split["rank"] < whole["rank"] else (whole, split)
    gap = 100 * (other["estimated_seconds_per_forward"] / best["estimated_seconds_per_forward"] - 1)
    what = lambda c: (f"{plan_words(c)} on each half (a CFG split)" if c.get("cfg_split")  # noqa: E731
                      else f"the whole mesh as {plan_words(c)}")
    return (f"These rank whole-mesh plans (the default; `scripts/bench_plan.py` runs them so). With the CFG splits "
            f"of the next section (`--cfg-split`; `results/plan_8x4_wormhole_b0_480p_cfg-split.json`, "
            f"{_date(d)}, {d['wall_seconds']:.0f} s), the 8x4 Wormhole plan puts {what(best)} first at "
            f"{best['estimated_seconds_per_forward']:.2f} s per forward, then {what(other)} at "
            f"{other['estimated_seconds_per_forward']:.2f} s (+{gap:.1f} %).")


def plan_model(root: Path) -> str:
    d = _load(root, "plan.json")
    p = d["primary"]
    slower = sorted((p["measured_over_predicted_1x4"], p["measured_over_predicted_2x4"]))
    return (f"**Honest error**: against the one hardware measurement of this path (`docs/hardware-facts.md`: 1x4 TP-only "
            f"~{d['reference']['1x4_seconds']:g} s vs 2x4 TP+SP ~{d['reference']['2x4_seconds']:g} s, ratio "
            f"{d['reference']['ratio']:.2f}) the model predicts {p['predicted_1x4_s']:.1f} s vs "
            f"{p['predicted_2x4_s']:.1f} s, a ratio of {p['predicted_ratio']:.2f} ({p['ratio_error_pct']:+.1f} %); "
            f"its absolute times are ~{slower[0]:.1f}-{slower[1]:.1f}x faster than the hardware's, so use it to "
            f"rank plans, not to quote seconds (`.venv/bin/python scripts/bench_plan.py`, run {_date(d)}, "
            f"{d['wall_seconds']:.0f} s, `results/plan.json`).")


# ------------------------------------------------------------------------------- check, profile, serve


def fuzz(root: Path) -> str:
    d = _load(root, "fuzz.json")
    tokens = d["coverage"]["tokens"]
    case = d["worst_case"].split(":")
    return (f"Last full run ({_date(d)}): `{d['command']}`, {d['cases']} cases in {d['seconds']:.0f} s on this "
            f"shared 2-core host, **{d['mismatches']} mismatches**, worst max-abs {d['worst_max_abs']:.2e} "
            f"({case[0]}, {case[1]}, {case[3]} padding), lowest PCC {d['min_pcc']:.14f}; {tokens['aligned']} "
            f"aligned, {tokens['unaligned, > 2']} unaligned and {tokens['1-2']} one- or two-token cases "
            "(`results/fuzz.json`).")


def profile(root: Path) -> str:
    d = _load(root, "profile.json")
    r0 = d["results"][0]
    padded = max(r["padded_tokens"] for r in d["results"])
    lines = [f"Side by side (`.venv/bin/{d['command']}`, run {_date(d)}, {d['seconds']:.0f} s, `results/profile.json`; "
             f"tiny DiT, {r0['tokens']} tokens padded to {padded}, CPU virtual devices: compares configurations, "
             "does not predict hardware):", "",
             "| backend | what | config | median s | x unsharded | x slice |", "|---|---|---|---|---|---|"]
    for r in d["results"]:
        config = r["mesh"] if r["mesh"] == "unsharded" else f"{r['mesh']} {r['padding']}"
        vs_slice = "" if r.get("vs_slice") is None else f"{r['vs_slice']:.2f}"
        lines.append(f"| {r['backend']} | {r['what']} | {config} | {r['median_s']:.4f} | {r['vs_unsharded']:.2f} | "
                     f"{vs_slice} |")
    return "\n".join(lines)


def serve(root: Path) -> str:
    d = _load(root, "serve.json")
    s, load, fault, tp = d["setup"], d["load"], d["fault"], d["throughput"]
    runs = lambda xs: ", ".join(f"{x:.2f}" for x in xs)  # noqa: E731
    lines = [
        f"`{d['command'].strip()}`, {d['date']}, on this project's 2-core CPU machine (load average "
        f"{s['load_average_start']} at the start, {s['load_average_end']} at the end), so N is kept small: "
        f"**{s['n']} requests each**. The {s['pipeline']}, {s['backend']} backend, {s['mesh']} CPU mesh, "
        f"`generate`'s default request ({s['request'].split(' (')[0]}), {s['video']} videos. Latency: a standalone "
        "run is one `wan-sharding generate` process, start to exit; a resident request is POST to video "
        f"downloaded, on a server already warm (its own start: {d['server_ready_seconds']:.1f} s).",
        "",
        "| | p50 s | p95 s | runs (s) |", "|---|---|---|---|",
        f"| standalone `generate` (a new process each) | {d['p50']['standalone']:.2f} | {d['p95']['standalone']:.2f} "
        f"| {runs(d['standalone_seconds'])} |",
        f"| resident `serve` (warm) | {d['p50']['resident']:.2f} | {d['p95']['resident']:.2f} | "
        f"{runs(d['resident_seconds'])} |",
        f"| **ratio, standalone / resident (p50)** | **{d['ratio_p50']}x** | | |",
        "",
        f"The server's videos were byte-identical to `generate`'s: {str(d['resident_identical_to_generate']).lower()}.",
        "",
        "| load run | clients | `--queue` | accepted | rejected (429) | completed | lost |", "|---|---|---|---|---|---|---|",
        f"| all at once, one request each | {load['clients']} | {load['queue']} | {load['accepted']} | "
        f"{load['rejected_429']} | {load['completed']} | **{load['lost']}** |",
        "",
        "| fault run: worker SIGKILLed mid-job | |", "|---|---|",
        f"| the job | `{fault['job_status']}`, `{fault['job_error']['code']}`: {fault['job_error']['message']} |",
        f"| seconds from the kill to the job's error | {fault['seconds_to_error']:.2f} |",
        f"| seconds from the kill to `/health` 200 again | {fault['seconds_to_ready']:.2f} (a new process: imports, "
        "build, shard, warm-up) |",
        f"| the same request after, byte-identical | {str(fault['byte_identical_after']).lower()} |",
        "",
        f"Throughput: {tp['runs'][0]['jobs']} requests posted at once to a warm server, from the first POST to the "
        f"last job completed, on {tp['mesh']}, the same settings, one run each:",
        "",
        "| | seconds | requests / min | jobs per worker |", "|---|---|---|---|",
    ]
    for r in tp["runs"]:
        what = "1 worker" if r["replicas"] == 1 else f"{r['replicas']} replicas"
        lines.append(f"| {what} | {r['seconds']:.2f} | {r['requests_per_minute']:.1f} | "
                     f"{', '.join(map(str, r['jobs_per_worker']))} |")
    lines.append(f"| **ratio, 2 replicas / 1** | | **{tp['ratio_2_over_1']}x** | |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------- a block's ops by cause


def _script(name: str):
    """A sibling script as a module: ``bench_hardware`` owns the cause table's rows and tt-metal's column."""
    import importlib.util

    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def causes(root: Path) -> str:
    bench = _script("bench_hardware")
    rows = _load(root, "hardware.json")["rows"]
    lines = ["Runtime ops per block by cause (`results/hardware.json`; T2V-A14B full width, 480p, padding none, "
             "arguments marked, hardware's composites and options), each column with its run:", ""]
    lines += [f"- {bench.short_label(r)}: `{r.get('command', '?')}` ({r.get('date', '?')}), patches "
              f"{' '.join(r['patches']) or 'none'}" for r in bench.cause_rows(rows)]
    return "\n".join(lines) + "\n\n" + bench.causes_markdown(rows)


# ------------------------------------------------------------------------------- the VAE and the stages


def serve_load(root: Path) -> str:
    d = _load(root, "serve_load.json")
    o, f, st = d["outcomes"], d["fault"], d["settings"]
    during = ", ".join(f"{n}x {k}" for k, n in sorted(f["health_during"].items()))
    codes = ", ".join(f"{c} {n}" for c, n in sorted(d["failed_codes"].items())) or "none"
    return "\n".join([
        f"`scripts/load_serve.py`, {d['date']}, on this project's {d['machine']}: {st['clients']} clients for "
        f"{st['seconds']:g} s against one server (`serve {st['server']}`), half good requests, a third refused by "
        f"rule ({', '.join(st['bad_kinds'])}), the rest reads; another SQLite connection held the store's write lock "
        f"for {f['seconds']:g} s midway.",
        "",
        "| requests | served (completed) | refused by rule (401/413/422) | refused, busy (429/503) | accepted, failed | "
        "server errors (500) | lost |",
        "|---|---|---|---|---|---|---|",
        f"| {sum(d['sent'].values())} ({d['sent'].get('good', 0)} good, {d['sent'].get('bad', 0)} bad, "
        f"{d['sent'].get('read', 0)} reads) | {d['completed']} of {d['accepted']} accepted | "
        f"{o.get('refused_by_rule', 0)} | {o.get('refused_busy', 0)} | {d['failed']} ({codes}) | "
        f"{d['server_errors']} | **{d['lost']}** |",
        "",
        f"During the fault `/health` answered {during}; {f['seconds_to_health_200']:.2f} s after the lock was "
        f"released it was {f['health_after']} again. The rollback's error was logged in place of the real one: "
        f"{str(f['rollback_error_logged']).lower()}.",
    ])


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def _halo(r: dict) -> str:
    """A compiled step's halo against the neighbour-only minimum, from its collectives (the rule of
    ``compile.vae.halo_traffic``, so a result written before that rule reads the same way): MiB each
    chip is handed, MiB it needs (its neighbours' rows), the ratio."""
    sys.path.insert(0, str(ROOT))
    from wan_sharding.compile.vae import halo_traffic

    h = halo_traffic([c for c in r["collectives"] if c["kind"] != "mesh_partition"])
    if not h["halo_bytes"]:
        return "0.0"
    return f"{h['halo_bytes'] / 2**20:.1f} / {h['halo_neighbour_bytes'] / 2**20:.1f} ({h['halo_ratio']:.1f}x)"


def _bill(r: dict | None) -> str:
    """One compiled decode step: collectives, largest (and the frame limit when over), halo bytes
    against the neighbour-only minimum, all bytes, runtime ops, bill."""
    if r is None:
        return "-"
    if r.get("skipped"):
        return "skipped: more than this host's memory"
    if not r.get("ok"):
        return "refused"
    largest = _mib(r["largest_collective_bytes"])
    if not r["bill_ok"]:
        largest += f" (frame {_mib(r['frame_limit_bytes'])})"
    return (f"{r['collective_count']}, {largest}, {_halo(r)}, {_mib(r['collective_bytes'])}, "
            f"{r['runtime_ops']}, {'ok' if r['bill_ok'] else '**over**'}")


def _vae_compiles(d: dict) -> dict[tuple, dict]:
    return {(q["kind"], q["mesh"], q["resolution"], q["strategy"], q["frontend"], q.get("step", "first")): r
            for r in d["compile"] for q in [r["request"]]}


STRATEGY_WORDS = {
    "halo": "this package's: boundary rows all-gathered, selected, shards folded into the batch",
    "halo-permute": "the same exchange as shifts on the split rows (collective-permutes)",
    "annotate": "only the frame's H/W annotations; each conv as the module has it (what Shardy makes of a split conv)",
    "channels": "tt-xla's channel-parallel recipe (`tests/torch/models/wan14b/shared.py`, `shard_vae_decoder_specs`): "
                "per residual block conv1 out-channels / norm2 / conv2 in-channels split on the longer axis",
}


def vae_strategies(root: Path) -> str:
    d = _load(root, "vae.json")
    runs = _vae_compiles(d)
    lines = [f"`python scripts/bench_vae.py` ({_date(d)}, `results/vae.json`), Wan 2.1, the first latent frame's step "
             "at 480p on 2x4, torchax:", "",
             "| strategy | what it is | tt-mlir | collectives | largest | halo MiB / neighbour-only MiB (ratio) | "
             "all bytes | runtime ops | bill |",
             "|---|---|---|---|---|---|---|---|---|"]
    for strategy, words in STRATEGY_WORDS.items():
        r = runs.get(("wan2.1", "2x4", "480p", strategy, "torchax", "first"))
        if r is None or not r.get("ok"):
            why = "" if r is None else "; ".join((r.get("error") or "").strip().splitlines()[-1].split("; ")[:2])
            lines.append(f"| `{strategy}` | {words} | refuses: `{why}` | - | - | - | - | - | - |")
            continue
        kinds = sorted({c["kind"] for c in r["collectives"]} - {"mesh_partition"})
        lines.append(f"| `{strategy}` | {words} | compiles | {r['collective_count']} {', '.join(kinds)} | "
                     f"{_mib(r['largest_collective_bytes'])} | {_halo(r)} | {_mib(r['collective_bytes'])} | "
                     f"{r['runtime_ops']} | {'ok' if r['bill_ok'] else 'over'} |")
    return "\n".join(lines)


def vae_bills(root: Path) -> str:
    d = _load(root, "vae.json")
    runs = _vae_compiles(d)
    lines = ["| VAE | mesh | res | step | `halo`, torchax | `halo`, torch-xla | `channels` (tt-xla's), torchax |",
             "|---|---|---|---|---|---|---|"]
    keys = sorted({(k[0], k[2], k[1], k[5]) for k in runs if k[3] == "halo"},
                  key=lambda k: (k[0], k[1], k[2], ("first", "second", "steady").index(k[3])))
    for kind, res, mesh, step in keys:
        cell = lambda s, f: _bill(runs.get((kind, mesh, res, s, f, step)))  # noqa: E731
        name = {"wan2.1": "Wan 2.1", "wan2.2": "Wan 2.2"}[kind]
        lines.append(f"| {name} | {mesh} | {res} | {step} | {cell('halo', 'torchax')} | {cell('halo', 'torch-xla')} | "
                     f"{cell('channels', 'torchax')} |")
    return "\n".join(lines)


def vae_check(root: Path) -> str:
    d = _load(root, "vae.json")
    rows = d["check"]
    fp32 = [r for r in rows if r["dtype"] == "fp32" and r.get("exchange") != "none"]
    bf16 = [r for r in rows if r["dtype"] == "bf16" and r.get("exchange") != "none"]
    meshes = sorted({r["mesh"] for r in rows})
    return (f"`check --component vae` on {', '.join(meshes)} with {' and '.join(sorted({r['backend'] for r in rows}))}, "
            f"both VAEs, fp32 and bf16 ({len(rows)} rows, `python scripts/bench_vae.py`, {_date(d)}, `results/vae.json`): "
            f"{sum(r['ok'] for r in rows)} within the grade; fp32 PCC >= {min(r['pcc'] for r in fp32):.12f}, "
            f"max|diff| <= {max(r['max_abs'] for r in fp32):.1e}; bf16 PCC >= {min(r['pcc'] for r in bf16):.5f}.")


def vae_cpu(root: Path) -> str:
    d = _load(root, "vae.json")
    r0 = d["cpu"][0]
    lines = [f"`python scripts/bench_vae.py` ({_date(d)}, {r0['backend']}, {r0['dtype']}, latent "
             f"{' x '.join(map(str, r0['latent']))}, warm median per latent frame of {r0['iters']} decodes after "
             f"{r0['warmup']} warm-up, `results/vae.json`; each row is `wan-sharding profile --what vae --mesh 2x4 --latent "
             f"{','.join(map(str, r0['latent']))} --warmup {r0['warmup']} --iters {r0['iters']}` with its mesh, and "
             "`--variant ti2v-5b` for wan2.2):", "",
             "| VAE | mesh | split | host decode | sharded decode | first sharded call (compiles) |",
             "|---|---|---|---|---|---|"]
    for r in d["cpu"]:
        lines.append(f"| {r['vae']} | {r['mesh']} | {r['split']} | {r['host_per_frame_s']:.2f} s | "
                     f"{r['per_frame_s']:.2f} s | {r['first_iter_s']:.0f} s |")
    return "\n".join(lines)


def text_encoder_cpu(root: Path) -> str:
    d = _load(root, "text_encoder.json")["timing"]
    rows = d["rows"]
    ms = lambda xs: f"{min(xs) * 1e3:.1f}-{max(xs) * 1e3:.1f}"  # noqa: E731
    lines = [f"`{d['command']}` ({_date(d)}, `results/text_encoder.json` `timing`), the tiny encoder on "
             f"{rows[0]['mesh']}, medians of {len(rows[0]['host_s'])} warm pairs (their range in brackets), "
             "milliseconds:", "",
             "| process (backend) | prompt tokens | pair on the host (eager) | pair on the mesh (warm) | mesh / host | "
             "first pair on the mesh (compiles) | max-abs vs host |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['backend']} | {r['tokens']} | {r['pair_host_s'] * 1e3:.1f} ({ms(r['host_s'])}) | "
                     f"{r['pair_mesh_s'] * 1e3:.1f} ({ms(r['mesh_s'])}) | {r['mesh_over_host']:.2f} | "
                     f"{r['first_pair_mesh_s']:.2f} s | {r['max_abs']:.1e} |")
    return "\n".join(lines)


SYSTEM_WORDS = {"bh-2x4": "BH 2x4", "bh-galaxy": "BH Galaxy (8x4)", "bh-4x32": "BH 4x32"}
MEASURED_SOURCE = {"bh-2x4": " (#41873)", "bh-galaxy": " traced (#45975)"}


def _stage_plan(p: dict | None) -> str:
    """The plan a denoising row runs and the ranking that chose it."""
    if p is None:
        return ""
    if p["ranking"] == "compiled":
        return f": `{p['name']}`, the compiled ranking's best (`{p['source']}`, {p['date']})"
    return f": `{p['name']}`, the analytic ranking's best (`{p['source']}`; no compiled ranking kept for it)"


def stages(root: Path) -> str:
    d = _load(root, "stages.json")
    lines = [f"`{d['command'].strip()}` ({_date(d)}), Blackhole, seconds per video (`results/stages.json`):", "",
             "| system | res | stage | estimate | tt-metal bound | tt-metal measured |", "|---|---|---|---|---|---|"]
    memory = []
    for r in d["rows"]:
        system = SYSTEM_WORDS.get(r["system"], r["system"])
        for stage, words in (("text_encoder", "text encoder"), ("denoising", "denoising"), ("vae", "VAE")):
            s = r["stages"][stage]
            est = (f"{s['seconds']:.2f} (compute {s['compute_s']:.2f}, halo {s['comm_s']:.2f})" if stage == "vae"
                   else f"{s['seconds']:.3g}" + _stage_plan(s.get("plan")))
            measured = r["tt_metal_measured_s"].get(stage)
            measured = "-" if measured is None else f"{measured:g}{MEASURED_SOURCE.get(r['system'], '')}"
            lines.append(f"| {system} | {r['resolution']} | {words} | {est} | {r['tt_metal_bound_s'][stage]:g} | "
                         f"{measured} |")
        m = r["vae_memory_per_chip"]
        memory.append(f"{m['total_gb']:.2f} GB on {system} at {r['resolution']} (weights {m['weights_gb']:.2f}, cache "
                      f"{m['cache_gb']:.2f}, activations {m['activations_gb']:.2f})")
    lines += ["", "The VAE's memory per chip while it decodes (bf16; replicated weights, the time cache and the decode "
              "step's working set split over the mesh): " + "; ".join(memory) + "."]
    return "\n".join(lines)


# ------------------------------------------------------------------------------- blocks and pages


@dataclass(frozen=True)
class Block:
    page: str
    render: Callable[[Path], str]
    sources: str  # what the mark names


BLOCKS: dict[str, Block] = {
    "plan-480p": Block("docs/planner.md", plan_480p, "results/plan_*_480p.json"),
    "plan-cfg-split": Block("docs/planner.md", plan_cfg_split, "results/plan_8x4_wormhole_b0_480p_cfg-split.json"),
    "plan-model": Block("docs/planner.md", plan_model, "results/plan.json"),
    "fuzz": Block("docs/check.md", fuzz, "results/fuzz.json"),
    "profile": Block("docs/pipelines.md", profile, "results/profile.json"),
    "serve": Block("docs/serving.md", serve, "results/serve.json"),
    "serve-load": Block("docs/serving.md", serve_load, "results/serve_load.json"),
    "vae-strategies": Block("docs/vae.md", vae_strategies, "results/vae.json"),
    "vae-bills": Block("docs/vae.md", vae_bills, "results/vae.json"),
    "vae-check": Block("docs/vae.md", vae_check, "results/vae.json"),
    "vae-cpu": Block("docs/vae.md", vae_cpu, "results/vae.json"),
    "stages": Block("docs/pipeline-stages.md", stages, "results/stages.json"),
    "text-encoder-cpu": Block("docs/pipeline-stages.md", text_encoder_cpu, "results/text_encoder.json"),
    "causes": Block("docs/compile-hardware.md", causes, "results/hardware.json"),
}


def _pages(names: Iterable[str]) -> dict[str, list[str]]:
    pages: dict[str, list[str]] = {}
    for name in names:
        pages.setdefault(BLOCKS[name].page, []).append(name)
    return pages


def stale(root: Path = ROOT, texts: dict[str, str] | None = None) -> list[str]:
    """The blocks whose text differs from what the results render (or that a page lacks), as
    ``"page: name"``; ``texts``: page texts to check instead of the files (a test's edited copy)."""
    out = []
    for page, names in _pages(BLOCKS).items():
        text = (texts or {}).get(page)
        found = {m["name"]: m["body"] for m in MARK.finditer(text if text is not None else (root / page).read_text())}
        out += [f"{page}: {n}" for n in names if found.get(n) != BLOCKS[n].render(root) + "\n"]
    return out


def update(names: Iterable[str] | None = None, root: Path = ROOT) -> list[str]:
    """Rewrite the blocks ``names`` (default: all) from the results; returns those that changed.
    KeyError for a block its page lacks (add the two marks first)."""
    changed = []
    for page, todo in _pages(names or BLOCKS).items():
        path = root / page
        text = path.read_text()
        for name in todo:
            m = next((m for m in MARK.finditer(text) if m["name"] == name), None)
            if m is None:
                raise KeyError(f"{page} has no block {name!r}")
            body = BLOCKS[name].render(root) + "\n"
            if m["body"] != body:
                text = text[:m.start("body")] + body + text[m.end("body"):]
                changed.append(f"{page}: {name}")
        if any(c.startswith(f"{page}: ") for c in changed):  # a page whose blocks all match stays untouched
            path.write_text(text)
    return changed


def write_result(path: Path, doc: dict, volatile: tuple[str, ...] = ("date",)) -> bool:
    """Write a benchmark's result ``doc`` to ``path`` as JSON (atomically), unless the file already
    holds the same document but for its ``volatile`` keys (the run's date): a re-run that only
    refreshes the date leaves the tracked file, and the pages quoting it, as they were. Returns
    whether it wrote."""
    sys.path.insert(0, str(ROOT))
    from wan_sharding.runtime.workers import atomic_write

    text = json.dumps(doc, indent=1) + "\n"
    if path.exists():
        try:
            old = json.loads(path.read_text())
        except ValueError:
            old = None
        same = isinstance(old, dict) and ({k: v for k, v in old.items() if k not in volatile}
                                          == {k: v for k, v in json.loads(text).items() if k not in volatile})
        if same:
            return False
    atomic_write(path, text)
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 naming the blocks that differ")
    args = ap.parse_args(argv)
    if args.check:
        bad = stale()
        print("\n".join(bad) or "every figure block matches results/")
        return 1 if bad else 0
    print("\n".join(update()) or "nothing to change")
    return 0


if __name__ == "__main__":
    sys.exit(main())
