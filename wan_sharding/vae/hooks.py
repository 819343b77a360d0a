"""The VAE's per-instance hooks: each conv on a split frame gets its halo, the mid-block attention
runs each chip's queries against the whole frame's keys, and every hook is undone by ``remove()``.

What each module gets (``strategy="halo"``; diffusers 0.42.1's ``autoencoder_kl_wan.py``):

| module | instance attribute set | pre-hook | post-hook |
|---|---|---|---|
| ``WanCausalConv3d`` with a 3x3 spatial kernel | ``_padding`` all zero (the hook pads) | cached frames + causal time pad, padded rows zeroed, halo of 1, shards folded into the batch | unfold |
| ``Conv2d`` of an upsampler (padding 1) | ``padding = (0, 0)`` | padded rows zeroed, halo of 1, fold | unfold |
| ``ZeroPad2d`` + stride-2 ``Conv2d`` of a downsampler | the pad's ``padding`` all zero | (conv) padded rows zeroed, halo of 0 before / 1 after, fold | unfold |
| ``WanUpsample`` (nearest x2) | - | fold (no halo: a shard's rows upsample alone) | unfold |
| ``WanAttentionBlock`` | ``forward`` (:func:`split_attention`) | - | - |

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


_ABSENT = object()  # an instance attribute the module did not have before


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
        """``module.name = value`` on the instance; ``remove()`` puts the instance's own value back,
        or deletes the attribute where the instance had none (its class's then shows again)."""
        self._attributes.append((module, name, module.__dict__.get(name, _ABSENT)))
        setattr(module, name, value)

    def remove(self) -> None:
        if self.removed:
            return
        for h in reversed(self._handles):
            h.remove()
        for module, name, value in reversed(self._attributes):
            if value is _ABSENT:
                delattr(module, name)
            else:
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
    """The block's own ``forward`` for this instance (an instance attribute, the class untouched;
    ``remove()`` deletes it): :func:`split_attention` on the call's frame."""

    def forward(x: torch.Tensor) -> torch.Tensor:
        return split_attention(block, x, state.split, state.logical_at(x), constrain)

    hooks.set_attribute(block, "forward", forward)


def split_attention(block: torch.nn.Module, x: torch.Tensor, split: FrameSplit, logical: tuple[int, int],
                    constrain: Any) -> torch.Tensor:
    """``WanAttentionBlock.forward`` (one head over a frame's pixels, diffusers 0.42.1) on a frame
    ``x`` (B, C, T, H, W) split over the mesh: the same modules and ``scaled_dot_product_attention``,
    with each chip's queries its own shard's pixels and its keys and values the whole frame's.

    The norm, ``to_qkv`` and ``proj`` act per pixel, on the split frame. K and V are gathered (one
    all-gather each, a frame at the block's width: the largest collective of a step) and cut to the
    logical frame, so padded pixels are no keys. The queries' shards move into the batch (as a
    conv's halo does, :func:`.halo.fold`) beside K and V broadcast to each shard, so the scores and
    the softmax, ``L x L`` per frame whole, are ``L/N x L`` on each of ``N`` chips, every value
    local to its chip (split on the batch dim, as a folded conv). Padded pixels' outputs are
    zeroed, as the logical frame padded back was. Each query's row is SDPA's over the same keys in
    the same order."""
    identity = x
    b, c, t, h, w = x.shape
    lh, lw = logical
    bt, n = b * t, split.shards
    x = x.permute(0, 2, 1, 3, 4).reshape(bt, c, h, w)
    q, k, v = block.to_qkv(block.norm(x)).chunk(3, dim=1)  # each (bt, c, h, w), split as the frame
    spec = split.folded_spec(4)

    def whole(kv: torch.Tensor) -> torch.Tensor:  # (n * bt, 1, lh * lw, c): every shard the frame's keys
        kv = constrain(kv, (None,) * 4)[..., :lh, :lw].reshape(bt, 1, c, lh * lw).transpose(2, 3)
        return constrain(kv.unsqueeze(0).expand(n, *kv.shape).reshape(n * bt, *kv.shape[1:]), spec)

    q = fold(q, split, constrain)  # (n * bt, c, h / nh, w / nw): each shard's own pixels
    sh, sw = q.shape[-2:]
    q = constrain(q.reshape(n * bt, 1, c, sh * sw).transpose(2, 3), spec)
    y = F.scaled_dot_product_attention(q, whole(k), whole(v))  # (n * bt, 1, sh * sw, c)
    y = unfold(constrain(y.transpose(2, 3).reshape(n * bt, c, sh, sw), spec), split, constrain)
    y = block.proj(y).view(b, t, c, h, w).permute(0, 2, 1, 3, 4)
    return mask_logical(y + identity, lh, lw)
