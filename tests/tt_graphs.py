"""Run in a torch-xla CPU process by ``test_tt_contract.py``: the ``tt`` backend under real dynamo.

Tenstorrent's torch plugin (``tt_torch``, from ``pjrt-plugin-tt``) cannot be installed here, so
this process stands in for the two pieces of it the backend touches, made the way tt-xla makes
them (``python_package/tt_torch/custom_ops.py``, ``python_package/torch_plugin_tt/__init__.py``):

- ``torch.ops.tt.sharding_constraint``, a ``torch.library.custom_op`` for ``cpu`` and ``xla`` with
  a fake (meta) implementation, so dynamo traces it as one op; here its body applies the
  constraint for real on torch-xla SPMD (the partition spec read back from the Shardy string,
  ``xs.annotate_custom_sharding`` on a copy), where the real one emits the
  ``tt.sharding_constraint`` custom call tt-mlir reads;
- a ``torch.compile`` backend named ``"tt"`` that records each graph dynamo hands it (the
  constraint ops in it, its inputs and its own parameters) and runs the graph as it is, on
  torch-xla's lazy tensors (a constraint run while no graph runs is counted as eager);
- ``torch._dynamo.config.inline_inbuilt_nn_modules = False``, as ``torch_plugin_tt`` sets it.

Everything else is real: stock torch-xla SPMD on 8 CPU devices, the real ``TTBackend``
(``place``, ``run``, ``release``), the real hooks, dynamo itself. Prints one JSON object.

For each graph it records the constraints and, apart, the RMSNorm pins: for every ``rms_norm``
node (what tt-xla's pass marks ``tenstorrent.rms_norm``), the constraint feeding it and the two on
its result, when they are there.

Usage: ``python tt_graphs.py MESH PARTS N CASE...``: on the mesh preset MESH (the process has its
devices), the PARTS named (comma-separated: ``cases``, each CASE ``variant:dtype:padding[:patch+patch]``
compiled, counted and compared with the unsharded model on the CPU; ``models``, ``N`` models in one
process; ``cached``; ``prompt``). The test runs the parts in two processes at once.
"""

import json
import re
import sys
import types

import numpy as np
import torch
import torch_xla
import torch_xla.distributed.spmd as xs
from torch._dynamo import register_backend

torch._dynamo.config.inline_inbuilt_nn_modules = False  # what torch_plugin_tt sets

EAGER_CALLS: list[str] = []  # the constraint op's executions outside a compiled graph (eager runs)
RUNNING: list[int] = [0]  # compiled graphs running now (their constraints are not eager)
GRAPHS: list[list[str]] = []  # one entry per graph dynamo compiled: its constraints' sdy strings (pins apart)
PINS: list[list[list[str]]] = []  # per graph: per rms_norm node, the sdy strings of its pins
NORMS: list[int] = []  # per graph: rms_norm nodes (call_function or an nn.RMSNorm call_module)
MESH: list = []  # the torch-xla mesh the constraints apply on
PLACEHOLDERS: list[int] = []  # per graph: its inputs (what tt-xla marks ``input``)
PARAMETERS: list[int] = []  # per graph: the weights it holds as its own (what tt-xla marks ``parameter``)


@torch.library.custom_op("tt::sharding_constraint", mutates_args=[], device_types=["cpu", "xla"])
def sharding_constraint(tensor: torch.Tensor, sdy_sharding: str) -> torch.Tensor:
    if not RUNNING[0]:
        EAGER_CALLS.append(sdy_sharding)
    out = tensor.clone()
    if out.device.type == "xla":
        dims = [re.findall(r'"mesh_idx_(\d+)"', d) for d in re.findall(r"\{([^{}]*)\}", sdy_sharding.split("@mesh, ", 1)[1])]
        names = MESH[0].axis_names
        spec = tuple(None if not d else names[int(d[0])] if len(d) == 1 else tuple(names[int(i)] for i in d) for d in dims)
        xs.annotate_custom_sharding(out, MESH[0], spec)
    return out


@sharding_constraint.register_fake
def _(tensor: torch.Tensor, sdy_sharding: str) -> torch.Tensor:
    return tensor.clone()


def sharding_constraint_tensor(input, mesh, partition_spec, unreduced=None):
    """The stand-in of ``tt_torch.sharding.sharding_constraint_tensor``: the Shardy string as its
    docstring documents it (mesh axis i named ``mesh_idx_<i>``, a dim over several axes naming each),
    then the custom op."""
    def dim(a) -> str:  # several axes on one dim (the VAE's folded shards): each named, as tt_torch does
        axes = () if a is None else (a,) if isinstance(a, str) else a
        return "{" + ", ".join('"mesh_idx_%d"' % mesh.axis_names.index(x) for x in axes) + "}"

    dims = ", ".join(dim(a) for a in partition_spec)
    return torch.ops.tt.sharding_constraint(input, f"#sdy.sharding_per_value<[<@mesh, [{dims}]>]>")


sharding = types.ModuleType("tt_torch.sharding")
sharding.sharding_constraint_tensor = sharding_constraint_tensor
package = types.ModuleType("tt_torch")
package.sharding = sharding
sys.modules.update({"tt_torch": package, "tt_torch.sharding": sharding})
OPTIONS: list[dict] = []
torch_xla.set_custom_compile_options = lambda options: OPTIONS.append(dict(options))  # Tenstorrent's build only


def _is_constraint(node) -> bool:
    return node.op == "call_function" and "tt.sharding_constraint" in str(node.target)


def _is_norm(gm: torch.fx.GraphModule, node) -> bool:
    if node.op == "call_function":
        return node.target in (torch.nn.functional.rms_norm, torch.rms_norm)
    return node.op == "call_module" and type(gm.get_submodule(node.target)) is torch.nn.RMSNorm


@register_backend(name="tt")
def counting_backend(gm: torch.fx.GraphModule, example_inputs):
    pins, pinned = [], set()
    norms = [n for n in gm.graph.nodes if _is_norm(gm, n)]
    for norm in norms:
        feed = norm.args[0]
        whole = next(iter(norm.users)) if len(norm.users) == 1 else None
        split = next(iter(whole.users)) if whole is not None and len(whole.users) == 1 else None
        chain = [feed, whole, split]
        if all(c is not None and _is_constraint(c) for c in chain):
            pins.append([str(c.args[1]) for c in chain])
            pinned.update(chain)
    GRAPHS.append([str(n.args[1]) for n in gm.graph.nodes if _is_constraint(n) and n not in pinned])
    PINS.append(pins)
    NORMS.append(len(norms))
    PLACEHOLDERS.append(sum(n.op == "placeholder" for n in gm.graph.nodes))
    PARAMETERS.append(len(list(gm.parameters())))

    def run(*args):
        RUNNING[0] += 1
        try:
            return gm.forward(*args)
        finally:
            RUNNING[0] -= 1

    return run


def _backend(preset: str):
    from wan_sharding.backends.tt import TTBackend
    from wan_sharding.backends.xla import enable_spmd
    from wan_sharding.mesh import mesh_from_preset

    enable_spmd()
    mesh = mesh_from_preset(preset)
    # the real torch-xla mesh over the CPU devices; the TT device type is not set (no chips)
    MESH[:] = [xs.Mesh(np.arange(mesh.num_devices), mesh.shape, mesh.axis_names)]
    return TTBackend(mesh, native_mesh=MESH[0])


def _max_abs_and_pcc(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    a, b = out.double().flatten(), ref.double().flatten()
    pcc = float(torch.corrcoef(torch.stack([a, b]))[0, 1])
    return float((a - b).abs().max()), pcc


def graphs(preset: str, cases: list[str]) -> dict:
    """Per case: the constraints of one eager (lazy) forward, then the graphs of one compiled one
    (constraints and RMSNorm pins), and after ``release`` the norm hooks left; for the first case
    also its output against the unsharded model and the pins in a graph compiled afresh."""
    from wan_sharding import apply_dit_sp_activation_sharding, shard_dit_specs
    from wan_sharding.backends.tt_norms import tp_split_norms
    from wan_sharding.models import LatentShape, build_dit, dit_inputs
    from wan_sharding.options import torch_dtype
    from wan_sharding.patches import apply_patches

    backend = _backend(preset)
    out = {}
    for case in cases:
        variant, dtype, padding, *patches = case.split(":")
        dit = build_dit(variant, dtype=torch_dtype(dtype))
        inputs = dit_inputs(variant, LatentShape(3, 10, 14), dtype=torch_dtype(dtype))  # 105 tokens -> 128
        if patches:
            apply_patches(dit, patches[0].split("+"), mesh=backend.mesh)
        with torch.no_grad():
            ref = dit(**inputs, return_dict=False)[0] if case == cases[0] else None  # unsharded, on the CPU
        placed = backend.place(dit, shard_dit_specs(dit, backend.mesh))
        sp = apply_dit_sp_activation_sharding(dit, backend.mesh, backend=backend, padding=padding)
        device_inputs = {k: v.to(backend.device) for k, v in inputs.items()}
        EAGER_CALLS.clear()
        with torch.no_grad():
            dit(**device_inputs, return_dict=False)  # lazy, not compiled: what the hooks constrain
        eager = list(EAGER_CALLS)
        GRAPHS.clear(), PINS.clear(), NORMS.clear()
        torch._dynamo.utils.counters.clear()
        with torch.no_grad():
            first = backend.run_device(dit, placed, **inputs)
            backend.run_device(dit, placed, **inputs)  # a warm call compiles nothing more
        # the output fetched (the SPMD program compiled and run: ~10 s) for the first case only
        max_abs, pcc = _max_abs_and_pcc(first.cpu(), ref) if case == cases[0] else (None, None)
        out[case] = {"eager": eager, "graphs": list(GRAPHS), "pins": list(PINS), "norms": list(NORMS),
                     "max_abs": max_abs, "pcc": pcc,
                     "breaks": {str(k): v for k, v in torch._dynamo.utils.counters["graph_break"].items()}}
        sp.remove()
        backend.release(dit)
        norms = tp_split_norms(dit).values()
        out[case]["hooks_after_release"] = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in norms)
        if case == cases[0]:  # the model compiled afresh, not through the backend: no pins left in it
            PINS.clear(), NORMS.clear()
            with torch.no_grad():
                torch.compile(dit, backend="tt", dynamic=False)(**device_inputs, return_dict=False)
            out[case]["after_release"] = {"pins": list(PINS), "norms": list(NORMS)}
            torch._dynamo.reset()
    return out


def models(n: int) -> dict:
    """``n`` tiny models compiled and run by one backend in one process: graphs per model, then
    a ``release`` and the released model compiled again."""
    from wan_sharding import apply_dit_sp_activation_sharding, shard_dit_specs
    from wan_sharding.models import LatentShape, build_dit, dit_inputs

    backend = _backend("2x4")
    inputs = dit_inputs("t2v-a14b", LatentShape(3, 10, 14))
    dits, per_model = [], []
    with torch.no_grad():
        for i in range(n):
            dit = build_dit("t2v-a14b", seed=i)
            placed = backend.place(dit, shard_dit_specs(dit, backend.mesh))
            apply_dit_sp_activation_sharding(dit, backend.mesh, backend=backend, padding="mask")
            dits.append((dit, placed))
            before = len(GRAPHS)
            backend.run_device(dit, placed, **inputs)
            backend.run_device(dit, placed, **inputs)
            per_model.append(len(GRAPHS) - before)
        # every model again, warm: nothing compiles, nothing falls back
        before = len(GRAPHS)
        for dit, placed in dits:
            backend.run_device(dit, placed, **inputs)
        warm = len(GRAPHS) - before
        first, placed = dits[0]
        backend.release(first)
        before = len(GRAPHS)
        backend.run_device(first, placed, **inputs)
        again = len(GRAPHS) - before
        # one model's input signatures past dynamo's limit: an error, not a silent uncompiled forward
        torch._dynamo.config.recompile_limit = 1
        other = dit_inputs("t2v-a14b", LatentShape(1, 32, 32))
        try:
            backend.run_device(dits[1][0], dits[1][1], **other)
            over_limit = None
        except Exception as e:  # noqa: BLE001
            over_limit = f"{type(e).__name__}: {e}"
    return {"per_model": per_model, "warm": warm, "after_release": again, "compiles": backend.compiles,
            "dropped": backend.dropped_entries, "over_limit": over_limit,
            "options": OPTIONS, "limit_hits": {str(k): v for k, v in torch._dynamo.utils.counters["stats"].items()}}


def cached(preset: str) -> dict:
    """A cache's forwards on the ``tt`` backend (the counting stand-in; each kind: FirstBlockCache,
    MagCache, TaylorSeer, PAB) and on the ``xla`` backend (torch-xla's real ``openxla`` dynamo
    backend; the block caches, whose programs it compiles through dynamo): per kind, the dynamo graphs compiled and the graph breaks (after the first
    three forwards and at the end of 4, or 6 for the per-module caches, enough to reach every
    program), the programs the backend compiled, the decisions and outputs against the unsharded
    model with the same cache; for FirstBlockCache, then the cache enabled again (new hooks): its
    programs compiled afresh, the outputs still the same."""
    from wan_sharding import apply_dit_sp_activation_sharding, shard_dit_specs
    from wan_sharding.backends.xla import XlaBackend
    from wan_sharding.caching import wan_cache_config
    from wan_sharding.caching.probes import install_probe
    from wan_sharding.mesh import mesh_from_preset
    from wan_sharding.models import LatentShape, build_dit, dit_inputs
    from wan_sharding.pipeline import ShardedTransformer

    inputs = dit_inputs("t2v-a14b", LatentShape(3, 10, 14))
    # One compiled entry per code object: every program still compiles, since each has its own
    torch._dynamo.config.recompile_limit = 1
    out = {}
    overrides = {"fbc": {"threshold": 1e9}, "mag": {"threshold": 1e9, "mag_ratios": [1.0] * 3},
                 "taylorseer": {}, "pab": {"timestep": lambda: 500}}  # skip whenever they can
    # xla replays only the block caches' programs through dynamo (the per-module ones run lazily there)
    for name, kind in [("tt", k) for k in overrides] + [("xla", "fbc"), ("xla", "mag")]:
        backend = _backend(preset) if name == "tt" else XlaBackend(mesh_from_preset(preset), native_mesh=MESH[0])
        # tt_torch turns dynamo's module inlining off; a stock torch-xla user has dynamo's default (on)
        with torch._dynamo.config.patch(inline_inbuilt_nn_modules=name != "tt"):
            config = lambda: wan_cache_config(kind, 3, **overrides[kind])  # noqa: E731
            dit, reference_dit = build_dit("t2v-a14b", num_layers=3), build_dit("t2v-a14b", num_layers=3)
            placed = backend.place(dit, shard_dit_specs(dit, backend.mesh))
            sp = apply_dit_sp_activation_sharding(dit, backend.mesh, backend=backend, padding="mask")
            model = ShardedTransformer(dit, backend, placed, "transformer", "mask", sp=sp)
            r = {"graphs": [], "max_abs": 0.0}

            def forwards(n: int) -> None:
                torch._dynamo.utils.counters.clear()
                before = len(GRAPHS)
                with torch.no_grad():
                    for step in range(n):  # runs of 3 steps (MagCache starts again after its 3)
                        with model.cache_context("cond", step_index=step % 3), \
                                reference_dit.cache_context("cond", step_index=step % 3):
                            got = model(**inputs, return_dict=False)[0]
                            ref = reference_dit(**inputs, return_dict=False)[0]
                        r["max_abs"] = max(r["max_abs"], float((got.cpu() - ref).abs().max()))
                        if step == 2:
                            r["graphs_after_first_run"] = graphs_so_far(before)
                r["graphs"].append(graphs_so_far(before))
                r.setdefault("breaks", {}).update(
                    {str(k): v for k, v in torch._dynamo.utils.counters["graph_break"].items()})

            def graphs_so_far(before: int) -> int:  # the stand-in counts its graphs; openxla through dynamo's stats
                return len(GRAPHS) - before if name == "tt" else torch._dynamo.utils.counters["stats"]["unique_graphs"]

            def programs() -> list[str]:
                if name == "tt":
                    return sorted(k[2] for k in backend._compiled[id(dit)][1] if k[0] == "cached")
                return sorted(k[1] for k in backend._cache_programs[id(dit)][2])

            model.enable_cache(config())
            reference = install_probe(reference_dit, config())
            # enough calls to reach every program: 6 for the per-module caches; fbc: compute (no
            # statistic yet), then reuse; mag: compute, reuse, reuse, compute
            forwards(6 if kind in ("taylorseer", "pab") else 4)
            r["programs"] = programs()
            r["decisions_match"] = model.cache_stats.decisions == reference.stats.decisions
            r["skipped"] = model.cache_stats.skipped()
            model.disable_cache(), reference.remove(keep_cache=False)
            if kind == "fbc":  # enabled again (the same for both kinds): new hooks, so new programs
                model.enable_cache(config())
                reference = install_probe(reference_dit, config())
                forwards(2)
                r["programs_again"] = programs()
                r["decisions_match_again"] = model.cache_stats.decisions == reference.stats.decisions
                model.disable_cache(), reference.remove(keep_cache=False)
            sp.remove()
            backend.release(dit)
            out[f"{name}-{kind}"] = r
    torch._dynamo.reset()
    return out


def prompt_states(preset: str) -> dict:
    """The ``prompt_kv`` patch through a pipeline's stand-in. On the ``tt`` backend: two prompts, the
    first again (as the guidance branches alternate), then a third: the dynamo graphs of those
    forwards (the prompt state comes in as the step's inputs; the prompt programs run lazily,
    outside dynamo), their constraints and pins, the prompt programs run, the outputs against the
    unsharded model. Then with FirstBlockCache, two steps of two prompts (the guidance branches in
    their cache contexts), on ``tt`` and on ``xla``: graphs, decisions and outputs against the
    unsharded model with the same cache."""
    from wan_sharding import apply_dit_sp_activation_sharding, shard_dit_specs
    from wan_sharding.backends.xla import XlaBackend
    from wan_sharding.caching import wan_cache_config
    from wan_sharding.caching.probes import install_probe
    from wan_sharding.mesh import mesh_from_preset
    from wan_sharding.models import LatentShape, build_dit, dit_inputs
    from wan_sharding.patches import apply_patches
    from wan_sharding.patches.prompt_kv import prompt_cache
    from wan_sharding.pipeline import ShardedTransformer

    inputs = dit_inputs("t2v-a14b", LatentShape(3, 10, 14))
    generator = torch.Generator().manual_seed(5)
    prompts = [inputs["encoder_hidden_states"]] + [torch.randn(inputs["encoder_hidden_states"].shape,
                                                               generator=generator) for _ in range(2)]

    def sharded(backend, dit):
        apply_patches(dit, ["rope", "qkv", "prompt_kv"], mesh=backend.mesh)
        placed = backend.place(dit, shard_dit_specs(dit, backend.mesh))
        sp = apply_dit_sp_activation_sharding(dit, backend.mesh, backend=backend, padding="mask")
        return ShardedTransformer(dit, backend, placed, "transformer", "mask", sp=sp), sp

    def counted(run) -> dict:
        GRAPHS.clear(), PINS.clear(), NORMS.clear()
        torch._dynamo.utils.counters.clear()
        out = run()
        out.update(graphs=list(GRAPHS), pins=list(PINS), norms=list(NORMS),
                   breaks={str(k): v for k, v in torch._dynamo.utils.counters["graph_break"].items()})
        return out

    backend = _backend(preset)
    dit = build_dit("t2v-a14b")
    with torch.no_grad():
        refs = [dit(**{**inputs, "encoder_hidden_states": p}, return_dict=False)[0] for p in prompts]
    model, sp = sharded(backend, dit)

    def forwards() -> dict:
        worst = 0.0
        with torch.no_grad():
            for i in (0, 1, 0, 2):
                got = model(**{**inputs, "encoder_hidden_states": prompts[i]}, return_dict=False)[0]
                worst = max(worst, _max_abs_and_pcc(got, refs[i])[0])
        cache = prompt_cache(dit)
        return {"max_abs": worst, "computed": cache.computed, "reused": cache.reused, "compiles": backend.compiles}

    out = {"forwards": counted(forwards)}
    sp.remove()
    backend.release(dit)

    for name in ("tt", "xla"):
        backend = _backend(preset) if name == "tt" else XlaBackend(mesh_from_preset(preset), native_mesh=MESH[0])
        with torch._dynamo.config.patch(inline_inbuilt_nn_modules=name != "tt"):
            config = lambda: wan_cache_config("fbc", 2, threshold=1e9)  # noqa: E731  (skip whenever it may)
            dit, reference = build_dit("t2v-a14b"), build_dit("t2v-a14b")
            model, sp = sharded(backend, dit)
            model.enable_cache(config())
            probe = install_probe(reference, config())

            def cached() -> dict:
                worst = 0.0
                with torch.no_grad():
                    for step in range(2):
                        for context, prompt in (("cond", prompts[0]), ("uncond", prompts[1])):
                            x = {**inputs, "encoder_hidden_states": prompt}
                            with model.cache_context(context, step_index=step), \
                                    reference.cache_context(context, step_index=step):
                                got = model(**x, return_dict=False)[0]
                                ref = reference(**x, return_dict=False)[0]
                            worst = max(worst, _max_abs_and_pcc(got.cpu(), ref)[0])
                cache = prompt_cache(dit)
                return {"max_abs": worst, "computed": cache.computed, "reused": cache.reused,
                        "decisions_match": model.cache_stats.decisions == probe.stats.decisions,
                        "skipped": model.cache_stats.skipped()}

            out[f"{name}-fbc"] = counted(cached)
            model.disable_cache(), probe.remove(keep_cache=False)
            sp.remove()
            backend.release(dit)
    torch._dynamo.reset()
    return out


if __name__ == "__main__":
    preset, parts, n, *cases = sys.argv[1:]
    run = {"cases": lambda: graphs(preset, cases), "models": lambda: models(int(n)),
           "cached": lambda: cached(preset), "prompt": lambda: prompt_states(preset)}
    print("RESULT " + json.dumps({part: run[part]() for part in parts.split(",")}))
