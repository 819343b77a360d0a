"""The VAE's decode and encode as a few programs on the mesh: one per latent frame (decode) or
time chunk (encode), with the causal time cache passed from one to the next on the devices.

diffusers' ``AutoencoderKLWan._decode`` runs its decoder one latent frame at a time over a list of
cached frames (``feat_cache``: ``None`` before a conv's first call, ``"Rep"`` for an upsampler's
first, then the last two frames of its input); ``_encode`` runs its encoder on a first frame and
then chunks of four. One program for a whole video would unroll that loop: its compile grows with
the frame count (measured on the tiny VAE, jax, 2x4: 5 s for one frame, ~40 s for three). Here each
call is the same loop, step by step, each step a program of the backend: the first frame's, then
one program that every later frame reuses (the cache's structure no longer changes), so a video of
any length compiles two decode programs. The cache stays on the devices, split like the frames.

The steps call the VAE's own modules (``post_quant_conv``, ``decoder``, ``encoder``,
``quant_conv``) and diffusers' own ``patchify`` / ``unpatchify``; the loop around them is
``_decode`` / ``_encode``'s, in the same order.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
import torch.nn.functional as F

# A cache entry's kind: not yet written, the upsampler's first-call marker, or a tensor.
_EMPTY, _REP, _TENSOR = "n", "r", "t"


def cache_pattern(cache: list) -> tuple[str, ...]:
    return tuple(_EMPTY if c is None else _REP if isinstance(c, str) else _TENSOR for c in cache)


def empty_cache(vae: torch.nn.Module, part: str) -> tuple[str, ...]:
    """The pattern of a fresh cache for ``part``: as many unwritten entries as diffusers'
    ``clear_cache`` makes (one per causal conv of the decoder or the encoder)."""
    return (_EMPTY,) * vae._cached_conv_counts["decoder" if part == "decode" else "encoder"]


def rebuild_cache(pattern: tuple[str, ...], tensors: tuple) -> list:
    it = iter(tensors)
    return [None if k == _EMPTY else "Rep" if k == _REP else next(it) for k in pattern]


class StepPrograms:
    """One function object per (part, cache pattern, first step): the backends compile a function
    once per object and input shapes, so each step structure compiles once. ``enter(x)`` is the
    handle's per-step setup inside the program (pad, split, the frame state); ``enter(part, x)``
    returns the split input and a context that holds the frame state for the step; ``pin(t)``
    constrains an output to its split (inside that context: the split is the frame's)."""

    def __init__(self, enter: Callable[[str, torch.Tensor], tuple[torch.Tensor, Any]], quirks: Callable[[], Any],
                 pin: Callable[[torch.Tensor], torch.Tensor]):
        self._enter = enter
        self._pin = pin
        self._quirks = quirks
        self._functions: dict[tuple, Callable] = {}
        self._keys: dict[Callable, tuple] = {}
        self.out_patterns: dict[tuple, tuple[str, ...]] = {}  # recorded while a step is traced

    def function(self, part: str, pattern: tuple[str, ...], first: bool) -> Callable:
        key = (part, pattern, first)
        if key not in self._functions:
            body = _decode_step if part == "decode" else _encode_step

            def step(vae: torch.nn.Module, x: torch.Tensor, *cached: torch.Tensor) -> tuple:
                x, frame_state = self._enter(part, x)
                cache = rebuild_cache(pattern, cached)
                with frame_state, self._quirks():
                    out = body(vae, x, cache, first)
                    self.out_patterns[key] = cache_pattern(cache)
                    # pinned: the next step's inputs then have one sharding at every step (jax compiles a
                    # function again for inputs sharded differently)
                    return self._pin(out), tuple(self._pin(c) for c in cache if isinstance(c, torch.Tensor))

            self._functions[key] = step
            self._keys[step] = key
        return self._functions[key]

    def next_pattern(self, fn: Callable) -> tuple[str, ...]:
        """The cache pattern the step function ``fn`` leaves (known once it has been traced)."""
        key = self._keys[fn]
        if key not in self.out_patterns:
            raise RuntimeError(f"the {key[0]} step {key[1:]} has not been traced yet: its cache's structure is unknown")
        return self.out_patterns[key]


def _decode_step(vae: torch.nn.Module, z: torch.Tensor, cache: list, first: bool) -> torch.Tensor:
    """One latent frame through ``_decode``'s loop body: post_quant_conv (1x1x1: per frame), the
    decoder over the cache, unpatchify, clamp."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import unpatchify

    x = vae.post_quant_conv(z)
    out = vae.decoder(x, feat_cache=cache, feat_idx=[0], first_chunk=first)
    if vae.config.patch_size is not None:
        out = unpatchify(out, patch_size=vae.config.patch_size)
    return torch.clamp(out, min=-1.0, max=1.0)


def _encode_step(vae: torch.nn.Module, x: torch.Tensor, cache: list, first: bool) -> torch.Tensor:
    """One time chunk through ``_encode``'s loop body: patchify, the encoder over the cache,
    quant_conv (1x1x1: per chunk)."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import patchify

    if vae.config.patch_size is not None:
        x = patchify(x, patch_size=vae.config.patch_size)
    return vae.quant_conv(vae.encoder(x, feat_cache=cache, feat_idx=[0]))


def decode_steps(num_frames: int) -> list[tuple[slice, bool]]:
    """``_decode``'s steps: one latent frame each, the first marked."""
    return [(slice(i, i + 1), i == 0) for i in range(num_frames)]


def encode_steps(num_frames: int) -> list[tuple[slice, bool]]:
    """``_encode``'s steps: the first frame, then chunks of four."""
    steps = [(slice(0, 1), True)]
    steps += [(slice(1 + 4 * (i - 1), 1 + 4 * i), False) for i in range(1, 1 + (num_frames - 1) // 4)]
    return steps


@contextlib.contextmanager
def clamped_negative_slices():
    """torch-xla 2.9 refuses a slice whose negative start reaches past the dim
    (``x[:, :, -2:]`` on one frame: "Value out of range"), which eager torch clamps; diffusers'
    cache takes ``x[:, :, -CACHE_T:]`` of every one-frame input. Inside this context such a
    start is clamped as torch clamps it (a TorchFunctionMode, only around the VAE's steps)."""
    from torch.overrides import TorchFunctionMode

    class Clamp(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is torch.Tensor.__getitem__ and isinstance(args[1], tuple):
                args = (args[0], _clamp_index(args[0].shape, args[1]))
            return func(*args, **(kwargs or {}))

    with Clamp():
        yield


@contextlib.contextmanager
def sliced_integer_indexing():
    """torchax lowers an integer index (``x[:, :, -1]``, which diffusers' cache takes of the
    previous frames in every step after the first) through ``jnp`` indexing, which makes it a
    ``dynamic_slice``; tt-mlir 0.1.3 partitions a ``dynamic_slice`` of a split tensor wrong and
    refuses the step ("has slice size 32 greater than dimension size 8 in dimension 3 of
    operand"). Inside this context such an index is a one-wide static slice and a squeeze, the same
    values (a TorchFunctionMode, only around the VAE's steps on the JAX backend)."""
    from torch.overrides import TorchFunctionMode

    class Sliced(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is torch.Tensor.__getitem__ and isinstance(args[1], tuple):
                index, picked = _sliced_index(args[0].shape, args[1])
                if picked:
                    out = func(args[0], index)
                    for dim in reversed(picked):
                        out = out.squeeze(dim)
                    return out
            return func(*args, **(kwargs or {}))

    with Sliced():
        yield


def _sliced_index(shape: torch.Size, index: tuple) -> tuple[tuple, list[int]]:
    """``index`` with each plain integer ``i`` as the slice ``i:i+1`` (negative ones counted from
    the end), and the dims those were; unchanged when it holds anything but integers and slices."""
    if len(index) > len(shape) or not all(isinstance(i, (int, slice)) and not isinstance(i, bool) for i in index):
        return index, []
    out, picked = [], []
    for dim, (size, i) in enumerate(zip(shape, index)):
        if isinstance(i, int):
            start = i + size if i < 0 else i
            i = slice(start, start + 1)
            picked.append(dim)
        out.append(i)
    return tuple(out), picked


def _clamp_index(shape: torch.Size, index: tuple) -> tuple:
    if any(i is Ellipsis or i is None for i in index):
        return index
    out = []
    for size, i in zip(shape, index):
        if isinstance(i, slice) and isinstance(i.start, int) and i.start < -size:
            i = slice(None, i.stop, i.step)
        out.append(i)
    return tuple(out) + tuple(index[len(out):])


def pad_frame(x: torch.Tensor, padded: tuple[int, int]) -> torch.Tensor:
    extra_h, extra_w = padded[0] - x.shape[-2], padded[1] - x.shape[-1]
    return F.pad(x, (0, extra_w, 0, extra_h)) if extra_h or extra_w else x
