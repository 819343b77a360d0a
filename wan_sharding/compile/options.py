"""tt-mlir compile options for the compile-only client, spelled as tt-xla's plugin reads them.

tt-xla's PJRT plugin parses its compile options by key (``pjrt_implementation/src/api/
compile_options.cc``): ``optimization_level`` (an integer), ``experimental-enable-dram-space-
saving-optimization`` (hyphenated) and ``enable_trace`` (booleans as ``true``/``false``/``1``/
``0``/``yes``/``no``/``on``/``off``). The defaults are Tenstorrent's Wan 2.2 test settings, taken
from :class:`wan_sharding.backends.tt.TTCompileOptions` (tt-xla ``tests/torch/models/wan14b/
shared.py``: level 1, DRAM space saving on, trace on).

Where level >= 1 cannot run here, :func:`effective_options` lowers it and says why in one line:
at level >= 1 tt-mlir's optimizer validates every op on tt-metal's mock device, which JIT-builds
RISC-V firmware with the SFPI toolchain shipped in the plugin's runtime assets; that toolchain
carries the C++ headers for Blackhole's multilib only, so on Wormhole the firmware build fails
(``brisc build failed``, ``bits/c++config.h: No such file or directory``) and the compiler dies.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields, replace
from typing import Any

# Our field name -> the key tt-xla's plugin reads.
PLUGIN_KEYS = {
    "optimization_level": "optimization_level",
    "dram_space_saving": "experimental-enable-dram-space-saving-optimization",
    "enable_trace": "enable_trace",
}
# Opt-in options the plugin reads that hardware's Wan tests leave at their default (off); sent
# only when on. ``enable_activation_dtype_lowering`` (tt-xla #5396; tt-mlir's TTNN
# ``TTNNCCLActivationDtypeLowering``, #8701): a matmul -> collective -> add chain runs in bfp8.
OPT_IN_KEYS = {"activation_dtype_lowering": "enable_activation_dtype_lowering"}
# Opt-in options a plugin version does not parse: it fails the compile ("No such compile option").
# jax-tt-plugin 0.1.3's tt-mlir has the bfp8 pass (``ttnn-ccl-activation-dtype-lowering``), but its
# tt-xla does not take the option that turns it on (seen here, 2026-12-06).
NOT_IN_PLUGIN = {"0.1.3": ("activation_dtype_lowering",)}
LEVELS = (0, 1, 2)
_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off")
# Archs whose level >= 1 compile cannot run on this plugin's mock device, and why (one line).
LEVEL1_BLOCKED = {
    "wormhole_b0": ("optimization level >= 1 needs tt-metal's mock Wormhole device, whose firmware JIT build fails "
                    "with the plugin's SFPI toolchain (no Wormhole multilib C++ headers: bits/c++config.h missing; "
                    "'brisc build failed'); compiled at optimization_level=0"),
}


# The chip counts tt-metal's mock device has a cluster description for (tt-metal
# `tt_metal/impl/device/mock_device_util.cpp`, `get_mock_cluster_desc_name`: N150/N300, 2x2, T3K,
# Galaxy; P150, P300, 4xP150, 8xP150, Galaxy); any other count throws "Unsupported mock device
# configuration", so a 64- or 128-chip mesh cannot run level >= 1 here.
MOCK_DEVICE_CHIPS = (1, 2, 4, 8, 32)


def _defaults() -> dict[str, Any]:
    from ..backends.tt import TTCompileOptions

    d = TTCompileOptions()
    return {"optimization_level": d.optimization_level,
            "dram_space_saving": d.experimental_enable_dram_space_saving_optimization,
            "enable_trace": d.enable_trace}


@dataclass(frozen=True)
class CompileOptions:
    """The three options tt-xla's Wan tests set, with their defaults (hardware's), and the opt-in
    bfp8 collectives (:data:`OPT_IN_KEYS`, off as on hardware)."""

    optimization_level: int = 1
    dram_space_saving: bool = True
    enable_trace: bool = True
    activation_dtype_lowering: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.optimization_level, bool) or self.optimization_level not in LEVELS:
            raise ValueError(f"optimization_level must be one of {LEVELS}, got {self.optimization_level!r}")
        for name in ("dram_space_saving", "enable_trace", "activation_dtype_lowering"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")

    @classmethod
    def hardware(cls) -> "CompileOptions":
        """tt-xla's Wan settings (the tt backend's ``TTCompileOptions`` defaults)."""
        return cls(**_defaults())

    @classmethod
    def parse(cls, text: str | dict[str, Any] | None) -> "CompileOptions":
        """Options from ``"key=value,key=value"``, a JSON object or a dict, over the hardware
        defaults. Keys: our names or the plugin's (``optimization_level``,
        ``experimental-enable-dram-space-saving-optimization`` / ``dram_space_saving``,
        ``enable_trace``); ``ValueError`` names an unknown key or a bad value."""
        values = _defaults()
        if text is None:
            return cls(**values)
        if isinstance(text, str):
            text = text.strip()
            if text.startswith("{"):
                try:
                    items = json.loads(text)
                except ValueError as e:
                    raise ValueError(f"compile options are not valid JSON ({e}); give key=value,... or a JSON object") from None
            else:
                items = {}
                for part in filter(None, (p.strip() for p in text.split(","))):
                    key, eq, value = part.partition("=")
                    if not eq:
                        raise ValueError(f"compile option {part!r} has no value; write key=value")
                    items[key.strip()] = value.strip()
        else:
            items = dict(text)
        keys = {**PLUGIN_KEYS, **OPT_IN_KEYS}
        by_key = {**{k: k for k in keys}, **{v: k for k, v in keys.items()},
                  "experimental_enable_dram_space_saving_optimization": "dram_space_saving"}
        for key, value in items.items():
            if key not in by_key:
                raise ValueError(f"unknown compile option {key!r}; known: {', '.join(keys.values())}")
            name = by_key[key]
            values[name] = _level(value) if name == "optimization_level" else _bool(name, value)
        return cls(**values)

    def plugin_options(self) -> dict[str, str]:
        """The options as the plugin's compile-option strings (an opt-in one only when on)."""
        out = {PLUGIN_KEYS[f.name]: _str(getattr(self, f.name)) for f in fields(self) if f.name in PLUGIN_KEYS}
        out.update({key: "true" for name, key in OPT_IN_KEYS.items() if getattr(self, name)})
        return out

    def to_json(self) -> dict[str, Any]:
        """Every field, an opt-in one only when on."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.name not in OPT_IN_KEYS or getattr(self, f.name)}

    def differs_from(self, other: "CompileOptions") -> list[str]:
        """Plugin keys whose value here is not ``other``'s, as ``key=ours (other's)``."""
        keys = {**PLUGIN_KEYS, **OPT_IN_KEYS}
        return [f"{keys[f.name]}={_str(getattr(self, f.name))} (hardware: {_str(getattr(other, f.name))})"
                for f in fields(self) if getattr(self, f.name) != getattr(other, f.name)]


def check_plugin_support(options: CompileOptions, plugin_version: str | None) -> None:
    """ValueError (one line) when ``options`` turn on an opt-in option the installed plugin does not
    parse (:data:`NOT_IN_PLUGIN`), before any worker starts."""
    for name in NOT_IN_PLUGIN.get(plugin_version or "", ()):
        if getattr(options, name):
            raise ValueError(f"compile option {OPT_IN_KEYS[name]} is not one jax-tt-plugin {plugin_version} parses (its "
                             "tt-mlir has the pass, its tt-xla not the option: 'No such compile option'); leave it out, "
                             "or install a plugin that takes it")


def effective_options(requested: CompileOptions, arch: str,
                      num_chips: int | None = None) -> tuple[CompileOptions, str | None]:
    """What can be compiled here for ``arch`` on ``num_chips``: ``requested``, or level 0 with the reason."""
    why = LEVEL1_BLOCKED.get(arch)
    if why is None and num_chips is not None and num_chips not in MOCK_DEVICE_CHIPS:
        why = (f"optimization level >= 1 runs tt-metal's mock device, which has no {num_chips}-chip configuration "
               f"(only {', '.join(map(str, MOCK_DEVICE_CHIPS))} chips); compiled at optimization_level=0")
    if why and requested.optimization_level >= 1:
        return replace(requested, optimization_level=0), why
    return requested, None


def _str(v: Any) -> str:
    return ("true" if v else "false") if isinstance(v, bool) else str(v)


def _bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    s = str(value).strip().lower()
    if s in _TRUE:
        return True
    if s in _FALSE:
        return False
    raise ValueError(f"compile option {({**PLUGIN_KEYS, **OPT_IN_KEYS})[name]} must be true or false, got {value!r}")


def _level(value: Any) -> int:
    try:
        level = int(str(value).strip()) if not isinstance(value, bool) else -1
    except ValueError:
        level = -1
    if level not in LEVELS:
        raise ValueError(f"compile option optimization_level must be one of {LEVELS}, got {value!r}")
    return level
