"""Block caches (FirstBlockCache, MagCache) as a few whole programs per forward.

diffusers' block caches decide once per forward, at the first block, whether the rest of the stack
runs. Driven hook by hook, a compiling backend pays a dispatch per module and runs the model's own
Python op by op between them. A :class:`BlockPrograms` instead cuts the forward at that one decision
and runs each side as one program, compiled once per input signature by the backend:

- FirstBlockCache: ``head`` (embedders, rope, ``blocks.0`` and the cache's statistic, the relative
  mean change of the first block's residual), then either ``rest`` (the other blocks and the output
  layers, which also give the new stack residual) or ``reuse`` (the cached stack residual added to
  the first block's output, then the output layers). One scalar comes back to the host per forward
  (none on the first forward of a context, which always computes). The first forward of a context
  runs ``head`` without the statistic: a fourth program, compiled once.
- MagCache: decided from the step count and the calibrated ratios before anything runs, so a forward
  is one program: ``full`` (everything, plus the stack residual) or ``reuse`` (embedders, the last
  residual added to the stack input, the output layers). Nothing is read back.

A program is the model's own forward traced with the cache hooks stepped over (each hooked block
runs the forward under its cache hook, :attr:`CacheProbe.below`) and with some modules' outputs
given instead of computed (the inner probe hooks do it while :attr:`BlockPrograms.trace` is set):
an identity for a block the cache skips, a value computed by an earlier program (the embedders'
outputs, the first block's output). Outputs a program does not return are dead code to the compiler.

The decisions are diffusers' own, on diffusers' own state objects (the hooks' ``StateManager``,
so ``cache_context`` and ``_reset_stateful_cache`` act as they do on the unsharded model): the
statistic is the expression of ``FBCHeadBlockHook._should_compute_remaining_blocks``, and
MagCache's schedule is ``MagCacheHeadHook.new_forward``'s, step for step (diffusers 0.42); the
step counter advances through ``MagCacheBlockHook._advance_step`` itself.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

# (program name, extra inputs) -> that program's outputs (device values), run by the backend.
ProgramRunner = Callable[[str, dict], dict]


@dataclass
class Trace:
    """What the inner probe hooks do while one program is traced."""

    replace: dict[str, Callable[[Any], Any]]  # module -> f(its hidden_states input) -> its output
    record: tuple[str, ...]  # modules whose (hidden_states input, output) the program returns
    recorded: dict[str, tuple[Any, Any]] = field(default_factory=dict)


@dataclass
class ForwardTiming:
    """Host time of the cached forwards run so far: in all, and inside the backend's program calls
    (dispatch, and the wait for the one scalar read back)."""

    forwards: int = 0
    total_s: float = 0.0
    programs_s: float = 0.0
    program_calls: int = 0

    def summary(self) -> dict[str, Any]:
        n = max(self.forwards, 1)
        return {"forwards": self.forwards, "programs_per_forward": round(self.program_calls / n, 3),
                "host_overhead_s": round((self.total_s - self.programs_s) / n, 6)}


def block_cache_kind(config: Any) -> str | None:
    """``"fbc"`` / ``"mag"`` for a config a :class:`BlockPrograms` runs, else ``None`` (MagCache in
    calibration mode runs hook by hook: it reads a norm back after every block stack)."""
    name = type(config).__name__
    if name == "FirstBlockCacheConfig":
        return "fbc"
    if name == "MagCacheConfig" and not config.calibrate:
        return "mag"
    return None


class BlockPrograms:
    """How one DiT's block cache runs as whole programs (see the module docstring)."""

    def __init__(self, dit: torch.nn.Module, kind: str, hooked: list[str], prefix: list[str]):
        from diffusers.hooks._helpers import TransformerBlockRegistry

        self.dit, self.kind = dit, kind
        self.blocks = sorted(hooked, key=lambda n: int(n.rsplit(".", 1)[1]))  # blocks.0 .. blocks.N-1
        self.prefix = prefix  # the root's modules that run before the block stack
        # looked up at every forward (each program call on a lazy backend): walked once, here
        self._modules = {name: module for name, module in dit.named_modules() if name in self.blocks}
        self._meta = TransformerBlockRegistry.get(type(self._modules[self.blocks[0]]))
        # diffusers finds hidden_states' position with inspect.signature on first use and keeps it:
        # found here, so no program traced by dynamo meets the inspect call (a graph break there)
        self._meta._get_parameter_from_args_kwargs("hidden_states", (None,), {})
        self.trace: Trace | None = None
        self.below: dict[str, Callable] = {}  # set by install_probe: block -> the forward under its cache hook
        self.timing = ForwardTiming()

    @property
    def key(self) -> tuple:
        """What a compiled program of this plan depends on besides the inputs."""
        return (self.kind, tuple(self.blocks), tuple(self.prefix))

    def hidden_states(self, args: tuple, kwargs: dict) -> Any:
        return self._meta._get_parameter_from_args_kwargs("hidden_states", args, kwargs)

    # ------------------------------------------------------------------ inside a traced program

    def _trace(self, program: str, extra: dict) -> Trace:
        """What the inner hooks replace and record while ``program`` is traced."""
        first, last, others = self.blocks[0], self.blocks[-1], self.blocks[1:]
        identity = {name: (lambda h: h) for name in others}
        given = {name: (lambda h, v=extra["units"][name]: v) for name in self.prefix} if "units" in extra else {}
        if (self.kind, program) == ("fbc", "head"):
            return Trace(identity, (*self.prefix, first))
        if (self.kind, program) == ("fbc", "rest"):
            return Trace({**given, first: lambda h: extra["h0"]}, (last,))
        if (self.kind, program) == ("fbc", "reuse"):
            # FBCHeadBlockHook: tail_block_residuals[0] + output; the other blocks return their input
            return Trace({**given, **identity, first: lambda h: extra["tail"] + extra["h0"]}, ())
        if (self.kind, program) == ("mag", "full"):
            return Trace({}, (first, last))
        if (self.kind, program) == ("mag", "reuse"):
            # MagCacheHeadHook: output = hidden_states; output = output + previous_residual
            return Trace({**identity, first: lambda h: h + extra["residual"]}, ())
        raise ValueError(f"no program {program!r} for a {self.kind} cache")

    def skipped_modules(self, program: str, extra: dict) -> tuple[str, ...]:
        """The modules whose own forward ``program`` does not run (replaced by an identity or a
        value handed over): a backend need not pass their weights to that program."""
        return tuple(self._trace(program, extra).replace)

    def body(self, program: str, forward: Callable[[], Any], extra: dict) -> dict:
        """The outputs of ``program``: ``forward()`` runs the model's forward (in the backend's
        tracing context) while the inner hooks replace and record as this program needs. Called
        inside :meth:`stepped_over` (which :meth:`forward` holds around each program it runs).
        Nothing here breaks a dynamo graph: a backend that compiles the program with
        ``torch.compile`` gets it as one graph."""
        first, last = self.blocks[0], self.blocks[-1]
        trace = self._trace(program, extra)
        self.trace = trace
        try:
            out = forward()
        finally:
            self.trace = None
        rec = trace.recorded
        if (self.kind, program) == ("fbc", "head"):
            h_in, h0 = rec[first]
            residual = h0 - h_in
            result = {"units": {name: rec[name][1] for name in self.prefix}, "h0": h0, "residual": residual}
            if "prev" in extra:  # FBCHeadBlockHook._should_compute_remaining_blocks, before its .item()
                prev = extra["prev"]
                result["diff"] = (residual - prev).abs().mean() / prev.abs().mean()
            return result
        if (self.kind, program) == ("fbc", "rest"):
            return {"out": out, "tail": rec[last][1] - extra["h0"]}
        if (self.kind, program) == ("mag", "full"):
            return {"out": out, "residual": rec[last][1] - rec[first][0]}
        return {"out": out}

    def stepped_over(self) -> contextlib.AbstractContextManager[None]:
        """The blocks' cache hooks stepped over while a program runs (:func:`stepped_over`)."""
        return stepped_over(self._modules, self.below)

    # ------------------------------------------------------------------ on the host, per forward

    def forward(self, run: ProgramRunner, stats: Any) -> Any:
        """One cached forward: diffusers' decision on diffusers' state, the programs ``run`` runs
        (device values in and out), the probe's statistics updated as the hooks would have."""
        t0 = time.perf_counter()
        in_programs = 0.0

        def timed(program: str, extra: dict, read: str | None = None) -> Any:
            nonlocal in_programs
            with self.stepped_over():  # host time, outside the program
                t = time.perf_counter()
                out = run(program, extra)
                if read is not None:  # the one scalar the host needs: waiting for it is program time
                    out = (out, float(out[read]))
                in_programs += time.perf_counter() - t
            self.timing.program_calls += 1
            return out

        if self.kind == "fbc":
            out, computed = self._fbc(timed)
        else:
            out, computed = self._mag(timed)
        for name, done in zip(self.blocks, computed):
            stats.calls[name] = stats.calls.get(name, 0) + 1
            stats.computed[name] = stats.computed.get(name, 0) + int(done)
            stats.decisions.append((name, done))
        self.timing.forwards += 1
        self.timing.total_s += time.perf_counter() - t0
        self.timing.programs_s += in_programs
        return out

    def _hook(self, block: str, name: str) -> Any:
        return self._modules[block]._diffusers_hook.get_hook(name)

    def _fbc(self, run: Callable[..., Any]) -> tuple[Any, list[bool]]:
        from diffusers.hooks.first_block_cache import _FBC_LEADER_BLOCK_HOOK

        hook = self._hook(self.blocks[0], _FBC_LEADER_BLOCK_HOOK)
        state = hook.state_manager.get_state()
        prev = state.head_block_residual
        if prev is None:  # the first forward of this context: nothing to compare with, compute
            head, compute = run("head", {}), True
        else:  # FBCHeadBlockHook._should_compute_remaining_blocks: (...).item() > threshold
            head, diff = run("head", {"prev": prev}, read="diff")
            compute = diff > hook.threshold
        state.should_compute = compute
        if compute:
            rest = run("rest", {"units": head["units"], "h0": head["h0"]})
            state.head_block_output, state.head_block_residual = head["h0"], head["residual"]
            state.tail_block_residuals = (rest["tail"], None)
            return rest["out"], [True] * len(self.blocks)
        out = run("reuse", {"units": head["units"], "h0": head["h0"], "tail": state.tail_block_residuals[0]})
        return out["out"], [True] + [False] * (len(self.blocks) - 1)

    def _mag(self, run: Callable[..., Any]) -> tuple[Any, list[bool]]:
        from diffusers.hooks.hooks import CacheContext
        from diffusers.hooks.mag_cache import _MAG_CACHE_BLOCK_HOOK, _MAG_CACHE_LEADER_BLOCK_HOOK

        head = self._hook(self.blocks[0], _MAG_CACHE_LEADER_BLOCK_HOOK)
        tail = self._hook(self.blocks[-1], _MAG_CACHE_BLOCK_HOOK)
        if head.state_manager._context is None:
            head.state_manager.set_context(CacheContext(name="inference"))
        state = head.state_manager.get_state()
        compute = _mag_should_compute(state, head.config)
        state.should_compute = compute
        if compute:
            out = run("full", {})
            state.previous_residual = out["residual"]
        else:
            out = run("reuse", {"residual": state.previous_residual})
        tail._advance_step(state)
        return out["out"], [compute] * len(self.blocks)


@contextlib.contextmanager
def stepped_over(modules: dict[str, torch.nn.Module], below: dict[str, Callable]) -> Iterator[None]:
    """Step over the cache hooks of ``modules`` while a program runs: each one's ``forward`` is the
    one its cache hook wraps (``below``, the probe's level), restored after. On the host, around
    the backend's call, not inside the traced program: a compiled program then sees the same
    ``forward`` objects at every call (what dynamo guards on) and no module is changed inside its
    graph."""
    saved = {name: module.__dict__.get("forward") for name, module in modules.items()}
    try:
        for name, module in modules.items():
            module.forward = below[name]
        yield
    finally:
        for name, module in modules.items():
            if saved[name] is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = saved[name]


def _mag_should_compute(state: Any, config: Any) -> bool:
    """``MagCacheHeadHook.new_forward``'s decision (diffusers 0.42), on its state, unchanged."""
    current_step = state.step_index
    current_scale = 1.0 if current_step >= len(config.mag_ratios) else config.mag_ratios[current_step]
    retention_step = int(config.retention_ratio * config.num_inference_steps + 0.5)
    if current_step >= retention_step:
        state.accumulated_ratio *= current_scale
        state.accumulated_steps += 1
        state.accumulated_err += abs(1.0 - state.accumulated_ratio)
        if (state.previous_residual is not None and state.accumulated_err <= config.threshold
                and state.accumulated_steps <= config.max_skip_steps):
            return False
        state.accumulated_ratio, state.accumulated_steps, state.accumulated_err = 1.0, 0, 0.0
    return True


def root_prefix(dit: torch.nn.Module, stack: str = "blocks") -> list[str]:
    """The root's child modules registered before the block stack (rope, patch_embedding,
    condition_embedder on a Wan DiT): the forward runs them before its blocks."""
    names = [name for name, _ in dit.named_children()]
    return names[: names.index(stack)] if stack in names else []
