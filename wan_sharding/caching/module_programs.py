"""Per-module caches (TaylorSeer, Pyramid Attention Broadcast) as one whole program per forward.

diffusers' TaylorSeer and PAB hooks decide per module (a block's ``attn1``, ``attn2``, ``ffn``), but
every decision follows from counters and the pipeline's timestep, known on the host before the
forward runs. A :class:`ModulePrograms` therefore takes all of a forward's decisions first, on the
hooks' own state, and runs the forward as one program for that decision pattern, compiled once per
pattern and input signature by the backend (as a :class:`~.programs.BlockPrograms` does):

- TaylorSeer: each module's ``TaylorSeerCacheHook._measure_should_compute`` (diffusers' own; it
  advances the module's step count). With the Wan config every module shares one schedule, so a
  forward is ``update`` (every module computed, then ``TaylorSeerState.update`` on the outputs:
  new Taylor factors) or ``predict/k`` (every module's output is ``TaylorSeerState.predict`` from
  its factors, ``k`` steps after the last update). The update's step distance (``update/d``) and
  the prediction's offset are Python numbers in diffusers' expressions, so each value is a program
  of its own: with ``cache_interval=3`` there are at most ``update``, ``update/1..3``,
  ``predict/1..2``. The factors are program inputs and outputs: they stay on the devices, in the
  hooks' own ``TaylorSeerState.taylor_factors``.
- PAB: each attention's decision is ``PyramidAttentionBroadcastHook.new_forward``'s (re-stated in
  :meth:`ModulePrograms._pab`, on its state); ``attn1`` and ``attn2`` each count on their own, so a Wan
  forward is one of at most four patterns (attn1 computed?, attn2 computed?). A program is given
  the cached outputs of the attentions it skips and returns the ones it computes, which become the
  hooks' ``state.cache``.

Any config is run this way: a forward whose modules decide differently (a mixed pattern) is a
program of its own for that pattern (named by its modules' modes), not a fall-back. What stays on
the per-module path (:func:`module_plan_refusal`): a config that hooks a module inside another
hooked module (the inner one's counter only moves when the outer one computes), and TaylorSeer's
``skip_predict_identifiers`` / lite mode (their "inactive" modules return zeros of a recorded shape).
"""

from __future__ import annotations

import inspect
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch

from .programs import ForwardTiming, ProgramRunner, Trace, stepped_over

# Per model: the output dtypes ``TaylorSeerState.update`` recorded for each module when an update
# program was traced. A program is kept per model across enable/disable (the backends' caches), so
# a plan made later may run a compiled update whose body no longer runs: the dtypes live as long.
_OUTPUT_DTYPES: weakref.WeakKeyDictionary[torch.nn.Module, dict[str, tuple]] = weakref.WeakKeyDictionary()


def module_cache_kind(config: Any) -> str | None:
    """``"taylorseer"`` / ``"pab"`` for a per-module cache config, else ``None``."""
    return {"TaylorSeerCacheConfig": "taylorseer",
            "PyramidAttentionBroadcastConfig": "pab"}.get(type(config).__name__)


def module_plan_refusal(config: Any, hooked: list[str]) -> str | None:
    """Why a per-module cache with these hooked modules runs hook by hook instead (or ``None``)."""
    nested = [n for n in hooked for o in hooked if o != n and (o == "" or n.startswith(o + "."))]
    if nested:
        return f"{nested[0]} is hooked inside another hooked module"
    if module_cache_kind(config) == "taylorseer" and (config.skip_predict_identifiers or config.use_lite_mode):
        return "TaylorSeer's inactive (skip_predict) modules"
    return None


def module_programs_for(dit: torch.nn.Module, config: Any, hooked: list[str]) -> ModulePrograms | None:
    """A :class:`ModulePrograms` for ``config`` on ``dit``, or ``None`` where it runs per module."""
    kind = module_cache_kind(config)
    if kind is None or module_plan_refusal(config, hooked) is not None:
        return None
    return ModulePrograms(dit, kind, hooked)


def program_name(modes: dict[str, str]) -> str:
    """A program's name from its modules' modes: the one mode all share, else per module kind
    (``attn1:compute attn2:reuse``) where each kind agrees, else per module."""
    if len(set(modes.values())) == 1:
        return next(iter(modes.values()))
    by_kind: dict[str, set[str]] = {}
    for name, mode in modes.items():
        by_kind.setdefault(name.rsplit(".", 1)[-1], set()).add(mode)
    if all(len(v) == 1 for v in by_kind.values()):
        return " ".join(f"{kind}:{next(iter(v))}" for kind, v in by_kind.items())
    return " ".join(f"{name}:{mode}" for name, mode in modes.items())


def _taylor_predict() -> Callable:
    """``TaylorSeerState.predict`` without its ``torch.compiler.disable`` wrapper: inside a
    ``torch.compile`` program (tt) the wrapper would break the graph there."""
    from diffusers.hooks.taylorseer_cache import TaylorSeerState

    return inspect.unwrap(TaylorSeerState.predict)


class ModulePrograms:
    """How one DiT's per-module cache runs as one program per forward (see the module docstring).
    The backends run it through the same interface as a :class:`~.programs.BlockPrograms`
    (``key``, ``body``, ``skipped_modules``, ``forward``), and the probe's inner hooks read the
    same attributes (``trace``, ``blocks``: here the hooked modules, ``hidden_states``)."""

    def __init__(self, dit: torch.nn.Module, kind: str, hooked: list[str]):
        wanted = set(hooked)
        # registration order, which is the call order on a Wan block (attn1, attn2, ffn)
        self._modules = {name: module for name, module in dit.named_modules() if name in wanted}
        self.dit, self.kind, self.blocks, self.prefix = dit, kind, list(self._modules), []
        self.trace: Trace | None = None
        self.below: dict[str, Callable] = {}  # set by install_probe, as for a BlockPrograms
        self.timing = ForwardTiming()
        self._modes: dict[str, dict[str, str]] = {}  # program name -> each module's mode

    @property
    def key(self) -> tuple:
        """What a compiled program of this plan depends on besides the inputs (and its name)."""
        return (self.kind, tuple(self.blocks))

    def hidden_states(self, args: tuple, kwargs: dict) -> Any:
        return kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]

    def _hook(self, module: str, name: str) -> Any:
        return self._modules[module]._diffusers_hook.get_hook(name)

    def skipped_modules(self, program: str, extra: dict) -> tuple[str, ...]:
        """The hooked modules ``program`` does not run (their outputs predicted or given): a backend
        need not pass their weights to it."""
        return tuple(self._trace(program, extra).replace)

    # ------------------------------------------------------------------ inside a traced program

    def _trace(self, program: str, extra: dict) -> Trace:
        replace: dict[str, Callable[[Any], Any]] = {}
        for name, mode in self._modes[program].items():
            if mode == "reuse":  # PyramidAttentionBroadcastHook: output = self.state.cache
                replace[name] = lambda h, v=extra["cache"][name]: v
            elif mode.startswith("predict/"):
                replace[name] = lambda h, n=name, k=int(mode[8:]): self._predict(n, k, extra["factors"][n])
        return Trace(replace, tuple(n for n in self._modes[program] if n not in replace))

    def _taylor_state(self, name: str) -> Any:
        """A fresh ``TaylorSeerState`` made as the module's hook makes its own (its init kwargs)."""
        from diffusers.hooks.taylorseer_cache import _TAYLORSEER_CACHE_HOOK, TaylorSeerState

        manager = self._hook(name, _TAYLORSEER_CACHE_HOOK).state_manager
        return TaylorSeerState(*manager._init_args, **manager._init_kwargs)

    def _predict(self, name: str, offset: int, factors: dict) -> Any:
        """``TaylorSeerCacheHook.new_forward``'s prediction, by ``TaylorSeerState.predict`` on a
        state holding this program's factors, ``offset`` steps after their update."""
        state = self._taylor_state(name)
        state.taylor_factors, state.module_dtypes = factors, _OUTPUT_DTYPES[self.dit][name]
        state.last_update_step, state.current_step = 0, offset
        outputs = _taylor_predict()(state)
        return outputs[0] if len(outputs) == 1 else tuple(outputs)

    def _update(self, name: str, mode: str, output: Any, extra: dict) -> dict:
        """``TaylorSeerState.update`` (diffusers' own) on a state holding the previous factors
        (given), ``d`` steps after them (``update/d``; ``update``: the first): the new factors."""
        state = self._taylor_state(name)
        if mode != "update":
            state.taylor_factors = extra["factors"][name]
            state.last_update_step, state.current_step = 0, int(mode[7:])
        state.update((output,) if isinstance(output, torch.Tensor) else tuple(output))
        _OUTPUT_DTYPES.setdefault(self.dit, {})[name] = state.module_dtypes
        return state.taylor_factors

    def body(self, program: str, forward: Callable[[], Any], extra: dict) -> dict:
        """The outputs of ``program``: the model's output, and the computed modules' new cache
        values (PAB: their outputs; TaylorSeer: their new Taylor factors)."""
        trace = self._trace(program, extra)
        self.trace = trace  # for the inner hooks; the cache hooks are stepped over by forward()
        try:
            out = forward()
        finally:
            self.trace = None
        missing = [n for n in trace.record if n not in trace.recorded]
        if missing:  # the decisions were taken for every hooked module: each must run in the forward
            raise RuntimeError(f"{missing[0]} did not run in the forward its {self.kind} decision was taken for")
        modes = self._modes[program]
        if self.kind == "pab":
            return {"out": out, "cache": {n: trace.recorded[n][1] for n in trace.record}}
        return {"out": out, "factors": {n: self._update(n, modes[n], trace.recorded[n][1], extra) for n in trace.record}}

    # ------------------------------------------------------------------ on the host, per forward

    def forward(self, run: ProgramRunner, stats: Any) -> Any:
        """One cached forward: every module's decision on its hook's state, then one program."""
        t0 = time.perf_counter()
        modes, extra, finish = self._taylorseer() if self.kind == "taylorseer" else self._pab()
        name = program_name(modes)
        self._modes[name] = modes
        with stepped_over(self._modules, self.below):
            t = time.perf_counter()
            out = run(name, extra)
            in_program = time.perf_counter() - t
        finish(out)
        for module, mode in modes.items():
            done = mode in ("compute", "update") or mode.startswith("update/")
            stats.calls[module] = stats.calls.get(module, 0) + 1
            stats.computed[module] = stats.computed.get(module, 0) + int(done)
            stats.decisions.append((module, done))
        timing = self.timing
        timing.forwards, timing.program_calls = timing.forwards + 1, timing.program_calls + 1
        timing.programs_s += in_program
        timing.total_s += time.perf_counter() - t0
        return out["out"]

    def _taylorseer(self) -> tuple[dict[str, str], dict, Callable[[dict], None]]:
        from diffusers.hooks.taylorseer_cache import _TAYLORSEER_CACHE_HOOK

        modes, states = {}, {}
        for name in self.blocks:
            # diffusers' own decision; it advances the state's step count as the hook would
            compute, state = self._hook(name, _TAYLORSEER_CACHE_HOOK)._measure_should_compute()
            states[name] = state
            if state.last_update_step is None:
                if not compute:  # TaylorSeerState.predict's own error
                    raise ValueError("Cannot predict without prior initialization/update.")
                modes[name] = "update"
            else:
                modes[name] = f"{'update' if compute else 'predict'}/{state.current_step - state.last_update_step}"
        extra = {"factors": {n: states[n].taylor_factors for n, mode in modes.items() if mode != "update"}}

        def finish(out: dict) -> None:  # what TaylorSeerState.update set, with the program's factors
            for name, factors in out["factors"].items():
                state = states[name]
                state.taylor_factors, state.module_dtypes = factors, _OUTPUT_DTYPES[self.dit][name]
                state.last_update_step = state.current_step

        return modes, extra, finish

    def _pab(self) -> tuple[dict[str, str], dict, Callable[[dict], None]]:
        from diffusers.hooks.pyramid_attention_broadcast import _PYRAMID_ATTENTION_BROADCAST_HOOK

        hooks = {name: self._hook(name, _PYRAMID_ATTENTION_BROADCAST_HOOK) for name in self.blocks}
        modes, in_range = {}, {}
        for name, hook in hooks.items():
            # PyramidAttentionBroadcastHook.new_forward's decision (diffusers 0.42), on its state. The
            # range test is made once per callback and range: the pipeline's timestep is one value
            # for the whole forward (each a tensor comparison on the host, 32 modules at 16 blocks).
            state, key = hook.state, (id(hook.current_timestep_callback), tuple(hook.timestep_skip_range))
            if key not in in_range:
                in_range[key] = bool(hook.timestep_skip_range[0] < hook.current_timestep_callback()
                                     < hook.timestep_skip_range[1])
            is_within_timestep_range = in_range[key]
            compute = (state.cache is None or state.iteration == 0 or not is_within_timestep_range
                       or state.iteration % hook.block_skip_range == 0)
            modes[name] = "compute" if compute else "reuse"
        extra = {"cache": {n: hooks[n].state.cache for n, mode in modes.items() if mode == "reuse"}}

        def finish(out: dict) -> None:  # new_forward: state.cache = output; state.iteration += 1
            for name, hook in hooks.items():
                if name in out["cache"]:
                    hook.state.cache = out["cache"][name]
                hook.state.iteration += 1

        return modes, extra, finish

