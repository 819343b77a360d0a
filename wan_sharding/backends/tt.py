"""Tenstorrent's own torch stack: tt-xla's torch plugin (``pjrt-plugin-tt``, ``tt_torch``).

Weights are marked like stock torch-xla (``xs.mark_sharding`` on the TT device); activations go
through ``tt_torch.sharding.sharding_constraint_tensor``, which emits a ``tt.sharding_constraint``
custom call that tt-mlir turns into ``sdy.sharding_constraint``. The model is compiled with
``torch.compile(dit, backend="tt")`` once per model and input signature (shapes, dtypes, which
inputs are ``None``) and that compiled module is reused: a fresh ``torch.compile`` wrapper per call
would trace and compile the whole DiT again every time, which is what Tenstorrent's Wan test
helpers avoid with a process-level cache keyed by model and input shapes (tt-xla,
``tests/torch/models/wan14b/shared.py``, ``run_component``). The tt-mlir compiler options
(:class:`TTCompileOptions`) go to ``torch_xla.set_custom_compile_options`` before the first compile.

That stack comes from Tenstorrent's package index with their torch-xla build and cannot be
installed here; ``tests/test_tt_contract.py`` checks what this backend sends to it with stand-ins.
:func:`check_tt_stack` says, without importing torch-xla, whether this machine has it.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping

import torch

from ..mesh import MeshSpec
from ..specs import Spec
from .base import BackendError, input_signature
from .xla import XlaBackend

# Where Tenstorrent's stack comes from (tt-xla's release notes install pjrt-plugin-tt this way).
TT_INDEX = "https://pypi.eng.aws.tenstorrent.com/"
TT_INSTALL = f"pip install pjrt-plugin-tt --extra-index-url {TT_INDEX}"
# Environment variable: JSON object of tt-mlir compile options for processes that build the backend
# themselves (the CLI's workers), e.g. '{"optimization_level": 2, "enable_trace": false}'.
COMPILE_OPTIONS_ENV = "WAN_SHARDING_TT_COMPILE_OPTIONS"
# Tenstorrent device nodes: the kernel driver (tt-kmd) puts one per PCIe-attached device here.
TT_DEVICE_DIR = "/dev/tenstorrent"


# ------------------------------------------------------------------------------ the stack itself


def tt_stack_missing() -> str | None:
    """One line naming what of Tenstorrent's torch stack is missing and how to get it; ``None``
    when it is installed. Looks only for the packages (``importlib.util.find_spec``): imports
    neither ``tt_torch`` nor torch-xla."""
    import sys
    from importlib.util import find_spec

    def absent(name: str) -> bool:
        if name in sys.modules:  # already imported (or blocked with None)
            return sys.modules[name] is None
        try:
            return find_spec(name) is None
        except (ImportError, ValueError):
            return True

    missing = [what for name, what in (("tt_torch", "tt_torch (pjrt-plugin-tt)"), ("torch_xla", "torch-xla"))
               if absent(name)]
    if not missing:
        return None
    return (f"the tt backend needs Tenstorrent's torch stack, and {' and '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} not installed: install pjrt-plugin-tt (it provides tt_torch) "
            f"and Tenstorrent's torch-xla build from Tenstorrent's package index ({TT_INSTALL}), "
            "or use the xla or jax backend on CPU, or `wan-sharding compile` for tt-mlir compile-only")


def check_tt_stack() -> None:
    """Raise :class:`BackendError` (one line: what is missing, how to get it) unless Tenstorrent's
    torch stack is installed. Safe in a parent process: imports no stack."""
    reason = tt_stack_missing()
    if reason is not None:
        raise BackendError(reason)


def tt_device_present() -> bool:
    """Whether this machine shows a Tenstorrent device (a node under ``/dev/tenstorrent``)."""
    try:
        return any(True for _ in os.scandir(TT_DEVICE_DIR))
    except OSError:
        return False


def start_tt_runtime() -> None:
    """First thing in a process that runs the tt backend: tt-mlir consumes Shardy, so the TT
    plugin converts the StableHLO it gets (``CONVERT_SHLO_TO_SHARDY=1``); the torch-xla device
    type is TT; SPMD is on before any tensor reaches the device. Idempotent."""
    import torch_xla.runtime as xr

    from .xla import enable_spmd

    os.environ.setdefault("CONVERT_SHLO_TO_SHARDY", "1")
    xr.set_device_type("TT")
    enable_spmd()


def _tt_sharding():
    try:
        from tt_torch import sharding
    except ImportError as e:
        raise BackendError(
            "the tt backend needs Tenstorrent's torch plugin (pjrt-plugin-tt, which provides tt_torch) and "
            f"Tenstorrent's torch-xla build, from Tenstorrent's package index ({TT_INSTALL}); without them use "
            "backend='xla' (CPU SPMD) or the tt-mlir compile-only path (wan-sharding compile)"
        ) from e
    return sharding


# ------------------------------------------------------------------------------ compile options


@dataclass
class TTCompileOptions:
    """tt-mlir compile options for the tt backend, sent once through
    ``torch_xla.set_custom_compile_options`` (Tenstorrent's torch-xla build) before the first compile.

    The defaults are the ones Tenstorrent's own Wan 2.2 DiT tests compile with (tt-xla,
    ``tests/torch/models/wan14b/test_wan_dit.py`` and the ``run_component`` helper in
    ``tests/torch/models/wan14b/shared.py``); what each option does is as tt-xla's test compiler
    config describes it (``tests/infra/testers/compiler_config.py``). Values are sent as strings,
    the form that config hands to ``set_custom_compile_options``.
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
    # Any other option tt-xla's plugin accepts, by its name (e.g. {"export_path": "irs"}).
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.optimization_level not in (0, 1, 2):
            raise ValueError(f"optimization_level must be 0, 1 or 2, got {self.optimization_level!r}")

    @classmethod
    def of(cls, value: "TTCompileOptions | Mapping[str, Any] | None") -> "TTCompileOptions":
        """Options from an instance, a mapping (known names set fields, other names go to
        ``extra``) or ``None`` (:data:`COMPILE_OPTIONS_ENV` if set, else the defaults)."""
        if isinstance(value, cls):
            return value
        if value is None:
            text = os.environ.get(COMPILE_OPTIONS_ENV)
            if not text:
                return cls()
            try:
                value = json.loads(text)
            except ValueError as e:
                raise BackendError(f"{COMPILE_OPTIONS_ENV} is not a JSON object: {e}") from None
            if not isinstance(value, dict):
                raise BackendError(f"{COMPILE_OPTIONS_ENV} must be a JSON object, got {text!r}")
        known = {f for f in cls.__dataclass_fields__ if f != "extra"}
        fields = {k: v for k, v in value.items() if k in known}
        extra = {**dict(value.get("extra") or {}), **{k: v for k, v in value.items() if k not in known | {"extra"}}}
        return cls(**fields, extra=extra)

    def to_torch_xla(self) -> dict[str, str]:
        """The dict for ``torch_xla.set_custom_compile_options`` (every value a string)."""
        text = lambda v: ("true" if v else "false") if isinstance(v, bool) else str(v)  # noqa: E731
        fields = {k: v for k, v in asdict(self).items() if k != "extra"}
        return {k: text(v) for k, v in {**fields, **self.extra}.items()}


_applied_options: dict[str, str] | None = None  # what this process last sent to torch-xla


def _apply_compile_options(options: dict[str, str]) -> None:
    """Send ``options`` to torch-xla unless they are what it already has (they are process-wide)."""
    global _applied_options
    if options == _applied_options:
        return
    import torch_xla

    setter = getattr(torch_xla, "set_custom_compile_options", None)
    if setter is None:
        raise BackendError(
            "torch_xla has no set_custom_compile_options: this is stock torch-xla, not Tenstorrent's build; "
            f"install pjrt-plugin-tt with Tenstorrent's torch-xla from Tenstorrent's package index ({TT_INSTALL})"
        )
    setter(dict(options))
    _applied_options = dict(options)


# ------------------------------------------------------------------------------ the backend


class TTBackend(XlaBackend):
    """The tt backend on one mesh of Tenstorrent chips.

    ``compile_options``: :class:`TTCompileOptions`, a mapping of option names, or ``None`` for
    :data:`COMPILE_OPTIONS_ENV` / the defaults of Tenstorrent's Wan tests.
    """

    name = "tt"

    def __init__(self, mesh: MeshSpec, native_mesh: Any = None,
                 compile_options: TTCompileOptions | Mapping[str, Any] | None = None):
        self._sharding = _tt_sharding()  # fail before anything is touched
        self.compile_options = TTCompileOptions.of(compile_options)
        # id(model) -> (model, {input signature: compiled module}); the model is held so its id
        # cannot be reused by another object while the entry lives. ``release`` drops it.
        self._compiled: dict[int, tuple[torch.nn.Module, dict[Any, Any]]] = {}
        self.compiles = 0  # torch.compile calls so far (one per model and input signature)
        super().__init__(mesh, native_mesh)

    def _make_mesh(self, mesh: MeshSpec) -> Any:
        start_tt_runtime()
        return super()._make_mesh(mesh)

    def _device_count_hint(self) -> str:
        hint = "pick the mesh preset for the chips in this machine (1x4 QuietBox, 2x4 LoudBox, 8x4 Galaxy)"
        if self.mesh.num_devices == 1:
            return ("a one-device mesh (such as profile's unsharded baseline) runs on tt only on a one-chip machine, "
                    "since torch-xla SPMD spans every chip it sees; " + hint)
        return hint

    def constrain(self, tensor: torch.Tensor, spec: Spec) -> torch.Tensor:
        # Returns a new value, so replicated-then-sharded stays two constraints in the graph.
        return self._sharding.sharding_constraint_tensor(tensor, self.native_mesh, spec)

    def compiled_for(self, dit: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
        """The compiled forward of ``dit`` for inputs like these: made (and the compile options
        applied) on first use, the same object for every later call with the same signature."""
        entry = self._compiled.get(id(dit))
        if entry is None or entry[0] is not dit:
            entry = self._compiled[id(dit)] = (dit, {})
        key = (input_signature(args), input_signature(kwargs))
        compiled = entry[1].get(key)
        if compiled is None:
            _apply_compile_options(self.compile_options.to_torch_xla())
            # dynamic=False: a new input shape gets a compile of its own for that shape (tt-mlir
            # compiles static shapes), not a symbolic-shape recompile of the first one.
            compiled = entry[1][key] = torch.compile(dit, backend="tt", dynamic=False)
            self.compiles += 1
        return compiled

    def run_device(self, dit: torch.nn.Module, placed: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        args, kwargs = self._to_device(args, kwargs)
        compiled = self.compiled_for(dit, args, kwargs)
        return compiled(*args, **kwargs, return_dict=False)[0]

    def run_cached_device(self, dit: torch.nn.Module, placed: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        """A forward with diffusers' cache hooks live. A block cache (FirstBlockCache, MagCache)
        runs as its few programs, each through ``torch.compile(backend="tt")`` once per signature
        (:meth:`cached_programs`), so every cached forward keeps trace replay. Any other cache runs
        lazily, as on the ``xla`` backend: the hooks' decisions cut the lazy graph, and each piece
        between them is compiled once by the TT plugin and reused by graph hash."""
        from ..caching import model_cache_probe

        probe = model_cache_probe(dit)
        if probe is None or probe.plan is None:
            return XlaBackend.run_device(self, dit, placed, *args, **kwargs)
        args, kwargs = self._to_device(args, kwargs)
        return probe.plan.forward(self.cached_programs(dit, probe.plan, args, kwargs), probe.stats)

    def cached_programs(self, dit: torch.nn.Module, plan: Any, args: tuple, kwargs: dict) -> Any:
        """How ``plan`` runs its programs on tt: each one ``torch.compile(backend="tt")`` of the
        program's function, made (after the compile options are applied, as for a whole forward)
        once per model, program and signature of its inputs; kept with the model's compiled
        forwards, so ``release`` drops them too."""
        entry = self._compiled.get(id(dit))
        if entry is None or entry[0] is not dit:
            entry = self._compiled[id(dit)] = (dit, {})
        signature = (input_signature(args), input_signature(kwargs))

        def run(name: str, extra: dict) -> dict:
            key = ("cached", plan.key, name, signature, input_signature(extra))
            compiled = entry[1].get(key)
            if compiled is None:
                def program(a: tuple, k: dict, given: dict) -> dict:
                    return plan.body(name, lambda: dit(*a, **k, return_dict=False)[0], given)

                _apply_compile_options(self.compile_options.to_torch_xla())
                compiled = entry[1][key] = torch.compile(program, backend="tt", dynamic=False)
                self.compiles += 1
            return compiled(args, kwargs, extra)

        return run

    def release(self, dit: torch.nn.Module) -> None:
        """Drop the compiled forwards of ``dit``."""
        entry = self._compiled.get(id(dit))
        if entry is not None and entry[0] is dit:
            del self._compiled[id(dit)]

    @staticmethod
    def cpu_env(num_devices: int) -> dict[str, str]:
        raise BackendError("the tt backend runs on Tenstorrent devices, not CPU virtual devices")

    @classmethod
    def worker_env(cls, num_devices: int) -> dict[str, str]:
        """Environment for a worker that runs the tt backend on this machine's Tenstorrent chips:
        the user's environment with the TT device selected; the device count comes from the chips
        (``num_devices`` is not used). BackendError when the stack is missing."""
        check_tt_stack()
        env = dict(os.environ)
        env["PJRT_DEVICE"] = "TT"  # not CPU, whatever the parent process defaulted it to
        env.pop("CPU_NUM_DEVICES", None)
        env.setdefault("CONVERT_SHLO_TO_SHARDY", "1")
        flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
        if flags:
            env["XLA_FLAGS"] = " ".join(flags)
        else:
            env.pop("XLA_FLAGS", None)
        return env
