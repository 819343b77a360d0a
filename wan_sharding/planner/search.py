"""The two-stage planner: enumerate -> filter -> analytic top K -> compile -> rank on the fabric.

:func:`plan_sharding` is the whole pipeline (what ``wan-sharding plan`` runs). Stage 1 scores every
legal candidate from shapes (:mod:`~wan_sharding.planner.analytic`) and keeps the best ``top``;
stage 2 compiles those with tt-mlir and costs their TTNN programs on the chip fabric
(:mod:`~wan_sharding.planner.compiled`). Plans tt-mlir rejects are reported as such, and if
that leaves fewer than ``top`` compiled plans the next stage-1 candidates are compiled too (up to
``max_rounds`` batches). The recommendation is the fastest compiled plan.

On a mesh that spans several hosts (several Galaxies, one host each, or a rank binding of tt-xla's
distributed runtime: :func:`wan_sharding.systems.host_cuts`) every plan also gets the bytes its
collectives move between hosts per denoising step, and a plan whose TP axis crosses a host boundary
(its all-reduces on the inter-host links in every block) ranks as if :data:`TP_ACROSS_HOSTS` slower:
it wins only by more than that.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from ..runtime import scratch
from ..compile.cfg import ONE_PROGRAM, SEQUENTIAL_FORWARDS_PER_STEP, cfg_compile
from ..mesh import PHYSICAL_AXIS_NAMES, MeshError, parse_mesh_shape
from ..systems import BindingError, HostCuts, check_binding_grid, host_cuts, rank_binding, tt_mlir_rejects
from ..plan import ShardingPlan
from . import analytic, compiled
from .analytic import Estimate  # noqa: F401  (stage-1 result; its home is analytic)
from .candidates import Candidate, build_candidates
from .hosts import (TP_ACROSS_HOSTS, candidate_cuts, compile_cuts, cross_host_gb_per_step, hosts_json,
                    ranking_seconds, tp_crosses_hosts)
from .hardware import Chip, Fabric, chip as chip_for, fabric_for, pair_exchange_seconds, sub_fabric
from .ir_cost import ATTENTION_MODES
from .weights import adapter_bytes_per_expert, meta_dit, text_encoder_weight_bytes, weight_bytes_per_expert
from .workload import Workload


class PlannerError(RuntimeError):
    """Nothing to recommend (no legal plan), or a bad request."""


@dataclass
class PlanReport:
    """Everything one planning run found; ``recommended`` is a :class:`Candidate` or None."""

    work: Workload
    chip: Chip
    fabric: Fabric
    candidates: list[Candidate]
    ranked: list[Candidate]  # every non-duplicate candidate, best first
    recommended: Candidate | None
    top: int
    attention: str
    timings: dict[str, float] = field(default_factory=dict)
    compiled_stage: bool = True
    cuts: HostCuts | None = None  # where the hosts fall (None: one host)
    rank_binding: str = ""
    vae_memory: Any = None  # the VAE's bytes per chip when it runs on the mesh too (planner/vae.py)

    def estimated_seconds(self, c: Candidate) -> float | None:
        """Compiled estimate when there is one, None when tt-mlir rejected the plan, else the
        analytic one (None for illegal plans)."""
        if c.compiled is not None:
            return c.compiled.seconds_per_forward if c.compiled.ok else None
        if c.analytic is not None:
            return c.analytic.seconds_per_forward
        return None

    def estimated_seconds_per_step(self, c: Candidate) -> float | None:
        """:meth:`estimated_seconds` per denoising step with guidance on: 2 forwards without cfg,
        one program of both branches with it (its per-forward figure is half a step)."""
        est = self.estimated_seconds(c)
        return None if est is None else SEQUENTIAL_FORWARDS_PER_STEP * est

    def stage(self, c: Candidate) -> str:
        if c.duplicate_of:
            return "duplicate"
        if c.reason:
            return "illegal"
        if c.compiled is not None:
            return "compiled" if c.compiled.ok else "no-compile"
        return "analytic"

    def why_lost(self, c: Candidate) -> str:
        return why_lost(self, c)

    def candidate_json(self, c: Candidate, rank: int | None) -> dict[str, Any]:
        m = c.plan.mesh()
        est = self.estimated_seconds(c)
        out: dict[str, Any] = {
            "rank": rank, "name": c.name, "stage": self.stage(c), "plan": c.plan.to_dict(),
            "cfg_split": None if not c.cfg_axis else {
                "axis": c.cfg_axis, "parts": c.cfg_parts, "half_mesh": list(c.plan.mesh_shape),
                "plan": c.cfg_plan.to_dict(), "plan_name": c.cfg_plan.name,
                "mesh": " x ".join(f"{n}={s}" for n, s in zip(c.cfg_plan.axis_names, c.cfg_plan.mesh_shape)),
                "compiled_as": cfg_compile(c.cfg_plan).how,
                "note": "cond and uncond forwards run at once, one per half: a step is one program; per forward "
                        "figures are half of it"},
            "sp": m.sp, "tp": m.tp, "mesh_axes": {"names": list(c.plan.axis_names), "shape": list(c.plan.mesh_shape),
                                                  "sp": list(c.plan.sp_axes), "tp": list(c.plan.tp_axes)},
            "fsdp": c.plan.fsdp, "layout": c.plan.layout, "padding": c.plan.padding,
            "idle_axes": list(c.idle_axes), "tp_crosses_hosts": c.tp_crosses_hosts,
            "cross_host_gb_per_step": cross_host_gb_per_step(self.cuts, self.work.layers, c),
            "memory_per_chip_gb": round(c.memory.total / 1e9, 3) if c.memory else None,
            "memory": c.memory.to_json() if c.memory else None,
            "estimated_seconds_per_forward": None if est is None else round(est, 4),
            "estimated_seconds_per_step": None if est is None else round(SEQUENTIAL_FORWARDS_PER_STEP * est, 4),
            "forwards_per_step": 1 if c.cfg_axis else SEQUENTIAL_FORWARDS_PER_STEP,
            "per_step": c.compiled.per_step(self.work.layers) if c.compiled is not None else None,
            "analytic": c.analytic.to_json() if c.analytic else None,
            "compiled": c.compiled.to_json() if c.compiled else None,
            "why_lost": why_lost(self, c),
        }
        if c.reason:
            out["reason"] = c.reason
        if c.duplicate_of:
            out["duplicate_of"] = c.duplicate_of
        return out

    def to_json(self) -> dict[str, Any]:
        ranked = [self.candidate_json(c, i + 1) for i, c in enumerate(self.ranked)]
        dups = [self.candidate_json(c, None) for c in self.candidates if c.duplicate_of]
        rec = None
        if self.recommended is not None:
            rec = next(r for r in ranked if r["name"] == self.recommended.name)
        legal = [c for c in self.candidates if c.legal]
        return {
            "mesh": "x".join(map(str, self.fabric.grid)), "arch": self.chip.arch,
            "hosts": hosts_json(self.cuts, self.rank_binding),
            "workload": self.work.to_json(), "fabric": self.fabric.describe(), "fabric_source": self.fabric.source,
            "chip": {"peak_tflops": self.chip.peak_tflops, "matmul_efficiency": self.chip.matmul_efficiency,
                     "dram_gb": self.chip.dram_gb, "dram_gbps": self.chip.dram_gbps,
                     "slice_back_gbps": self.chip.slice_back_gbps, "source": self.chip.source},
            "attention": self.attention, "top": self.top, "compiled_stage": self.compiled_stage,
            "counts": {"enumerated": len(self.candidates), "distinct": len(self.candidates) - len(dups),
                       "legal": len(legal), "compiled": sum(1 for c in self.candidates if c.compiled is not None),
                       "compiled_ok": sum(1 for c in self.candidates if c.compiled is not None and c.compiled.ok)},
            "timings_seconds": {k: round(v, 2) for k, v in self.timings.items()},
            "candidates": ranked + dups,
            "recommended": rec,
            **({"vae_memory_per_chip": self.vae_memory.to_json()} if self.vae_memory is not None else {}),
        }


def candidate_fabric(fabric: Fabric, c: Candidate) -> Fabric:
    """The fabric ``c``'s plan runs on: the whole machine, or one half of it for a CFG split."""
    if not c.cfg_axis:
        return fabric
    return sub_fabric(fabric, PHYSICAL_AXIS_NAMES.index(c.cfg_axis), c.cfg_parts)


def compile_fabric(fabric: Fabric, c: Candidate) -> Fabric:
    """The fabric of the mesh ``c``'s program is compiled for: the whole machine for a CFG split
    compiled as one program (2-D cfg mesh), its half for one compiled per group."""
    if c.cfg_axis and cfg_compile(c.cfg_plan).how == ONE_PROGRAM:
        return fabric
    return candidate_fabric(fabric, c)


def cfg_exchange(work: Workload, fabric: Fabric, c: Candidate, cuts: HostCuts | None = None) -> tuple[str, float, float]:
    """``(key, seconds, bytes between hosts)`` of one step's exchange between the halves of a CFG
    split: every device swaps its 1/N share of the noise prediction with its partner in the other
    half (the device half the cut axis away); the combined prediction is then gathered like any output."""
    i = PHYSICAL_AXIS_NAMES.index(c.cfg_axis)
    n = fabric.grid[i]
    devices = c.plan.mesh_shape[0] * c.plan.mesh_shape[1]
    share = work.output_bytes() / devices
    crossing = cuts.pair_exchange_bytes(share, i) if cuts is not None else 0.0
    return f"cfg_exchange@{c.cfg_axis}", pair_exchange_seconds(share, fabric.axes[i], n, fabric), crossing


def stage1(work: Workload, candidates: Sequence[Candidate], chip: Chip, fabric: Fabric,
           cuts: HostCuts | None = None) -> list[Candidate]:
    """Analytic estimate for every legal candidate; returns them best first (:func:`ranking_seconds`)."""
    legal = [c for c in candidates if c.legal]
    for c in legal:
        c.tp_crosses_hosts = tp_crosses_hosts(cuts, c)
        if c.cfg_axis:
            key, secs, crossing = cfg_exchange(work, fabric, c, cuts)
            c.analytic = analytic.estimate_cfg(work, c.plan, chip, candidate_fabric(fabric, c), c.cfg_parts, key, secs,
                                               candidate_cuts(cuts, c), crossing)
        else:
            c.analytic = analytic.estimate(work, c.plan, chip, fabric, cuts)
    return sorted(legal, key=lambda c: (ranking_seconds(c, c.analytic.seconds_per_forward), len(c.idle_axes), c.name))


def plan_sharding(mesh: str | Sequence[int] = "8x4", arch: str = "wormhole_b0", variant: str = "t2v-a14b",
                  resolution: str | None = "480p", latent: Sequence[int] | None = None, *, top: int = 6,
                  compile: bool = True, attention: str = "fused", topology: str = "machine",
                  work_dir: str | Path | None = None, timeout: float = 900.0, max_rounds: int = 3,
                  keep: Callable[[ShardingPlan], bool] | None = None, cfg_split: bool = False,
                  progress: Callable[[str], None] | None = None, rank_binding_name: str | None = None,
                  text_encoder: bool = False, vae: bool = False, lora_rank: int = 0) -> PlanReport:
    """Plan the sharding of a Wan 2.2 DiT on a Tenstorrent mesh.

    Args:
        mesh: ``"RxC"`` (e.g. ``"8x4"``, ``"2x4"``), a mesh preset name or ``(rows, cols)``: the
            physical chip grid (read by :func:`wan_sharding.mesh.parse_mesh_shape`).
        arch: ``"wormhole_b0"`` or ``"blackhole"``.
        variant, resolution, latent: the workload (see :meth:`Workload.build`).
        top: how many stage-1 survivors to compile (stage 2).
        compile: run stage 2 (needs ``jax-tt-plugin``); False ranks on the analytic stage only.
        attention: ``"fused"`` (scores stay on chip) or ``"materialised"`` (scores in DRAM: counted in
            memory and time); see :mod:`wan_sharding.planner.ir_cost`.
        topology: ``"machine"``, ``"line"`` or ``"ring"`` (see :func:`~wan_sharding.planner.hardware.fabric_for`).
        work_dir: where compiled IRs go and stay (None: a scratch folder, removed when planning ends).
        timeout: seconds for each compile batch.
        max_rounds: compile batches at most (a batch is topped up when plans fail to compile).
        keep: restrict the search to the plans this accepts (e.g. ``lambda p: p.padding == "mask"``).
        cfg_split: also rank CFG splits (cond and uncond forwards at once on the two halves of an
            axis; :mod:`~wan_sharding.planner.candidates`), each a real plan with ``cfg_axes``
            (``Candidate.cfg_plan``). Every plan is ranked per denoising step (guidance on: 2
            forwards without cfg, 1 program of both branches with it); per-forward figures are
            half a step. Off by default (it roughly doubles the candidates).
        progress: called with a line of text at each step.
        rank_binding_name: the multi-host system the mesh is (a rank binding of tt-xla's distributed
            runtime, :data:`wan_sharding.systems.RANK_BINDINGS`): its hosts are planned for, and the
            mesh must be its global mesh and ``arch`` its chips. Without it a multi-Galaxy grid
            has one host per Galaxy.
        text_encoder: the pipeline's UMT5 text encoder is on the mesh too (``shard_pipeline(...,
            text_encoder=True)``): its weights count in each chip's memory, and a plan it cannot be
            sharded on is illegal.
        vae: the pipeline's VAE runs on the mesh too (``--vae mesh``): its weights, time cache and
            decode working set (:func:`.vae.vae_memory_per_chip`) come off every chip's budget
            beside the experts'. Counted whole for the denoising too (the VAE stays resident; its
            working set is ~0.1-0.5 GB per chip), so a plan is never one that fits only while the
            VAE is idle.
        lora_rank: each expert also holds a LoRA adapter of this rank on every Linear a Wan LoRA
            targets (``shard_pipeline`` keeps it as layers): its bytes per chip count beside the
            expert's (:func:`.weights.adapter_bytes_per_expert`); 0: none.

    Returns:
        A :class:`PlanReport`.

    Raises:
        PlannerError: bad arguments or no legal plan at all.
    """
    t0 = time.perf_counter()
    say = progress or (lambda s: None)
    if attention not in ATTENTION_MODES:
        raise PlannerError(f"unknown attention mode {attention!r}; choose one of {ATTENTION_MODES}")
    if top < 1:
        raise PlannerError(f"top must be >= 1, got {top}")
    try:
        shape = parse_mesh_shape(mesh)
    except MeshError as e:
        raise PlannerError(str(e)) from None
    if compile and tt_mlir_rejects(shape):
        raise PlannerError(tt_mlir_rejects(shape) + " (or plan it with --no-compile)")
    try:
        work = Workload.build(variant, resolution, latent)
        chip = chip_for(arch)
        fabric = fabric_for(arch, shape, topology)
        binding = rank_binding(rank_binding_name) if rank_binding_name else None
        if binding is not None:
            check_binding_grid(binding, shape, f"the mesh {mesh if isinstance(mesh, str) else shape}")
            if binding.arch != arch:
                raise BindingError(f"{binding.name} is {binding.machine}: its chips are {binding.arch}, not {arch}; "
                                   f"use --arch {binding.arch}")
    except ValueError as e:  # BindingError is one
        raise PlannerError(str(e)) from None
    cuts = host_cuts(shape, binding, (fabric.axes[0].wrap, fabric.axes[1].wrap))
    timings: dict[str, float] = {}
    say(f"workload {work.label}; {fabric.describe()}" + (f"; {cuts.describe()}" if cuts is not None else ""))
    meta_dit(work.variant)
    timings["model"] = time.perf_counter() - t0
    t1 = time.perf_counter()
    rejected = (lambda s: f"tt-mlir rejects a {s[0]}x{s[1]} mesh" if tt_mlir_rejects(s) else "") if compile else None
    vae_memory = None
    if vae:
        from ..models import VAE_OF_VARIANT
        from .vae import vae_memory_per_chip

        vae_memory = vae_memory_per_chip(VAE_OF_VARIANT[work.variant], shape[0] * shape[1], work.resolution or "480p")
    budget = chip.usable_dram_bytes - (vae_memory.total if vae_memory is not None else 0.0)
    cands = build_candidates(work, shape, budget,
                             lambda p: weight_bytes_per_expert(work.variant, p) + adapter_bytes_per_expert(work.variant, p, lora_rank),
                             attention, PHYSICAL_AXIS_NAMES, keep, cfg_split, rejected,
                             text_encoder_weight_bytes if text_encoder else None)
    ordered = stage1(work, cands, chip, fabric, cuts)
    timings["stage1"] = time.perf_counter() - t1
    say(f"stage 1: {len(cands)} candidates, {len(ordered)} legal, analytic best "
        f"{ordered[0].analytic.seconds_per_forward:.2f} s/forward" if ordered else
        f"stage 1: {len(cands)} candidates, none legal")
    if not ordered:
        return PlanReport(work, chip, fabric, cands, _rank(cands, []), None, top, attention, timings, compile, cuts,
                          binding.name if binding else "", vae_memory)
    compiled_list: list[Candidate] = []
    if compile:
        t2 = time.perf_counter()
        with scratch.folder(work_dir, "plan-") as root:  # the IRs are kept only under --out
            queue = list(ordered)
            rounds = 0
            while queue and rounds < max_rounds:
                ok = sum(1 for c in compiled_list if c.compiled.ok)
                want = top - ok if rounds else top
                if want <= 0:
                    break
                batch, queue = queue[:want], queue[want:]
                if cfg_split and not rounds:
                    # both layouts compiled, compared on the same unit: the best CFG split and the best
                    # whole-mesh plan join the first batch when stage 1 left either out of the top
                    for split in (True, False):
                        if not any(bool(c.cfg_axis) == split for c in batch):
                            best = next((c for c in queue if bool(c.cfg_axis) == split), None)
                            if best is not None:
                                batch.append(best)
                                queue.remove(best)
                rounds += 1
                results = compiled.evaluate(work, [c.full_plan for c in batch], chip,
                                            [compile_fabric(fabric, c) for c in batch], work_dir=root / f"round_{rounds}",
                                            attention=attention, timeout=timeout, progress=say,
                                            cuts=[compile_cuts(cuts, c) for c in batch])
                for c, r in zip(batch, results):
                    if c.cfg_axis:
                        r = compiled.amortise_cfg(r, work.layers, c.cfg_parts, *cfg_exchange(work, fabric, c, cuts))
                    c.compiled = r
                    compiled_list.append(c)
                    say(f"  {c.name}: " + (f"{r.seconds_per_step:.2f} s/step" if r.ok
                                           else f"does not compile: {r.short_error()[:120]}"))
        if work_dir is None:  # the IRs went with the scratch folder: name none
            for c in compiled_list:
                c.compiled.ttnn_paths = (None, None)
        timings["stage2"] = time.perf_counter() - t2
    ok_compiled = [c for c in compiled_list if c.compiled.ok]
    if compile and ok_compiled:
        recommended = min(ok_compiled, key=lambda c: ranking_seconds(c, c.compiled.seconds_per_forward))
    elif compile:
        recommended = None  # every survivor was rejected by tt-mlir: nothing measured to recommend
    else:
        recommended = ordered[0]
    timings["total"] = time.perf_counter() - t0
    return PlanReport(work, chip, fabric, cands, _rank(cands, ordered), recommended, top, attention, timings, compile,
                      cuts, binding.name if binding else "", vae_memory)


def _rank(cands: Sequence[Candidate], ordered: Sequence[Candidate]) -> list[Candidate]:
    """Compiled plans by compiled time, then plans tt-mlir rejected, then the stage-1 rest in
    stage-1 order, then illegal plans."""
    comp_ok = sorted((c for c in ordered if c.compiled is not None and c.compiled.ok),
                     key=lambda c: ranking_seconds(c, c.compiled.seconds_per_forward))
    comp_bad = [c for c in ordered if c.compiled is not None and not c.compiled.ok]
    rest = [c for c in ordered if c.compiled is None]
    illegal = [c for c in cands if c.reason and not c.duplicate_of]
    return [*comp_ok, *comp_bad, *rest, *illegal]


# ------------------------------------------------------------------------------- why it lost


def _components(c: Candidate, compiled_view: bool, layers: int) -> dict[str, float]:
    """Per-forward seconds by component: compute parts and communication per kind@axis."""
    if compiled_view:
        pb, pf = c.compiled.per_block, c.compiled.per_forward
        whole = pf.plus(pb.scaled(layers))
    else:
        whole = c.analytic.per_block.scaled(layers)
    out = {"matmul": whole.matmul, "DRAM-bound ops": whole.memory, "K/V slice-back": whole.slice_back}
    for k, v in whole.comm.items():
        kind, _, axis = k.partition("@")
        out[f"{kind.replace('_', '-')} over {axis}"] = v
    return out


# Below this relative gap two estimates are a tie for the model: its inputs (efficiency, link
# speeds, the DRAM-traffic rule) are not known to better than that.
NEAR_TIE = 0.03


def _biggest_gap(c: Candidate, best: Candidate, compiled_view: bool, layers: int) -> str:
    mine, theirs = _components(c, compiled_view, layers), _components(best, compiled_view, layers)
    gaps = sorted(((mine.get(k, 0.0) - theirs.get(k, 0.0), k) for k in set(mine) | set(theirs)), reverse=True)
    parts = [f"+{d:.2f} s {k}" for d, k in gaps[:2] if d > 0.005]
    total_mine, total_best = sum(mine.values()), sum(theirs.values())
    tie = (f"near tie ({100 * (total_mine / total_best - 1):+.1f}%, inside the model's resolution): "
           if total_best > 0 and total_mine / total_best - 1 < NEAR_TIE else "")
    return tie + (", ".join(parts) or "within rounding of the best")


def why_lost(report: PlanReport, c: Candidate) -> str:
    """One line: why ``c`` is not the recommendation."""
    best = report.recommended
    if c.duplicate_of:
        return f"same collectives as [{c.duplicate_of}] (axis order inside a role does not change tt-mlir's program)"
    if c.reason:
        return c.reason
    if best is not None and c is best:
        return "recommended"
    idle = f"; {'+'.join(c.idle_axes)} idle (those chips repeat the work)" if c.idle_axes else ""
    layers = report.work.layers
    if c.compiled is not None and not c.compiled.ok:
        return f"does not compile in tt-mlir: {c.compiled.short_error()}"
    mine, theirs = report.estimated_seconds(c), None if best is None else report.estimated_seconds(best)
    if c.tp_crosses_hosts and best is not None and not best.tp_crosses_hosts and mine is not None and theirs \
            and mine < theirs:
        return (f"TP crosses hosts (its all-reduces on the inter-host links in every block): "
                f"{100 * (1 - mine / theirs):.1f}% faster, under the {100 * TP_ACROSS_HOSTS:g}% a plan needs to beat "
                "one that keeps TP inside a host")
    if c.compiled is not None and best is not None and best.compiled is not None and best.compiled.ok:
        return f"slower: {_biggest_gap(c, best, True, layers)}" + idle
    ref = best if best is not None and best.analytic is not None else None
    if c.analytic is not None:
        survivors = [x for x in report.candidates if x.compiled is not None]
        cutoff = max((x.analytic.seconds_per_forward for x in survivors), default=None)
        gap = f": {_biggest_gap(c, ref, False, layers)}" if ref is not None else ""
        if report.compiled_stage and cutoff is not None:
            return f"pruned in stage 1 ({c.analytic.seconds_per_forward:.2f} s > {cutoff:.2f} s cut-off){gap}" + idle
        return f"slower (analytic){gap}" + idle
    return "not evaluated"
