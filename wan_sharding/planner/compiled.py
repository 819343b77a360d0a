"""Stage 2: compile survivors with tt-mlir (compile-only) and cost their TTNN programs.

Each survivor is compiled as a full-width proxy (the real widths, heads and token count; only the
depth is cut) at two depths, 1 and 2 blocks, through the ordinary API with the plan
(:meth:`CompileRequest.for_plan`: ``shard_dit_specs(dit, plan)`` and
``apply_dit_sp_activation_sharding(..., plan=plan)`` in the worker). The difference of the two
programs is one block; what the 1-block program has beyond that block is paid once per forward.
Both are costed op by op (:mod:`wan_sharding.planner.ir_cost`) and scaled to the model's depth:

    seconds per forward = once-per-forward part + layers x per-block part

A plan tt-mlir rejects is a measured outcome: it is reported with the compiler's error, not
dropped.

A CFG split's plan (``cfg_axes``) compiles as ``wan-sharding compile`` compiles it
(:func:`wan_sharding.compile.cfg.compile_request`): one program with cond + uncond rows on a 2-D
mesh, the group's program on a 3-D one (tt-mlir takes 1-D and 2-D meshes only). Either way the
program runs both branches of a step at once, so it is costed as a step, and per forward as half
of it (:func:`amortise_cfg`); a plan without cfg runs 2 forwards per step (guidance on). The unit
every plan is ranked on is the denoising step (``seconds_per_step``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Sequence

from ..compile.bill import per_block_bill, tile_alignment
from ..compile.cfg import PER_GROUP, SEQUENTIAL_FORWARDS_PER_STEP, compile_request, request_cfg
from ..compile.request import CompileRequest, CompileResult
from ..compile.runner import compile_many
from ..compile.ttnn_ir import TTNNModule
from ..plan import ShardingPlan
from ..systems import HostCuts
from .hardware import Chip, Fabric
from .ir_cost import Cost, Shapes, cost_ops, parse_ops
from .workload import Workload

DEPTHS = (1, 2)


@dataclass
class CompiledEstimate:
    """What the compiled proxies of one plan say."""

    ok: bool
    error: str | None = None
    per_block: Cost | None = None
    per_forward: Cost | None = None  # once per forward (entry, condition embedder, exit)
    seconds_per_forward: float | None = None
    bill: list[dict[str, Any]] = field(default_factory=list)  # per-block bill entries (compile.bill)
    bill_counts: dict[str, float] = field(default_factory=dict)
    compile_seconds: float = 0.0
    ttnn_paths: tuple[str | None, str | None] = (None, None)
    padded_tokens: int | None = None
    scores_materialised_gb: float = 0.0  # largest score tensor in the compiled program (compile-only SDPA)
    tile_aligned: bool | None = None
    cfg_how: str | None = None  # CFG split: "one program" or "per group" (wan_sharding.compile.cfg)
    compiled_mesh: tuple[int, ...] = ()  # the mesh of the program tt-mlir compiled

    @property
    def seconds_per_step(self) -> float | None:
        """A denoising step with guidance on: 2 forwards without cfg; one program of both branches
        (2 amortised forwards) with it."""
        return None if self.seconds_per_forward is None else SEQUENTIAL_FORWARDS_PER_STEP * self.seconds_per_forward

    def per_step(self, layers: int) -> dict[str, float] | None:
        """Per device per step at ``layers`` blocks: collectives, bytes they move (results), seconds;
        and what the whole mesh moves between hosts (``cross_host_gb``, 0 on one host)."""
        if not self.ok or self.per_block is None or self.per_forward is None:
            return None
        whole = self.per_forward.plus(self.per_block.scaled(layers)).scaled(SEQUENTIAL_FORWARDS_PER_STEP)
        return {"collectives": round(sum(whole.comm_counts.values()), 3),
                "collective_gb": round(sum(whole.comm_bytes.values()) / 1e9, 4),
                "comm_seconds": round(whole.communication, 4), "seconds": round(whole.total, 4),
                "cross_host_gb": round(whole.cross_host_bytes / 1e9, 4)}

    def short_error(self) -> str:
        """The compiler's message, without the exception class and call-site noise."""
        text = (self.error or "").split("\n")[0]
        for prefix in ("XlaRuntimeError: ", "JaxRuntimeError: ", "INTERNAL: "):
            text = text.replace(prefix, "")
        # The plugin repeats a message once per failing op: keep each once, drop the generic tail.
        parts = [p.strip() for p in text.split("; ")]
        parts = [p for p in dict.fromkeys(parts) if p and p != "Failed to run stablehlo pipeline"] or parts
        return "; ".join(parts)[:240]

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"ok": self.ok, "compile_seconds": round(self.compile_seconds, 2)}
        if not self.ok:
            out["error"] = self.short_error()
            return out
        out.update(seconds_per_forward=round(self.seconds_per_forward or 0.0, 4),
                   seconds_per_step=round(self.seconds_per_step or 0.0, 4), cfg_how=self.cfg_how,
                   compiled_mesh=list(self.compiled_mesh),
                   per_block=self.per_block.to_json() if self.per_block else None,
                   per_forward=self.per_forward.to_json() if self.per_forward else None,
                   bill=self.bill, bill_counts=self.bill_counts, padded_tokens=self.padded_tokens,
                   scores_materialised_gb=round(self.scores_materialised_gb, 3), tile_aligned=self.tile_aligned,
                   ttnn_ir=list(self.ttnn_paths))
        return out


# What the planner's cost model (ir_cost) was calibrated on: fused SDPA only, tt-mlir's default
# options (level 0). Hardware's composite set and options (docs/compile-hardware.md) change the op
# mix (distributed RMSNorm, fused SDPA kept at level 1) that the cost model does not price yet.
PLANNER_COMPILE = dict(composites="sdpa", compile_options={"optimization_level": 0, "dram_space_saving": False,
                                                           "enable_trace": False})


def requests_for(work: Workload, plan: ShardingPlan, out_dir: Path | None = None,
                 depths: Sequence[int] = DEPTHS) -> list[CompileRequest]:
    """The full-width proxies of ``plan`` at ``depths`` blocks (a cfg plan's as
    :func:`wan_sharding.compile.cfg.compile_request` makes them: batch 1 per branch)."""
    reqs = []
    for d in depths:
        sub = None if out_dir is None else str(out_dir / f"{d}blk")
        reqs.append(compile_request(plan, 1, variant=work.variant, latent=work.latent, blocks=d, size="full",
                                    resolution=work.resolution, out_dir=sub, **PLANNER_COMPILE))
    return reqs


def evaluate(work: Workload, plans: Sequence[ShardingPlan], chip: Chip, fabric: Fabric | Sequence[Fabric], *,
             work_dir: Path,
             attention: str = "fused", timeout: float = 900.0,
             progress: Callable[[str], None] | None = None,
             cuts: Sequence[HostCuts | None] | None = None) -> list[CompiledEstimate]:
    """Compile every plan at 1 and 2 blocks and cost it; one :class:`CompiledEstimate` per plan.

    ``fabric``: one for every plan, or one per plan: the fabric of the mesh its program is
    compiled for (a CFG split compiled per group: its half mesh's). ``cuts``: per plan, where the
    hosts fall on that mesh (None: one host).
    One worker process compiles the whole batch (its ~20 s start-up is paid once). Two workers side
    by side were tried and dropped: the plugin's first-use unpacking of its runtime files is not
    safe against a second process doing the same ("failed to extract embedded tt-metal runtime
    archive", then a hung worker).
    """
    if not plans:
        return []
    requests: list[CompileRequest] = []
    for i, plan in enumerate(plans):
        requests += requests_for(work, plan, work_dir / f"plan_{i:02d}")
    if progress:
        progress(f"stage 2: compiling {len(plans)} plans x {len(DEPTHS)} depths with tt-mlir ({chip.arch})")
    results = compile_many(requests, chip.arch, timeout=timeout, work_dir=work_dir)
    fabrics = [fabric] * len(plans) if isinstance(fabric, Fabric) else list(fabric)
    hosts = list(cuts) if cuts is not None else [None] * len(plans)
    out = []
    for i, plan in enumerate(plans):
        shallow, deep = results[len(DEPTHS) * i: len(DEPTHS) * (i + 1)]
        out.append(estimate_from_results(work, plan, shallow, deep, chip, fabrics[i], attention, hosts[i]))
    return out


def amortise_cfg(est: CompiledEstimate, layers: int, parts: int, exchange_key: str,
                 exchange_seconds: float, exchange_cross_host_bytes: float = 0.0) -> CompiledEstimate:
    """A CFG split's compiled estimate per forward: the half mesh runs ``parts`` forwards at once, so
    each costs 1/``parts`` of the half mesh's program, plus its share of exchanging the noise
    predictions between the halves (``exchange_seconds`` per step, charged once per forward).
    Bytes between hosts: a program compiled per group is one group's, and every group runs its
    forward at once, so a forward's are that program's; one program of both branches is shared as
    the seconds are."""
    if not est.ok or parts <= 1:
        return est
    per_block = est.per_block.scaled(1.0 / parts)
    per_forward = est.per_forward.scaled(1.0 / parts)
    if est.cfg_how == PER_GROUP:
        per_block.cross_host_bytes = est.per_block.cross_host_bytes
        per_forward.cross_host_bytes = est.per_forward.cross_host_bytes
    per_forward.cross_host_bytes += exchange_cross_host_bytes / parts
    per_forward.comm[exchange_key] = per_forward.comm.get(exchange_key, 0.0) + exchange_seconds / parts
    return replace(est, per_block=per_block, per_forward=per_forward,
                   seconds_per_forward=per_forward.total + layers * per_block.total)


def estimate_from_results(work: Workload, plan: ShardingPlan, shallow: CompileResult, deep: CompileResult,
                          chip: Chip, fabric: Fabric, attention: str = "fused",
                          cuts: HostCuts | None = None) -> CompiledEstimate:
    """Cost the two compiled proxies of ``plan`` (shallow and deep, from :func:`requests_for`);
    ``cuts``: where the hosts fall on the compiled program's mesh."""
    secs = sum(r.compile_seconds or 0.0 for r in (shallow, deep))
    failed = next((r for r in (shallow, deep) if not r.ok), None)
    if failed is not None:
        return CompiledEstimate(False, error=failed.error or "compile failed", compile_seconds=secs)
    compiled_plan = deep.request.plan or plan  # a 3-D cfg plan compiles its group's plan
    mesh = compiled_plan.mesh()
    shapes = Shapes(work.tokens, int(deep.padded_tokens or work.tokens), mesh.sp, work.prompt_tokens)
    kw = dict(chip=chip, fabric=fabric, mesh_shape=compiled_plan.mesh_shape, axis_names=compiled_plan.axis_names,
              shapes=shapes, attention=attention, cuts=cuts)
    d1, d2 = shallow.request.num_blocks, deep.request.num_blocks
    m1, m2 = TTNNModule.from_file(shallow.ttnn_path), TTNNModule.from_file(deep.ttnn_path)
    c1, c2 = cost_ops(parse_ops(m1), **kw), cost_ops(parse_ops(m2), **kw)
    per_block = c2.minus(c1).scaled(1.0 / (d2 - d1))
    per_forward = c1.minus(per_block.scaled(d1))
    total = per_forward.total + work.layers * per_block.total
    bill = per_block_bill(m1, m2, d1, d2, mesh)
    tiles = None
    if mesh.sp_axis is None or isinstance(mesh.sp_axis, str):  # the tile check reads one SP axis
        tiles = tile_alignment(m2, mesh)["aligned"]
    return CompiledEstimate(True, per_block=per_block, per_forward=per_forward, seconds_per_forward=total,
                            bill=[e.to_json() for e in bill.entries], bill_counts=bill.counts(), compile_seconds=secs,
                            ttnn_paths=(shallow.ttnn_path, deep.ttnn_path), padded_tokens=deep.padded_tokens,
                            scores_materialised_gb=max(c1.score_bytes_max, c2.score_bytes_max) / 1e9,
                            tile_aligned=tiles, cfg_how=compile_how(deep.request),
                            compiled_mesh=tuple(compiled_plan.mesh_shape))


def compile_how(req: CompileRequest) -> str | None:
    """How a request compiles its cfg plan (None without cfg)."""
    return request_cfg(req).how
