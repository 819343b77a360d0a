"""Tenstorrent's own torch stack: tt-xla's torch plugin (``pjrt-plugin-tt``, ``tt_torch``).

Weights are marked like stock torch-xla (``xs.mark_sharding`` on the TT device); activations go
through ``tt_torch.sharding.sharding_constraint_tensor``, which emits a ``tt.sharding_constraint``
custom call that tt-mlir turns into ``sdy.sharding_constraint``. The model is compiled with
``torch.compile(dit, backend="tt")`` once per model and input signature (shapes, dtypes, which
inputs are ``None``) and that compiled module is reused: a fresh ``torch.compile`` wrapper per call
would trace and compile the whole DiT again every time, which is what Tenstorrent's Wan test
helpers avoid with a process-level cache keyed by model and input shapes (tt-xla,
``tests/torch/models/wan14b/shared.py``, ``run_component``). The tt-mlir compiler options
(:class:`~.tt_options.TTCompileOptions`) go to ``torch_xla.set_custom_compile_options`` before the first compile.
A model with LoRA adapters is compiled with its adapters' scales as the program's inputs, so
switching weights, ``disable_lora`` / ``enable_lora`` and a hotswap of the same rank reuse it.

That stack comes from Tenstorrent's package index with their torch-xla build and cannot be
installed here; ``tests/test_tt_contract.py`` checks what this backend sends to it with stand-ins.
:func:`check_tt_stack` says, without importing torch-xla, whether this machine has it.
"""

from __future__ import annotations

import os
import weakref
from typing import Any, Mapping

import torch

from ..lora_layers import adapters_enabled, lora_parameters, program_scales, scale_targets
from ..mesh import MeshSpec
from ..specs import Spec
from .base import (BackendError, compiled_cache_program, compiled_lora_forward, compiled_step_program, input_signature,
                   with_xla_flags)
from .tt_norms import NormPins, norm_pin_refusal
from .tt_options import COMPILE_OPTIONS_ENV, FIELD_KEYS, PLUGIN_OPTIONS, TTCompileOptions, TTOptionsError  # noqa: F401
from .xla import XlaBackend

# Where Tenstorrent's stack comes from (tt-xla's release notes install pjrt-plugin-tt this way).
TT_INDEX = "https://pypi.eng.aws.tenstorrent.com/"
TT_INSTALL = f"pip install pjrt-plugin-tt --extra-index-url {TT_INDEX}"
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


def drop_dynamo_entries(model: torch.nn.Module) -> int:
    """Invalidate dynamo's cache entries guarded on ``model`` (the compiled forwards' code and
    graphs are freed, the other models' entries are kept), as dynamo itself does when a guarded
    object is deallocated; returns how many were dropped. An invalidated entry stays in dynamo's
    list and counts against every model's recompile limit, so a code object left with invalidated
    entries only is cleared (``reset_code``). Dynamo offers no public call for one object
    (``torch._dynamo.reset`` drops every model's), so this uses its cache-entry internals (torch
    2.9 to 2.11); where they differ it drops nothing and returns 0."""
    try:
        from torch._C._dynamo.eval_frame import reset_code
        from torch._dynamo import convert_frame
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list
        from torch._dynamo.guards import DeletedGuardManagerWrapper
    except ImportError:
        return 0
    dropped = 0
    for weak_code in list(getattr(convert_frame.input_codes, "seen", ())):
        code = weak_code()
        if code is None:
            continue
        entries = _debug_get_cache_entry_list(code)
        for entry in entries:
            manager = entry.guard_manager
            refs = getattr(manager, "id_matched_objs", None) or {}
            cache_entry, extra_state = getattr(manager, "cache_entry", None), getattr(manager, "extra_state", None)
            if cache_entry is None or extra_state is None or not any(r() is model for r in refs.values()):
                continue
            extra_state.invalidate(cache_entry, DeletedGuardManagerWrapper("released by wan_sharding's tt backend"))
            dropped += 1
        entries = _debug_get_cache_entry_list(code)
        if entries and all(isinstance(e.guard_manager, DeletedGuardManagerWrapper) for e in entries):
            reset_code(code)
    return dropped


# ------------------------------------------------------------------------------ the backend


class TTBackend(XlaBackend):
    """The tt backend on one mesh of Tenstorrent chips.

    ``compile_options``: :class:`TTCompileOptions`, a mapping of option names, or ``None`` for
    :data:`COMPILE_OPTIONS_ENV` / the defaults of Tenstorrent's Wan tests.

    On a TP mesh every compile first pins the model's TP-split RMSNorms (:mod:`.tt_norms`), which
    tt-xla marks ``tenstorrent.rms_norm``: without the pins tt-mlir rejects the graph. A placement
    that would still fail is a one-line BackendError before anything compiles.
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
        self.dropped_entries = 0  # dynamo cache entries the last release() dropped
        # Per model (weakly): the weight specs ``place`` marked, by name, and the RMSNorm pins.
        self._placed_specs: "weakref.WeakKeyDictionary[torch.nn.Module, dict]" = weakref.WeakKeyDictionary()
        self._pins: "weakref.WeakKeyDictionary[torch.nn.Module, NormPins]" = weakref.WeakKeyDictionary()
        # Per model: its LoRA parameters on the devices, by name (a hotswap writes new values into
        # these very objects), and its adapters' scales as device scalars with the values they hold.
        self._lora_params: "weakref.WeakKeyDictionary[torch.nn.Module, dict]" = weakref.WeakKeyDictionary()
        self._scale_inputs: "weakref.WeakKeyDictionary[torch.nn.Module, tuple]" = weakref.WeakKeyDictionary()
        super().__init__(mesh, native_mesh)

    def _make_mesh(self, mesh: MeshSpec) -> Any:
        if len(mesh.shape) > 2:  # before the runtime starts: nothing to undo
            raise BackendError(f"mesh {mesh.name} has {len(mesh.shape)} axes {mesh.axis_names}; tt-mlir takes 1-D and 2-D "
                               "meshes only (a 3-D cfg x SP x TP mesh compiles per group: `wan-sharding compile`); on "
                               "hardware use a cfg mesh whose groups are TP only (--mesh 2x4 --cfg 2) or --cfg 1")
        start_tt_runtime()
        return super()._make_mesh(mesh)

    def _device_count_hint(self) -> str:
        hint = "pick the mesh preset for the chips in this machine (1x4 QuietBox, 2x4 LoudBox, 8x4 Galaxy)"
        if self.mesh.num_devices == 1:
            return ("a one-device mesh (such as profile's unsharded baseline) runs on tt only on a one-chip machine, "
                    "since torch-xla SPMD spans every chip it sees; " + hint)
        return hint

    def place(self, dit: torch.nn.Module, specs: Mapping[torch.Tensor, Spec]) -> Any:
        """As the xla backend; the specs are kept (by name) for the check before the next compile,
        which a new placement makes again (its RMSNorm pins are placed afresh)."""
        self._placed_specs[dit] = dict(specs.by_name() if hasattr(specs, "by_name")
                                       else {n: specs[p] for n, p in dit.named_parameters()})
        self._unpin_norms(dit)
        placed = super().place(dit, specs)
        self._lora_params[dit] = lora_parameters(dit)
        return placed

    def place_lora(self, dit: torch.nn.Module, placed: Any, specs: Mapping[str, Spec]) -> None:
        """Put ``dit``'s LoRA parameters (``specs``: their name -> spec) on the mesh from their
        current values (a hotswap may have written host copies), marked with their specs; the base
        weights stay as they are. A parameter of a name placed before, of the same shape and dtype,
        gets its new values in the very same ``Parameter`` object (``.data``): the compiled forward
        holds these objects, so a hotswap of an adapter with the same rank and targets compiles
        nothing. The specs are kept beside the base's for the check before the next compile."""
        self._placed_specs[dit] = {**{n: s for n, s in self._placed_specs.get(dit, {}).items()
                                      if n in dict(dit.named_parameters())}, **specs}
        self._lora_params[dit] = self._put_lora(dit, specs, keep=self._lora_params.get(dit, {}))

    def constrain(self, tensor: torch.Tensor, spec: Spec) -> torch.Tensor:
        # Returns a new value, so replicated-then-sharded stays two constraints in the graph.
        return self._sharding.sharding_constraint_tensor(tensor, self.native_mesh, self.activation_spec(tensor, spec))

    def pin_norms(self, dit: torch.nn.Module) -> NormPins | None:
        """Before a compile on a TP mesh: check that the graph sent will compile (BackendError,
        one line, naming the fix), then pin ``dit``'s TP-split RMSNorms; once per model and
        placement, again when its SP hooks changed. ``release`` takes the pins off. ``None`` on
        a TP-1 mesh."""
        if self.mesh.tp == 1:
            return None
        pins = self._pins.get(dit)
        if pins is not None and not pins.stale(dit):
            return pins  # checked and placed for this placement and these SP hooks: nothing per forward
        refusal = norm_pin_refusal(dit, self.mesh, self._placed_specs.get(dit))
        if refusal is not None:
            raise BackendError(refusal)
        self._unpin_norms(dit)
        pins = self._pins[dit] = NormPins(self, dit)
        return pins

    def _unpin_norms(self, dit: torch.nn.Module) -> None:
        pins = self._pins.pop(dit, None)
        if pins is not None:
            pins.remove()

    def compiled_for(self, dit: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
        """The compiled forward of ``dit`` for inputs like these: made (and the compile options
        applied) on first use, the same object for every later call with the same signature and,
        with LoRA adapters, the same low-rank terms (:func:`~wan_sharding.lora_layers.program_scales`'
        keys: which adapters on which layers); their scales are its inputs (:meth:`_lora_forward`)."""
        entry = self._compiled.get(id(dit))
        if entry is None or entry[0] is not dit:
            entry = self._compiled[id(dit)] = (dit, {})
        terms = tuple(program_scales(dit))
        key = (input_signature(args), input_signature(kwargs)) + ((("lora", terms),) if terms else ())
        self.pin_norms(dit)
        compiled = entry[1].get(key)
        if compiled is None:
            _apply_compile_options(self.compile_options.to_torch_xla())
            # dynamic=False: a new input shape gets a compile of its own for that shape (tt-mlir
            # compiles static shapes), not a symbolic-shape recompile of the first one.
            if terms:
                program = compiled_lora_forward(dit, scale_targets(dit, terms), "tt", f"lora_forward{len(entry[1])}")
                compiled = self._lora_forward(dit, program)
            else:
                compiled = torch.compile(dit, backend="tt", dynamic=False)
            entry[1][key] = compiled
            self.compiles += 1
        return compiled

    def _lora_forward(self, dit: torch.nn.Module, program: Any) -> Any:
        """``program`` (:func:`~.base.compiled_lora_forward`) called as the model is: each call
        hands it the adapters' scales now as 0-dim float32 device tensors, uploaded again only when
        a value changed, with every LoRA layer read as enabled (a disabled one has scale 0)."""
        def forward(*args: Any, return_dict: bool = False, **kwargs: Any) -> tuple[torch.Tensor]:
            values = tuple(program_scales(dit).values())
            kept = self._scale_inputs.get(dit)
            if kept is None or kept[0] != values:
                kept = self._scale_inputs[dit] = (values, tuple(torch.tensor(v, dtype=torch.float32).to(self.device)
                                                                for v in values))
            with adapters_enabled(dit):
                return (program(kept[1], args, kwargs),)

        return forward

    def run_device(self, dit: torch.nn.Module, placed: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        """One compiled forward. Dynamo keeps at most ``torch._dynamo.config.recompile_limit`` (8)
        compiled forwards per model and then, by default, runs the model uncompiled (lazily) with
        only a warning; here that is a one-line BackendError instead. Models count apart (dynamo's
        limit is per guarded model instance), so only input signatures of one model add up."""
        import torch._dynamo

        args, kwargs = self._to_device(args, kwargs)
        compiled = self.compiled_for(dit, args, kwargs)
        try:
            with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
                return compiled(*args, **kwargs, return_dict=False)[0]
        except torch._dynamo.exc.FailOnRecompileLimitHit as e:
            which = str(e).split(" reached")[0]  # dynamo's words: which limit
            raise BackendError(
                f"dynamo's {which} ({torch._dynamo.config.recompile_limit}) is reached for this model: "
                f"{len(self._compiled[id(dit)][1])} input signatures compiled; release() models and shapes no longer "
                "run, or raise torch._dynamo.config.recompile_limit before the first compile"
            ) from None

    def frontend_hooks(self, model: torch.nn.Module) -> list[Any]:
        """torch-xla's (the ``xla`` backend's) and dynamo's: a cached tensor compared with a string
        (:func:`~.frontend_quirks.cache_string_compare`)."""
        from .frontend_quirks import cache_string_compare

        return [*super().frontend_hooks(model), *cache_string_compare(model)]

    def run_step(self, model: torch.nn.Module, placed: Any, fn: Any, *args: Any) -> Any:
        """A VAE step (``fn(model, *args)``) as the DiT's forward is run: ``torch.compile(...,
        backend="tt", dynamic=False)`` with the same compile options, once per model, step
        function and input signature, so every sharding constraint of the step is inside one
        graph and the model's weights reach it as the graph's parameters (what tt-xla's backend
        marks ``parameter`` and hoists into const-eval), the step's inputs as its inputs. Each
        step function gets a code object of its own (:func:`compiled_step_program`): dynamo's
        recompile limit counts per code object. Kept with the model's compiled forwards
        (``release`` drops them); the outputs stay on the devices."""
        import torch._dynamo
        import torch_xla

        args, _ = self._to_device(args, {})
        entry = self._compiled.get(id(model))
        if entry is None or entry[0] is not model:
            entry = self._compiled[id(model)] = (model, {})
        key = ("step", fn, input_signature(args))
        compiled = entry[1].get(key)
        if compiled is None:
            _apply_compile_options(self.compile_options.to_torch_xla())
            compiled = entry[1][key] = compiled_step_program(fn, model, "tt", f"step{len(entry[1])}")
            self.compiles += 1
        with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
            out = compiled(*args)
        torch_xla.sync()  # device data for the next step and the host (on tt the graph's outputs already are)
        return out

    def run_cached_device(self, dit: torch.nn.Module, placed: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        """A forward with diffusers' cache hooks live. A block cache (FirstBlockCache, MagCache)
        or a per-module one (TaylorSeer, PAB) runs as its few programs, each through
        ``torch.compile(backend="tt")`` once per signature (:meth:`cached_programs`), so every
        cached forward keeps trace replay. Any other cache runs
        lazily, as on the ``xla`` backend: the hooks' decisions cut the lazy graph, and each piece
        between them is compiled once by the TT plugin and reused by graph hash."""
        from ..caching.model import model_cache_probe

        probe = model_cache_probe(dit)
        if probe is None or probe.programs is None:
            return XlaBackend.run_device(self, dit, placed, *args, **kwargs)
        args, kwargs = self._to_device(args, kwargs)
        return probe.programs.forward(self.cached_programs(dit, placed, probe.programs, args, kwargs), probe.stats)

    def cached_programs(self, dit: torch.nn.Module, placed: Any, programs: Any, args: tuple, kwargs: dict) -> Any:
        """How a cache's ``programs`` run on tt: each one ``torch.compile(backend="tt")`` of the
        program's function, made (after the compile options are applied, as for a whole forward)
        once per model, program and signature of its inputs; kept with the model's compiled
        forwards, so ``release`` drops them too."""
        entry = self._compiled.get(id(dit))
        if entry is None or entry[0] is not dit:
            entry = self._compiled[id(dit)] = (dit, {})
        signature = (input_signature(args), input_signature(kwargs))
        self.pin_norms(dit)
        # A cache enabled again has new programs over new hooks, which dynamo's guards on the old
        # ones hold: those are dropped, and these are compiled afresh.
        for key in [k for k in entry[1] if k[0] == "cached" and k[1] is not programs]:
            del entry[1][key]

        def run(name: str, extra: dict) -> dict:
            key = ("cached", programs, name, signature, input_signature(extra))
            compiled = entry[1].get(key)
            if compiled is None:
                _apply_compile_options(self.compile_options.to_torch_xla())
                compiled = entry[1][key] = compiled_cache_program(programs, name, dit, "tt")
                self.compiles += 1
            return compiled(args, kwargs, extra)

        return run

    def release(self, dit: torch.nn.Module) -> None:
        """Drop the compiled forwards of ``dit``: this backend's compiled modules and dynamo's cache
        entries for the model (their graphs hold its modules and device weights, and they count
        against dynamo's cache limits), and take its RMSNorm pins off. Other models keep theirs."""
        entry = self._compiled.get(id(dit))
        if entry is not None and entry[0] is dit:
            del self._compiled[id(dit)]
        self._unpin_norms(dit)
        self.dropped_entries = drop_dynamo_entries(dit)

    @staticmethod
    def cpu_env(num_devices: int) -> dict[str, str]:
        raise BackendError("the tt backend runs on Tenstorrent devices, not CPU virtual devices")

    @classmethod
    def worker_env(cls, num_devices: int) -> dict[str, str]:
        """Environment for a worker that runs the tt backend on this machine's Tenstorrent chips
        (:func:`tt_worker_env`); the device count comes from the chips (``num_devices`` is not
        used). BackendError when the stack is missing."""
        check_tt_stack()
        TTCompileOptions.of(None)  # a bad WAN_SHARDING_TT_COMPILE_OPTIONS: one line here, before any worker
        return tt_worker_env(os.environ)


def tt_worker_env(environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` as a tt worker gets it: the TT device selected, no CPU device count, Shardy for
    tt-mlir, the user's XLA flags without the CPU ones. Checks nothing (a dry run prints it)."""
    env = dict(environ)
    env["PJRT_DEVICE"] = "TT"  # not CPU, whatever the parent process defaulted it to
    env.pop("CPU_NUM_DEVICES", None)
    env.setdefault("CONVERT_SHLO_TO_SHARDY", "1")
    return with_xla_flags(env)
