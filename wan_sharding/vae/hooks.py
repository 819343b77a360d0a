"""The VAE's per-instance hooks: each conv on a split frame gets its halo, the mid-block attention
gathers the frame, and every hook is undone by ``remove()``.

What each module gets (``strategy="halo"``; diffusers 0.42.1's ``autoencoder_kl_wan.py``):

| module | instance attribute set | pre-hook | post-hook |
|---|---|---|---|
| ``WanCausalConv3d`` with a 3x3 spatial kernel | ``_padding`` all zero (the hook pads) | cached frames + causal time pad, padded rows zeroed, halo of 1, shards folded into the batch | unfold |
| ``Conv2d`` of an upsampler (padding 1) | ``padding = (0, 0)`` | padded rows zeroed, halo of 1, fold | unfold |
| ``ZeroPad2d`` + stride-2 ``Conv2d`` of a downsampler | the pad's ``padding`` all zero | (conv) padded rows zeroed, halo of 0 before / 1 after, fold | unfold |
| ``WanUpsample`` (nearest x2) | - | fold (no halo: a shard's rows upsample alone) | unfold |
| ``WanAttentionBlock`` | - | frame gathered (replicated), cut to its logical size | padded back, split again |

Everything else in the VAE (1x1 convs, the time convs, RMS norms over channels, the residual
shortcuts' 2x2 regroupings, patchify) acts on each pixel or on 2x2 groups a shard holds whole.
Which mesh axis carries H and which W is the call's (the handle picks it per frame), and so is the
largest halo all-gather allowed: every hook reads both from :class:`VaeState` while it traces.

``annotate`` keeps each module's own padding and only zeroes padded rows before a conv and
constrains its output to the split frame: the partitioner decides how to run the conv. ``channels``
installs no hook (the frame stays whole; the weights carry the split).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
import torch.nn.functional as F

from ..backends import Backend
from ..hooks import Hook
from ..specs import ShardingError
from .halo import FrameSplit, fold, mask_logical, unfold
from .layout import Frame


@dataclass
class VaeState:
    """The call being traced (set by the handle's program, read by every hook): its frame (how it
    is split and padded) and the most values one halo all-gather may hand a chip."""

    frame: Frame | None = None
    max_gather: int | None = None

    @contextlib.contextmanager
    def holding(self, frame: Frame, max_gather: int | None = None) -> Iterator[None]:
        self.frame, self.max_gather = frame, max_gather
        try:
            yield
        finally:
            self.frame, self.max_gather = None, None

    def _current(self) -> Frame:
        if self.frame is None:
            raise ShardingError("this VAE is sharded: run it through its handle (handle.decode(z) / handle.encode(x)) "
                                "or the sharded pipeline, not by calling the model itself")
        return self.frame

    def logical_at(self, x: torch.Tensor) -> tuple[int, int]:
        return self._current().logical_at(*x.shape[-2:])

    @property
    def split(self) -> FrameSplit:
        """How the frame of the call lies on the mesh (chosen per frame: :func:`.layout.plan_frame`)."""
        split = self._current().split
        if split is None:
            raise ShardingError("this call's frame is not split (the channels strategy)")
        return split


@dataclass(eq=False)
class VaeHooks:
    """The hooks and instance attributes one sharded VAE carries; ``remove()`` restores it."""

    vae: torch.nn.Module
    strategy: str
    state: VaeState = field(default_factory=VaeState)
    halo_modules: list[str] = field(default_factory=list)
    _handles: list = field(default_factory=list, repr=False)
    _attributes: list = field(default_factory=list, repr=False)  # (module, name, original value)
    removed: bool = False

    def set_attribute(self, module: torch.nn.Module, name: str, value: Any) -> None:
        self._attributes.append((module, name, module.__dict__[name]))
        setattr(module, name, value)

    def remove(self) -> None:
        if self.removed:
            return
        for h in reversed(self._handles):
            h.remove()
        for module, name, value in reversed(self._attributes):
            setattr(module, name, value)
        self.removed = True

    def describe(self) -> dict[str, Any]:
        return {"strategy": self.strategy, "halo_modules": len(self.halo_modules)}


def apply_vae_hooks(vae: torch.nn.Module, backend: Backend, strategy: str, exchange: str = "gather") -> VaeHooks:
    """Install the ``strategy``'s hooks on ``vae`` (see the module's table); returns their handle.
    Each hook reads how the frame is split from the call's state: the handle picks it per frame."""
    hooks = VaeHooks(vae, strategy)
    constrain = backend.constrain
    state = hooks.state
    try:
        if strategy != "channels":
            for name, module in vae.named_modules():
                kind = type(module).__name__
                if kind == "WanCausalConv3d" and module.kernel_size[1] == 3:
                    _causal_conv(hooks, name, module, constrain, state, exchange)
                elif kind == "WanResample" and module.mode != "none":
                    _resample(hooks, name, module, constrain, state, exchange)
                elif kind == "WanAttentionBlock":
                    _attention(hooks, module, constrain, state)
        # the frontend's own workarounds (backends/frontend_quirks.py), after the fold hooks: torch-xla's
        # upsampler stand-in acts on the folded frame
        hooks._handles.extend(backend.frontend_hooks(vae))
    except BaseException:
        hooks.remove()
        raise
    return hooks


def _causal_conv(hooks: VaeHooks, name: str, conv: torch.nn.Module, constrain: Any, state: VaeState,
                 exchange: str) -> None:
    time_pad = conv._padding[4]
    halo = (conv._padding[2], conv._padding[2])
    if hooks.strategy == "annotate":
        def masked(mod, args, kwargs):
            x, *rest = args
            return (mask_logical(x, *state.logical_at(x)), *rest), kwargs

        hooks._handles.append(conv.register_forward_pre_hook(Hook(masked), with_kwargs=True))
        hooks._handles.append(conv.register_forward_hook(Hook(lambda mod, a, y: constrain(y, state.split.frame_spec(y.ndim)))))
        return

    def pre(mod, args, kwargs):
        x = args[0]
        cache = args[1] if len(args) > 1 else kwargs.get("cache_x")
        front = time_pad
        if cache is not None and time_pad > 0:  # the module's own order: cached frames, then the causal pad
            x = torch.cat([cache.to(x.device), x], dim=2)
            front -= cache.shape[2]
        if front:
            x = F.pad(x, (0, 0, 0, 0, front, 0))
        x = mask_logical(x, *state.logical_at(x))
        return (fold(x, state.split, constrain, halo, exchange, state.max_gather),), {}

    hooks.set_attribute(conv, "_padding", (0, 0, 0, 0, 0, 0))
    hooks._handles.append(conv.register_forward_pre_hook(Hook(pre), with_kwargs=True))
    hooks._handles.append(conv.register_forward_hook(Hook(lambda mod, a, y: unfold(y, state.split, constrain))))
    hooks.halo_modules.append(name)


def _resample(hooks: VaeHooks, name: str, resample: torch.nn.Module, constrain: Any, state: VaeState,
              exchange: str) -> None:
    first, conv = resample.resample[0], resample.resample[1]
    down = resample.mode.startswith("downsample")
    if hooks.strategy == "annotate":
        def masked(mod, args):
            return (mask_logical(args[0], *state.logical_at(args[0])),)

        hooks._handles.append(conv.register_forward_pre_hook(Hook(masked)))
        hooks._handles.append(conv.register_forward_hook(Hook(lambda mod, a, y: constrain(y, state.split.frame_spec(y.ndim)))))
        return
    if down:  # ZeroPad2d((0, 1, 0, 1)) then a stride-2 conv: the pad becomes the next shard's first row
        halo = (first.padding[2], first.padding[3])
        hooks.set_attribute(first, "padding", (0, 0, 0, 0))
    else:  # nearest x2 (local to each shard), then a 3x3 conv with padding 1
        halo = (conv.padding[0], conv.padding[0])
        hooks.set_attribute(conv, "padding", (0, 0))
        hooks._handles.append(first.register_forward_pre_hook(Hook(lambda mod, a: (fold(a[0], state.split, constrain),))))
        hooks._handles.append(first.register_forward_hook(Hook(lambda mod, a, y: unfold(y, state.split, constrain))))

    def pre(mod, args):
        x = mask_logical(args[0], *state.logical_at(args[0]))
        return (fold(x, state.split, constrain, halo, exchange, state.max_gather),)

    hooks._handles.append(conv.register_forward_pre_hook(Hook(pre)))
    hooks._handles.append(conv.register_forward_hook(Hook(lambda mod, a, y: unfold(y, state.split, constrain))))
    hooks.halo_modules.append(f"{name}.resample")


def _attention(hooks: VaeHooks, block: torch.nn.Module, constrain: Any, state: VaeState) -> None:
    """One head over the whole frame: gathered (the one collective the size of a frame), cut to its
    logical size so padded pixels are no keys, padded back and split again after."""
    padded: list[tuple[int, int]] = []

    def pre(mod, args):
        x = args[0]
        padded.append(tuple(x.shape[-2:]))
        lh, lw = state.logical_at(x)
        x = constrain(x, (None,) * x.ndim)  # the frame's gather
        return (x[..., :lh, :lw],)

    def post(mod, args, y):
        ph, pw = padded.pop()
        y = constrain(y, (None,) * y.ndim)  # pinned: else the split below propagates into the attention
        y = F.pad(y, (0, pw - y.shape[-1], 0, ph - y.shape[-2]))
        return constrain(y, state.split.frame_spec(y.ndim))

    hooks._handles.append(block.register_forward_pre_hook(Hook(pre)))
    hooks._handles.append(block.register_forward_hook(Hook(post)))
