"""LoRA files and what a command asks for: ``PATH[:SCALE][:EXPERT]``, the file read (safetensors
only), and an adapter's state dict checked against an expert before anything is loaded.

Every refusal is a :class:`~wan_sharding.lora_layers.LoraError`, one line naming the problem and
the fix, raised before the model changes: a missing, pickled or corrupt file, an adapter for a
module the DiT or the TP plan does not have, shapes of another Wan variant, a hotswap whose rank
or targets differ from the adapter it replaces, a DoRA adapter.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch

from ..lora_layers import BASE, LoraError, lora_modules, parameter_role
from ..plan import COLWISE, REPLICATE, ROWWISE, WAN_TP_TABLE
from ..specs import pattern_regex

EXPERTS = ("transformer", "transformer_2", "both")
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # a served adapter's name: what a request sends
# diffusers reads these as pickles (torch.load); a request never makes this package unpickle a file
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


@dataclass(frozen=True)
class LoraRequest:
    """One adapter a command loads: its file, its weight in ``set_adapters`` and the expert(s) it
    goes into (``transformer``: diffusers' default; ``transformer_2`` is its
    ``load_into_transformer_2=True``; ``both``); ``adapter``: its name (``serve --lora NAME=PATH``),
    else the file's stem."""

    path: str
    scale: float = 1.0
    expert: str = "transformer"
    adapter: str = ""

    @property
    def name(self) -> str:
        """The adapter name: ``adapter``, else the file's stem."""
        return self.adapter or Path(self.path).stem.replace(".", "_")

    def to_arg(self) -> str:
        return f"{self.path}:{self.scale:g}:{self.expert}"


def parse_lora_arg(text: str) -> LoraRequest:
    """``PATH[:SCALE][:EXPERT]`` (``--lora``) as a :class:`LoraRequest`; :class:`LoraError` for a
    scale that is not a number or an unknown expert."""
    path, scale, expert = text, 1.0, "transformer"
    parts = text.split(":")
    if len(parts) >= 2 and parts[-1] in EXPERTS:
        expert, parts = parts[-1], parts[:-1]
    if len(parts) >= 2:
        try:
            scale = float(parts[-1])
            parts = parts[:-1]
        except ValueError:
            if len(parts) == 2 and not parts[-1].endswith((".safetensors", "/")):
                raise LoraError(f"--lora {text!r}: scale {parts[-1]!r} is not a number; write PATH[:SCALE][:EXPERT], "
                                f"e.g. style.safetensors:0.8 (EXPERT one of {', '.join(EXPERTS)})") from None
    path = ":".join(parts)
    if not path:
        raise LoraError(f"--lora {text!r} names no file; write PATH[:SCALE][:EXPERT]")
    return LoraRequest(path, scale, expert)


def parse_named_lora_arg(text: str) -> LoraRequest:
    """``NAME=PATH[:EXPERT]`` (``serve --lora``) as a :class:`LoraRequest` named ``NAME`` (a
    request picks it by that name and gives its scale); :class:`LoraError` for a missing or odd
    name or a scale in the argument."""
    name, eq, rest = text.partition("=")
    if not eq or not rest:
        raise LoraError(f"--lora {text!r}: a served adapter needs a name; write NAME=PATH[:EXPERT], e.g. "
                        "distill=distill.safetensors (a request picks it by NAME)")
    if not NAME.fullmatch(name):
        raise LoraError(f"--lora {text!r}: the name {name!r} is not 1-64 letters, digits, '_' or '-'; pick such a name")
    r = parse_lora_arg(rest)
    if r.path != rest.removesuffix(f":{r.expert}"):  # a SCALE was parsed off the path
        raise LoraError(f"--lora {text!r}: a served adapter's scale is each request's; write NAME=PATH[:EXPERT] and "
                        f'send "loras": [{{"name": "{name}", "scale": S}}] with a job')
    return LoraRequest(r.path, 1.0, r.expert, name)


def read_lora_file(path: str | Path) -> dict[str, torch.Tensor]:
    """The tensors of a ``.safetensors`` LoRA file; :class:`LoraError` for a missing file, a
    pickle (``.bin``, ``.pt``, ...: never unpickled), or a file that is not valid safetensors."""
    p = Path(path)
    if p.suffix.lower() in PICKLE_SUFFIXES:
        raise LoraError(f"LoRA file {str(p)!r} is a pickle ({p.suffix}), which can run code when read; convert it to "
                        ".safetensors (safetensors.torch.save_file) and pass that")
    if not p.is_file():
        raise LoraError(f"LoRA file {str(p)!r} does not exist; pass the path of a .safetensors adapter")
    from safetensors.torch import load_file

    try:
        state = load_file(str(p))
    except Exception as e:  # safetensors raises its own error types for a bad header or size
        raise LoraError(f"LoRA file {str(p)!r} is not a valid safetensors file ({str(e).splitlines()[0][:120]}); "
                        "pass an adapter saved with safetensors") from None
    if not state:
        raise LoraError(f"LoRA file {str(p)!r} holds no tensors; pass an adapter file")
    return state


def converted_state(path: str | Path) -> dict[str, torch.Tensor]:
    """A LoRA file read (:func:`read_lora_file`) and converted as the Wan pipelines' own
    ``load_lora_weights`` converts it (``WanPipeline.lora_state_dict``: Wan's original keys, ``diff_b``
    biases, other trainers' formats) into diffusers' keys; :class:`LoraError` for a format it cannot
    convert."""
    from diffusers.pipelines.wan.pipeline_wan import WanPipeline

    state = read_lora_file(path)
    try:
        converted = WanPipeline.lora_state_dict(dict(state))
    except (ValueError, KeyError, RuntimeError) as e:  # diffusers' converters on keys they do not know
        raise LoraError(f"LoRA file {str(path)!r} is in a key format diffusers cannot convert for Wan "
                        f"({str(e).splitlines()[0][:120]}); pass a diffusers / PEFT or Wan-format adapter") from None
    return converted[0] if isinstance(converted, tuple) else converted


def _plan_style(path: str) -> str | None:
    for pattern, style in WAN_TP_TABLE.items():
        if pattern_regex(pattern).match(path):
            return style
    return None


def adapter_targets(state: Mapping[str, torch.Tensor], prefix: str | None = "transformer") -> dict[str, dict[str, Any]]:
    """``{module path: {"lora_A": tensor, "lora_B": tensor, "bias": tensor?}}`` of a diffusers /
    PEFT-format adapter state dict (keys under ``prefix.`` when any key has it)."""
    keys = list(state)
    if prefix and any(k.startswith(prefix + ".") for k in keys):
        keys = [k for k in keys if k.startswith(prefix + ".")]
        strip = len(prefix) + 1
    else:
        strip = 0
    out: dict[str, dict[str, Any]] = {}
    for key in keys:
        name = key[strip:]
        try:
            owner, role = parameter_role(name)
        except LoraError as e:
            raise LoraError(f"adapter key {key!r}: {e}") from None
        if role == BASE:
            raise LoraError(f"adapter key {key!r} is not a LoRA weight (lora_A / lora_B); load a LoRA adapter file, "
                            "not a model checkpoint")
        part = "bias" if name.endswith(".bias") else role
        out.setdefault(owner, {})[part] = state[key]
    return out


def check_adapter_state(dit: torch.nn.Module, state: Mapping[str, torch.Tensor], prefix: str | None = "transformer",
                        hotswap_of: str | None = None) -> dict[str, dict[str, Any]]:
    """Check an adapter's state dict against ``dit`` before it is loaded; its targets when it fits.

    Raises :class:`LoraError` (one line) for a target module the DiT does not have or the TP plan
    does not split as a Linear, shapes of another variant, and with ``hotswap_of`` (the adapter
    name it replaces) a rank or a set of targets other than that adapter's."""
    targets = adapter_targets(state, prefix)
    if not targets:
        raise LoraError(f"the adapter has no weights for this expert (no key under {prefix!r}); load it into the "
                        "expert it was trained for")
    modules = dict(dit.named_modules())
    layers = lora_modules(dit)
    for path, parts in sorted(targets.items()):
        module = modules.get(path)
        style = _plan_style(path)
        if module is None:
            raise LoraError(f"the adapter targets {path!r}, which this DiT ({dit.config.num_layers} blocks) does not "
                            "have; it was made for another Wan variant: load an adapter for this one")
        base = getattr(module, "base_layer", module)
        if not isinstance(base, torch.nn.Linear) or style not in (COLWISE, ROWWISE, REPLICATE):
            raise LoraError(f"the adapter targets {path!r} ({type(base).__name__}), which the TP plan does not split as "
                            "a Linear; load an adapter for the DiT's Linear layers only")
        a, b = parts.get("lora_A"), parts.get("lora_B")
        if a is None or b is None or a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
            raise LoraError(f"the adapter's weights for {path!r} are not a lora_A (rank x in) and lora_B (out x rank) "
                            "pair; the file is incomplete or not a LoRA")
        if a.shape[1] != base.in_features or b.shape[0] != base.out_features:
            raise LoraError(f"the adapter's {path!r} is {b.shape[0]}x{a.shape[1]} but this DiT's is "
                            f"{base.out_features}x{base.in_features}: it was made for another Wan variant; load an "
                            "adapter for this one")
        if hotswap_of is not None:
            old = layers.get(path)
            if old is None or hotswap_of not in old.lora_A:
                raise LoraError(f"hotswap: adapter {hotswap_of!r} has no layer at {path!r}; a hotswap replaces an "
                                "adapter with one of the same targets: load it without hotswap instead")
            if old.r[hotswap_of] != a.shape[0]:
                raise LoraError(f"hotswap: {path!r} has rank {a.shape[0]} but adapter {hotswap_of!r} has rank "
                                f"{old.r[hotswap_of]}; a hotswap keeps the rank: load it without hotswap instead")
    if hotswap_of is not None:
        if not any(hotswap_of in m.lora_A for m in layers.values()):
            raise LoraError(f"hotswap: no adapter {hotswap_of!r} is loaded to swap; load it without hotswap first")
        missing = sorted(p for p, m in layers.items() if hotswap_of in m.lora_A and p not in targets)
        if missing:
            raise LoraError(f"hotswap: adapter {hotswap_of!r} also targets {missing[0]!r}, which the new one does "
                            "not; a hotswap keeps the targets: load it without hotswap instead")
    return targets
