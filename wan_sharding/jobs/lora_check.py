"""A tiny Wan pipeline with LoRA adapters, sharded against unsharded, with the adapters switched on
the mesh: one case runs in one worker process (its backend's stack) and returns its figures.

The adapters are made in code (``wan_sharding.lora.tiny``): ``a`` in Wan's original key format with
``diff_b`` biases on every targeted Linear of the high-noise expert, ``b`` in diffusers' format on
its blocks only (another rank), ``c`` on the low-noise expert, and ``d``, ``a``'s rank and targets
with other values, swapped in with ``hotswap=True``. Each state (two sets of weights, adapters
disabled, the hotswap) is run unsharded and sharded; the compiles after each state show which
switches reuse the compiled forward. ``python -m wan_sharding.jobs.lora_check '<case JSON>'`` runs
one case and prints ``RESULT <json>``.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

# the switching states: (name, weights of a, b, c) or adapters disabled
STATES = (("weights", (0.8, 1.3, 0.7)), ("new weights", (0.5, 0.2, 1.1)), ("disabled", None), ("enabled", (0.5, 0.2, 1.1)))


def compiles(backend: Any) -> int | None:
    """Forward compiles so far: the backend's own count (``jax``: traces; ``tt``: ``torch.compile``
    calls), or torch-xla's compile counter (``xla``)."""
    if backend.name == "xla":
        import torch_xla.debug.metrics as met

        data = met.metric_data("CompileTime")
        return int(data[0]) if data else 0
    return backend.compiles


def _apply(pipe: Any, names: list[str], weights: tuple | None) -> None:
    if weights is None:
        pipe.disable_lora()
    else:
        pipe.enable_lora()
        pipe.set_adapters(names, list(weights[: len(names)]))


def run_case(**case: Any) -> dict[str, Any]:
    """One case (module docstring): ``{"states": [{state, pcc, max_abs, compiles}], "hotswap": ...}``;
    the adapter files live in a temporary folder removed after."""
    with tempfile.TemporaryDirectory(prefix="lora-check-") as tmp:
        return _run_case(Path(tmp), **case)


def _run_case(tmp: Path, variant: str = "t2v-a14b", backend: str = "jax", mesh: str = "2x4", cfg: bool = False,
              cache: str | None = None, steps: int = 2, fuse: bool = False, rank: int = 4) -> dict[str, Any]:
    import torch

    if backend == "xla":
        from ..backends.xla import enable_spmd

        enable_spmd()
    else:
        from ..pipeline import diffusers_without_torch_xla

        diffusers_without_torch_xla()
    from ..caching import enable_pipeline_cache, reset_pipeline_cache
    from ..lora.files import LoraRequest
    from ..lora.load import load_loras
    from ..lora.tiny import write_adapter
    from ..mesh import with_cfg
    from ..pipeline import shard_pipeline
    from ..pipeline.tiny import build_tiny_pipeline, call_kwargs
    from .pcc import compare

    torch.manual_seed(0)
    pipe = build_tiny_pipeline(variant, text_encoder=False)
    two = getattr(pipe, "transformer_2", None) is not None
    first = pipe.transformer
    requests = [LoraRequest(str(write_adapter(tmp / "a.safetensors", first, rank=rank, seed=1, fmt="wan", bias=True)), 0.8),
                LoraRequest(str(write_adapter(tmp / "b.safetensors", first, rank=2 * rank, seed=2, blocks_only=True)), 1.3)]
    if two:
        requests.append(LoraRequest(str(write_adapter(tmp / "c.safetensors", pipe.transformer_2, rank=rank, seed=3)),
                                    0.7, "transformer_2"))
    names = load_loras(pipe, requests)
    swap = write_adapter(tmp / "d.safetensors", first, rank=rank, seed=4, fmt="wan", bias=True)
    if cache:
        enable_pipeline_cache(pipe, cache, steps)

    def run() -> torch.Tensor:
        if cache:
            reset_pipeline_cache(pipe)
        return pipe(**call_kwargs(pipe, steps=steps), output_type="latent").frames

    states = STATES[:1] if fuse else STATES
    refs = []
    for _, weights in states:
        _apply(pipe, names, weights)
        refs.append(run())
    _apply(pipe, names, states[0][1])
    handle = shard_pipeline(pipe, with_cfg(mesh) if cfg else mesh, backend=backend, lora="fuse" if fuse else "layers")
    out: dict[str, Any] = {"variant": variant, "backend": backend, "mesh": mesh, "cfg": cfg, "cache": cache,
                           "fuse": fuse, "adapters": names, "states": []}
    be = handle.resolved.backend
    for (state, weights), ref in zip(states, refs):
        _apply(pipe, names, weights)
        p, m = compare(ref, run())
        out["states"].append({"state": state, "pcc": p, "max_abs": m, "compiles": compiles(be)})
    if not fuse:
        _apply(pipe, names, STATES[1][1])
        pipe.load_lora_weights(str(swap), adapter_name="a", hotswap=True)
        sharded = run()
        after = compiles(be)
        handle.remove()
        p, m = compare(run(), sharded)
        # moved: how far the swap moved the output from the same weights before it (not a no-op)
        out["hotswap"] = {"pcc": p, "max_abs": m, "compiles": after, "moved": compare(refs[1], sharded)[1]}
    else:
        handle.remove()
    out["restored"] = all(not type(getattr(pipe, n)).__name__.startswith("Sharded")
                          for n in ("transformer", "transformer_2") if getattr(pipe, n, None) is not None)
    return out


def main(argv: list[str] | None = None) -> None:
    """Runs the case (a JSON object) or cases (a JSON list) given, one ``RESULT`` line each."""
    cases = json.loads((argv if argv is not None else sys.argv[1:])[0])
    for case in cases if isinstance(cases, list) else [cases]:
        print("RESULT " + json.dumps(run_case(**case)), flush=True)


if __name__ == "__main__":
    main()


def block_bill(rank: int = 4, mesh: str = "2x4", variant: str = "t2v-a14b", blocks: int = 2) -> dict[str, Any]:
    """What an adapter on every Linear of the blocks adds to one compiled forward of the tiny DiT on
    ``mesh`` (jax, partitioned HLO), per block: instructions, collectives by kind and their bytes."""
    import copy

    from ..pipeline import diffusers_without_torch_xla

    diffusers_without_torch_xla()
    from diffusers.loaders.lora_conversion_utils import _convert_non_diffusers_wan_lora_to_diffusers

    from ..compose import shard_dit
    from ..lora.tiny import adapter_state
    from ..models import build_dit, dit_inputs, latent_for_tokens

    base = build_dit(variant, num_layers=blocks)
    inputs = dit_inputs(variant, latent_for_tokens(48))
    out: dict[str, Any] = {"variant": variant, "mesh": mesh, "rank": rank, "blocks": blocks}
    for name in ("base", "lora"):
        dit = copy.deepcopy(base)
        if name == "lora":
            state = adapter_state(dit, rank=rank, fmt="wan", blocks_only=True)
            dit.load_lora_adapter(_convert_non_diffusers_wan_lora_to_diffusers(state), adapter_name="a")
        handle = shard_dit(dit, mesh, backend="jax")
        out[name] = hlo_bill(handle.backend.compile(dit, handle.placed, **inputs).text)
        handle.remove()
    out["per_block"] = {k: (out["lora"][k] - out["base"].get(k, 0)) / blocks for k in out["lora"]}
    return out


def hlo_bill(text: str) -> dict[str, int]:
    """Instructions of a partitioned HLO module's entry computation and below, and each collective
    kind's count and output bytes (``all-reduce``, ``all-reduce bytes``, ...)."""
    import re

    sizes = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "pred": 1, "u32": 4, "s64": 8}
    bill = {"instructions": 0}
    for line in text.splitlines():
        m = re.match(r"\s*(?:ROOT )?%?[\w.\-]+ = (\w+)\[([\d,]*)\][^ ]* ([\w\-]+)\(", line)
        if not m:
            continue
        bill["instructions"] += 1
        dtype, dims, op = m.groups()
        kind = op.removesuffix("-start")
        if kind in ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute"):
            n = 1
            for d in filter(None, dims.split(",")):
                n *= int(d)
            bill[kind] = bill.get(kind, 0) + 1
            bill[f"{kind} bytes"] = bill.get(f"{kind} bytes", 0) + n * sizes.get(dtype, 4)
    return bill
