"""``--lora PATH[:SCALE][:EXPERT]`` (repeatable) and ``--lora-mode`` on ``generate`` and
``profile``: the files read and each adapter checked against the variant's expert before any
worker starts (a bad one: one line, exit 2); the worker loads them as diffusers does
(``wan_sharding.lora.load``) and shards the pipeline with them."""

from __future__ import annotations

import argparse
from typing import Any

from ..jobs.requests import UsageError
from ..lora.files import EXPERTS

LORA_HELP = ("a LoRA adapter (.safetensors, diffusers / PEFT or Wan's original keys) with its weight and expert: "
             f"PATH[:SCALE][:EXPERT], EXPERT one of {', '.join(EXPERTS)} (default transformer, as diffusers' "
             "load_lora_weights; transformer_2 is the low-noise expert); repeat for several")


def add_lora(ap: argparse.ArgumentParser) -> None:
    """``--lora`` (repeatable) and ``--lora-mode layers|fuse``."""
    ap.add_argument("--lora", action="append", default=[], metavar="PATH[:SCALE][:EXPERT]", help=LORA_HELP)
    ap.add_argument("--lora-mode", default="layers", choices=["layers", "fuse"],
                    help="layers: each adapter's weights split beside its base's, switchable on the mesh (default); "
                         "fuse: merged into the base weights before sharding, no extra op per block")


def add_serve_lora(ap: argparse.ArgumentParser) -> None:
    """``serve --lora NAME=PATH[:EXPERT]`` (repeatable): adapters loaded once at start, picked by
    name (with a scale) per request."""
    ap.add_argument("--lora", action="append", default=[], metavar="NAME=PATH[:EXPERT]",
                    help="register a LoRA adapter (.safetensors only) under NAME, loaded into the resident pipeline "
                         f"once; EXPERT one of {', '.join(EXPERTS)} (default transformer); a job picks adapters by "
                         'name with a scale ("loras": [{"name": NAME, "scale": S}]); repeat for several')


def _meta_expert(variant: str, model: str | None) -> Any:
    """The variant's expert on the ``meta`` device (names and shapes only): the tiny config, or the
    checkpoint's ``transformer/config.json``."""
    import torch

    from ..models import build_dit

    if model is None:
        return build_dit(variant, "tiny", device="meta")
    from diffusers import WanTransformer3DModel

    with torch.device("meta"):
        return WanTransformer3DModel.from_config(WanTransformer3DModel.load_config(model, subfolder="transformer"))


def validate_lora(args: argparse.Namespace, serve: bool = False) -> None:
    """Every ``--lora`` parsed (``PATH[:SCALE][:EXPERT]``; with ``serve``: ``NAME=PATH[:EXPERT]``),
    read and checked against the expert it goes into (the variant's tiny expert, or the
    checkpoint's); the parsed requests replace the strings in ``args.lora`` (as JSON-ready dicts
    for the worker)."""
    from ..lora.files import check_adapter_state, converted_state, parse_lora_arg, parse_named_lora_arg
    from ..lora_layers import LoraError

    if not getattr(args, "lora", None):
        return
    if getattr(args, "patches", None):
        from ..lora_layers import PATCHES_WITH_LORA

        rewriting = [p for p in args.patches if p not in PATCHES_WITH_LORA]
        if rewriting:
            raise UsageError(f"--patches {rewriting[0]} rewrites Linear layers that --lora adapters wrap; with --lora "
                             f"use only the patches {', '.join(PATCHES_WITH_LORA)}")
    dit = None
    requests, names = [], set()
    for text in args.lora:
        try:
            r = parse_named_lora_arg(text) if serve else parse_lora_arg(text)
            if r.expert != "transformer" and args.variant == "ti2v-5b" and getattr(args, "model", None) is None:
                raise LoraError(f"--lora {text}: TI2V-5B has one expert; leave EXPERT out (transformer)")
            if r.name in names:
                fix = "; give each its own NAME" if serve else " (from their files' names); rename one file"
                raise LoraError(f"two --lora adapters are named {r.name!r}{fix}")
            names.add(r.name)
            converted = converted_state(r.path)
            dit = dit if dit is not None else _meta_expert(args.variant, getattr(args, "model", None))
            check_adapter_state(dit, converted)
        except LoraError as e:
            raise UsageError(str(e)) from None
        requests.append({"path": r.path, "scale": r.scale, "expert": r.expert, **({"adapter": r.name} if serve else {})})
    args.lora = requests
