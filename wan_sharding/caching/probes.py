"""Probes under diffusers' cache hooks: what each cache computed and skipped, and where a compiling
backend runs the pieces between the cache's decisions.

diffusers' cache hooks (``transformer.enable_cache(config)``) wrap a module's ``forward`` and decide
on the host whether to run it (FirstBlockCache, MagCache: the blocks; TaylorSeer, PAB: attention
modules). A :class:`CacheProbe` puts one more diffusers ``ModelHook`` *under* each such hook, on the
same module, so it sees exactly the calls the cache lets through:

- ``calls`` (a torch forward pre-hook on the module, which runs before any cache hook) and
  ``computed`` (the inner hook) per module, and the decision of every call in order;
- with a ``unit_runner`` (the ``jax`` backend), the inner hook also runs the module's own forward as
  one compiled piece. Every other module whose subtree holds no cache hook runs as a compiled piece
  too, so only the code between the cache's decisions runs op by op on the host;
- with cache programs (on a backend that runs a cached forward as whole programs: :mod:`.programs`
  for FirstBlockCache and MagCache, :mod:`.module_programs` for TaylorSeer and PAB), the inner hooks
  of the hooked modules (and of the modules before the blocks) replace or record outputs while one
  of the programs is traced, and the programs count the calls.

To sit under the cache hooks, the probe's hooks must be registered first. :func:`install_probe`
therefore applies the config once to find the modules it hooks, takes it off, registers the inner
hooks, and applies the config again. diffusers' own hooks and state are unchanged; ``remove()``
takes the probe off and leaves the cache enabled as the user left it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .module_programs import ModulePrograms, module_programs_for
from .programs import BlockPrograms, block_cache_kind, root_prefix

INNER_HOOK = "wan_sharding_cache_probe"

# (unit name, module, the module's own forward, args, kwargs) -> output
UnitRunner = Callable[[str, torch.nn.Module, Callable, tuple, dict], Any]
# (module name, its output) -> the output the cache hook above it sees
OutputFix = Callable[[str, Any], Any]


def cache_hooked_modules(dit: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """Modules of ``dit`` (the root included, as ``""``) that carry a diffusers hook other than a probe's."""
    out = {}
    for name, module in dit.named_modules():
        registry = getattr(module, "_diffusers_hook", None)
        if registry is not None and any(h != INNER_HOOK for h in registry.hooks):
            out[name] = module
    return out


def compiled_units(dit: torch.nn.Module, hooked: set[str]) -> list[str]:
    """The pieces a compiling backend runs whole: every maximal submodule with no cache hook strictly
    inside it (a hooked module with none below it is a piece too: its own forward, under the hook).
    The modules above them (the root, a block whose attention is hooked) run their own code op by op."""
    units: list[str] = []

    def visit(name: str, module: torch.nn.Module) -> None:
        below = any(h != name and (name == "" or h.startswith(name + ".")) for h in hooked)
        if name and not below:
            units.append(name)
            return
        for child, sub in module.named_children():
            visit(f"{name}.{child}" if name else child, sub)

    visit("", dit)
    return units


@dataclass
class CacheStats:
    """Per cache-hooked module: how often it was called and how often it really computed."""

    calls: dict[str, int] = field(default_factory=dict)
    computed: dict[str, int] = field(default_factory=dict)
    # one entry per call of a hooked module, in order: (module name, computed?)
    decisions: list[tuple[str, bool]] = field(default_factory=list)

    def skipped(self) -> int:
        return sum(self.calls.values()) - sum(self.computed.values())

    def summary(self) -> dict[str, Any]:
        calls, computed = sum(self.calls.values()), sum(self.computed.values())
        return {"modules": len(self.calls), "calls": calls, "computed": computed, "skipped": calls - computed}

    def reset(self) -> None:
        self.calls.clear()
        self.computed.clear()
        self.decisions.clear()


def _inner_hook_class():
    """The diffusers ``ModelHook`` under a cache hook (defined on use: diffusers is imported lazily)."""
    from diffusers.hooks.hooks import ModelHook

    class InnerHook(ModelHook):
        def __init__(self, name: str, stats: CacheStats | None, runner: UnitRunner | None, post: OutputFix | None,
                     programs: BlockPrograms | None = None):
            super().__init__()
            self.name, self.stats, self.runner, self.post, self.programs = name, stats, runner, post, programs

        def new_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
            trace = self.programs.trace if self.programs is not None else None
            if trace is not None:  # one of the block programs is being traced: replace or record, count nothing
                if self.name in trace.replace:
                    return trace.replace[self.name](self.programs.hidden_states(args, kwargs) if self.name in self.programs.blocks
                                                    else None)
                out = self.fn_ref.original_forward(*args, **kwargs)
                out = out if self.post is None else self.post(self.name, out)
                if self.name in trace.record:
                    trace.recorded[self.name] = (
                        self.programs.hidden_states(args, kwargs) if self.name in self.programs.blocks else None, out)
                return out
            if self.stats is not None:
                self.stats.computed[self.name] = self.stats.computed.get(self.name, 0) + 1
                self.stats.decisions[-1] = (self.name, True)
            if self.runner is None:
                out = self.fn_ref.original_forward(*args, **kwargs)
            else:
                out = self.runner(self.name, module, self.fn_ref.original_forward, args, kwargs)
            return out if self.post is None else self.post(self.name, out)

    return InnerHook


@dataclass(eq=False)
class CacheProbe:
    """What :func:`install_probe` did to one model; ``remove()`` undoes it (the cache stays on)."""

    dit: torch.nn.Module
    config: Any
    stats: CacheStats
    hooked: list[str]
    units: list[str]
    programs: BlockPrograms | ModulePrograms | None = None  # the cache run as whole programs (.programs, .module_programs)
    as_programs: bool = False  # installed for a backend that runs caches as programs (install_probe's)
    _inner: list[torch.nn.Module] = field(default_factory=list, repr=False)
    _torch_hooks: list = field(default_factory=list, repr=False)
    removed: bool = False

    def remove(self, keep_cache: bool = True) -> None:
        """Take the probe's hooks off. With ``keep_cache`` the cache stays enabled on the model
        (re-applied without the probe, fresh state); otherwise it is disabled too."""
        if self.removed:
            return
        config = self.dit._cache_config
        if config is not None:
            self.dit.disable_cache()
        for module in self._inner:
            module._diffusers_hook.remove_hook(INNER_HOOK, recurse=False)
        for h in self._torch_hooks:
            h.remove()
        if keep_cache and config is not None:
            self.dit.enable_cache(config)
        self.removed = True


def install_probe(dit: torch.nn.Module, config: Any, runner: UnitRunner | None = None,
                  count: bool = True, post: OutputFix | None = None, as_programs: bool = False) -> CacheProbe:
    """Enable ``config`` on ``dit`` (diffusers' ``enable_cache``) with a probe under every cache hook.

    ``runner``: how a compiling backend runs one piece (see the module docstring); ``None`` runs the
    model as it is (eager or lazy backends, the unsharded model). ``count``: keep :class:`CacheStats`.
    ``post``: applied to each cache-hooked module's output before its cache hook sees it.
    ``as_programs``: a block cache (FirstBlockCache, MagCache) gets a :class:`~.programs.BlockPrograms`,
    a per-module one (TaylorSeer, PAB) a :class:`~.module_programs.ModulePrograms` (``probe.programs``), which
    the backend runs as a few whole programs instead of ``runner``'s pieces (``None`` where
    :func:`~.module_programs.module_plan_refusal` says why not: then ``runner``'s pieces).
    Raises what diffusers raises for an unsupported config or a cache already enabled.
    """
    if dit.is_cache_enabled:
        raise ValueError(
            f"a cache ({type(dit._cache_config).__name__}) is already enabled on this model; disable_cache() first"
        )
    dit.enable_cache(config)  # where does this config put its hooks?
    hooked = sorted(cache_hooked_modules(dit))
    dit.disable_cache()
    if not hooked:
        raise ValueError(
            f"{type(config).__name__} hooks no module of this {type(dit).__name__}: it would skip nothing; "
            "set its identifiers to Wan module names (wan_sharding.caching.wan_cache_config gives ones that act)"
        )
    kind = block_cache_kind(config) if as_programs else None
    programs = BlockPrograms(dit, kind, hooked, root_prefix(dit)) if kind is not None else None
    if as_programs and programs is None:  # TaylorSeer, PAB: one program per decision pattern (.module_programs)
        programs = module_programs_for(dit, config, hooked)
    units = compiled_units(dit, set(hooked)) if runner is not None and programs is None else []
    stats = CacheStats()
    probe = CacheProbe(dit, config, stats, hooked, units, programs, as_programs)
    modules = dict(dit.named_modules())
    InnerHook = _inner_hook_class()
    from diffusers.hooks.hooks import HookRegistry

    try:
        for name in dict.fromkeys(hooked + units + (programs.prefix if programs is not None else [])):
            module = modules[name]
            is_hooked = name in hooked
            HookRegistry.check_if_exists_or_initialize(module).register_hook(
                InnerHook(name, stats if (count and is_hooked) else None, runner if name in units else None,
                          post if is_hooked else None, programs),
                INNER_HOOK)
            probe._inner.append(module)
            if programs is not None and is_hooked:
                programs.below[name] = module.forward  # the probe's level: what the cache hook will wrap
            if count and is_hooked:
                probe._torch_hooks.append(module.register_forward_pre_hook(_counter(name, stats, programs)))
        dit.enable_cache(config)  # now on top of the probes
    except BaseException:
        probe.remove(keep_cache=False)
        raise
    return probe


def _counter(name: str, stats: CacheStats, programs: BlockPrograms | None = None) -> Callable:
    def pre_hook(module: torch.nn.Module, args: tuple) -> None:
        if programs is not None and programs.trace is not None:
            return  # a program being traced: BlockPrograms.forward counts the forwards it runs
        stats.calls[name] = stats.calls.get(name, 0) + 1
        stats.decisions.append((name, False))  # the inner hook turns it to True if it computes

    return pre_hook


def zero_padding_rows(state: Any, module: str = "blocks.0") -> OutputFix:
    """For a model whose token dim is padded for sequence parallelism (``state``: its SP
    ``ForwardState``): zero the padded rows of ``module``'s output (the block where SP pads).

    FirstBlockCache decides from the mean change of that block's residual over all rows; the padded
    rows (zeros in, something else out) would enter that mean and could flip a decision near the
    threshold. Zeroed, they add nothing to either side of its ratio, so the sharded model decides as
    the unpadded one does. Exact for every token that counts: no valid token reads a padded row
    (the key mask, or K/V sliced back). Costs one multiply per forward, only while a cache is on."""
    def fix(name: str, out: Any) -> Any:
        if name != module or not state.padded or not isinstance(out, torch.Tensor):
            return out
        keep = (torch.arange(state.padded_len, device=out.device) < state.valid_len).to(out.dtype)
        return out * keep.view(1, -1, 1)

    return fix
