"""tt-mlir compile options for the tt backend, checked as tt-xla's plugin parses them.

The plugin (tt-xla ``pjrt_implementation/src/api/compile_options.cc``, ``CompileOptions::parse``)
ignores an unknown key without a word and aborts the process on a value it cannot parse, so
:class:`TTCompileOptions` checks every key and value here first (:class:`TTOptionsError`, one line).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping

from .base import BackendError

# Environment variable: JSON object of tt-mlir compile options for processes that build the backend
# themselves (the CLI's workers), e.g. '{"optimization_level": 2, "enable_trace": false}'.
COMPILE_OPTIONS_ENV = "WAN_SHARDING_TT_COMPILE_OPTIONS"

# Every option tt-xla's PJRT plugin reads, by the key it reads (tt-xla,
# ``pjrt_implementation/src/api/compile_options.cc``, ``CompileOptions::parse``; defaults and
# meanings in ``pjrt_implementation/inc/api/compile_options.h``), with the kind of value it parses.
# The plugin ignores any other key and aborts the process (``ABORT_F``) on a value it cannot
# parse, so both are checked here first. "bool": true/false/1/0/yes/no/on/off, any case.
_BOOL, _INT, _TEXT = "bool", "int", "text"
PLUGIN_OPTIONS: dict[str, Any] = {
    "optimization_level": (0, 1, 2),
    "experimental_weight_dtype": ("", "bfp_bf8", "bfp_bf4"),
    "experimental-kv-cache-dtype": _TEXT,
    "enable_activation_dtype_lowering": _BOOL,
    "math_fidelity": ("lofi", "hifi2", "hifi3", "hifi4", "ttnn_default"),
    "fp32_dest_acc_en": _BOOL,
    "experimental_enable_fusing_conv2d_with_multiply_pattern": _BOOL,
    "backend": ("default", "ttnn_flatbuffer", "codegen_cpp", "codegen_py", "codegen_load_py"),
    "export_path": _TEXT,
    "enable_trace": _BOOL,
    "export_tensors": _BOOL,
    "enable_const_eval": _BOOL,
    "enable_const_eval_on_cpu": _BOOL,
    "enable_const_eval_inputs_to_system_memory": _BOOL,
    "experimental_enable_permute_matmul_fusion": _BOOL,
    "codegen_try_recover_structure": _BOOL,
    "codegen_split_files": _BOOL,
    "experimental-enable-dram-space-saving-optimization": _BOOL,
    "enable_create_d2m_subgraphs": _BOOL,
    "ttnn_perf_metrics_enabled": _BOOL,
    "ttnn_perf_metrics_output_file": _TEXT,
    "dry_run": _BOOL,
    "target_module": _BOOL,
    "export_model_name": _TEXT,
}
_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")
# The dataclass fields, by the key the plugin reads for each (Python names cannot hold "-").
FIELD_KEYS = {"optimization_level": "optimization_level",
              "experimental_enable_dram_space_saving_optimization": "experimental-enable-dram-space-saving-optimization",
              "enable_trace": "enable_trace"}


class TTOptionsError(BackendError, ValueError):
    """A tt-mlir compile option the plugin would ignore (unknown key) or abort on (bad value)."""


def _plugin_value(key: str, value: Any) -> str:
    """``value`` as the string the plugin parses for ``key``; TTOptionsError (one line: the key,
    what it got, what it takes) otherwise."""
    kind = PLUGIN_OPTIONS.get(key)
    if kind is None:
        near = [k for k in PLUGIN_OPTIONS if k.replace("-", "_") == key.replace("-", "_")]
        hint = f"; the plugin spells it {near[0]!r}" if near else ""
        raise TTOptionsError(f"unknown tt compile option {key!r}{hint} (tt-xla's plugin would ignore it); "
                             f"options it reads: {', '.join(sorted(PLUGIN_OPTIONS))}")
    if kind == _BOOL:
        if isinstance(value, bool):
            return "true" if value else "false"
        if isinstance(value, str) and value.lower() in _TRUE + _FALSE:
            return "true" if value.lower() in _TRUE else "false"
        raise TTOptionsError(f"tt compile option {key!r} must be true or false, got {value!r}")
    if kind == _TEXT:
        if isinstance(value, str):
            return value
        raise TTOptionsError(f"tt compile option {key!r} must be a string, got {value!r}")
    text = value.lower() if isinstance(value, str) and key != "optimization_level" else value
    if isinstance(value, bool) or text not in kind:
        raise TTOptionsError(f"tt compile option {key!r} must be one of {', '.join(map(repr, kind))}, got {value!r}")
    return str(text)


@dataclass
class TTCompileOptions:
    """tt-mlir compile options for the tt backend, sent once through
    ``torch_xla.set_custom_compile_options`` (Tenstorrent's torch-xla build) before the first compile.

    The defaults are the ones Tenstorrent's own Wan 2.2 DiT tests compile with (tt-xla,
    ``tests/torch/models/wan14b/test_wan_dit.py`` and the ``run_component`` helper in
    ``tests/torch/models/wan14b/shared.py``); what each option does is as tt-xla's test compiler
    config describes it (``tests/infra/testers/compiler_config.py``). Each is sent under the key the
    plugin reads (:data:`FIELD_KEYS`, :data:`PLUGIN_OPTIONS`), as a string. Every value is checked
    when the options are made (:class:`TTOptionsError`, one line), since the plugin ignores
    unknown keys and aborts the process on a value it cannot parse.
    """

    # tt-mlir optimizer level: 0 all optimizer passes off; 1 basic optimizations (op workarounds
    # trimmed, conv2d weight const-eval prep and fusions, op validation); 2 adds memory-layout
    # optimization (sharded L1 layouts). Tenstorrent's Wan tests: 1.
    optimization_level: int = 1
    # Run the experimental DRAM space-saving pass, which reuses DRAM buffers between ops whose
    # lifetimes do not overlap to lower peak DRAM use. Tenstorrent's Wan tests: on.
    experimental_enable_dram_space_saving_optimization: bool = True
    # Hoist the device program into a TTNN trace that is captured once and replayed, removing host
    # dispatch from warm iterations. Tenstorrent's Wan tests: on.
    enable_trace: bool = True
    # Any other option tt-xla's plugin reads, by its key (e.g. {"export_path": "irs"}).
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.optimization_level, bool) or self.optimization_level not in (0, 1, 2):
            raise TTOptionsError(f"optimization_level must be 0, 1 or 2, got {self.optimization_level!r}")
        for name in ("experimental_enable_dram_space_saving_optimization", "enable_trace"):
            if not isinstance(getattr(self, name), bool):
                raise TTOptionsError(f"tt compile option {name!r} must be True or False, got {getattr(self, name)!r}")
        if not isinstance(self.extra, Mapping):
            raise TTOptionsError(f"extra tt compile options must be a mapping of option keys, got {self.extra!r}")
        for key, value in self.extra.items():
            if key in FIELD_KEYS.values():
                raise TTOptionsError(f"tt compile option {key!r} has a field of its own: set it by its field name")
            _plugin_value(key, value)
        backend = str(self.extra.get("backend", "default")).lower()
        if backend not in ("default", "ttnn_flatbuffer") and "export_path" not in self.extra:
            # the plugin aborts on this (CompileOptions::parse)
            raise TTOptionsError(f"tt compile option backend={backend!r} needs export_path (where the code goes)")

    @classmethod
    def of(cls, value: "TTCompileOptions | Mapping[str, Any] | None") -> "TTCompileOptions":
        """Options from an instance, a mapping (field names set fields, a plugin key sets its
        field, other keys go to ``extra``) or ``None`` (:data:`COMPILE_OPTIONS_ENV` if set, else
        the defaults). TTOptionsError on an unknown key or a bad value."""
        if isinstance(value, cls):
            return value
        if value is None:
            text = os.environ.get(COMPILE_OPTIONS_ENV)
            if not text:
                return cls()
            try:
                value = json.loads(text)
            except ValueError as e:
                raise TTOptionsError(f"{COMPILE_OPTIONS_ENV} is not a JSON object: {e}") from None
            if not isinstance(value, dict):
                raise TTOptionsError(f"{COMPILE_OPTIONS_ENV} must be a JSON object, got {text!r}")
        by_key = {k: f for f, k in FIELD_KEYS.items()}
        fields: dict[str, Any] = {}
        extra = dict(value.get("extra") or {})
        for k, v in value.items():
            if k in FIELD_KEYS or k in by_key:
                fields[by_key.get(k, k)] = v
            elif k != "extra":
                extra[k] = v
        return cls(**fields, extra=extra)

    def to_torch_xla(self) -> dict[str, str]:
        """The dict for ``torch_xla.set_custom_compile_options``: the plugin's keys, string values."""
        fields = {FIELD_KEYS[k]: v for k, v in asdict(self).items() if k != "extra"}
        return {k: _plugin_value(k, v) for k, v in {**fields, **self.extra}.items()}
