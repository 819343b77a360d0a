"""The VAE's decode and encode as a few programs on the mesh: one per latent frame (decode) or
time chunk (encode), with the causal time cache passed from one to the next on the devices.

diffusers' ``AutoencoderKLWan._decode`` runs its decoder one latent frame at a time over a list of
cached frames (``feat_cache``: ``None`` before a conv's first call, ``"Rep"`` for an upsampler's
first, then the last two frames of its input); ``_encode`` runs its encoder on a first frame and
then chunks of four. One program for a whole video would unroll that loop: its compile grows with
the frame count (measured on the tiny VAE, jax, 2x4: 5 s for one frame, ~40 s for three). Here each
call is the same loop, step by step, each step a program of the backend: the first frame's, the
second's (its cache holds one frame), then one program that every later frame reuses (the cache's
structure and shapes no longer change), so a video of any length compiles three decode programs
(an encode likewise: its first frame, its first chunk of four, then one every later chunk reuses).
The cache stays on the devices, split like the frames.

The steps call the VAE's own modules (``post_quant_conv``, ``decoder``, ``encoder``,
``quant_conv``) and diffusers' own ``patchify`` / ``unpatchify``; the loop around them is
``_decode`` / ``_encode``'s, in the same order.
"""

from __future__ import annotations

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
    """One function object per (part, frame, cache pattern, first step): the backends compile a
    function once per object and input shapes, so each step structure compiles once per frame.
    A step is pure torch over the VAE: ``enter(frame, x)`` pads and splits its input inside the
    program (a no-op on an input uploaded padded and split), ``pin(frame, t)`` constrains an
    output to the frame's split. The hooks read the frame from the VAE's state, which the caller
    holds around the step (and the backend's frontend quirks): nothing in a step enters a context,
    so a dynamo trace of it is one graph."""

    def __init__(self, enter: Callable[[Any, torch.Tensor], torch.Tensor],
                 pin: Callable[[Any, torch.Tensor], torch.Tensor]):
        self._enter = enter
        self._pin = pin
        self._functions: dict[tuple, Callable] = {}
        self._keys: dict[Callable, tuple] = {}
        self._left: dict[tuple, _Left] = {}  # per step: the cache pattern it leaves, recorded while it is traced

    def function(self, part: str, frame: Any, pattern: tuple[str, ...], first: bool) -> Callable:
        key = (part, frame, pattern, first)
        if key not in self._functions:
            body = _decode_step if part == "decode" else _encode_step
            left = self._left[key] = _Left()

            def step(vae: torch.nn.Module, x: torch.Tensor, *cached: torch.Tensor) -> tuple:
                x = self._enter(frame, x)
                cache = rebuild_cache(pattern, cached)
                out = body(vae, x, cache, first)
                # an attribute written, never read here: dynamo replays the write after the graph and
                # guards nothing on it (a dict written here would be guarded, and retraced at every call)
                left.pattern = cache_pattern(cache)
                # pinned: the next step's inputs then have one sharding at every step (jax compiles a
                # function again for inputs sharded differently)
                return self._pin(frame, out), tuple(self._pin(frame, c) for c in cache if isinstance(c, torch.Tensor))

            self._functions[key] = step
            self._keys[step] = key
        return self._functions[key]

    def next_pattern(self, fn: Callable) -> tuple[str, ...]:
        """The cache pattern the step function ``fn`` leaves (known once it has been traced)."""
        key = self._keys[fn]
        if self._left[key].pattern is None:
            raise RuntimeError(f"the {key[0]} step {key[2:]} has not been traced yet: its cache's structure is unknown")
        return self._left[key].pattern

    def key(self, fn: Callable) -> tuple:
        """``(part, frame, pattern, first)`` of the step function ``fn``."""
        return self._keys[fn]


class _Left:
    """What one step function leaves in the cache (its pattern), once traced."""

    pattern: tuple[str, ...] | None = None


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


def pad_frame(x: torch.Tensor, padded: tuple[int, int]) -> torch.Tensor:
    """``x`` padded with zeros at the end of H and W to ``padded`` (unchanged when it is that size)."""
    extra_h, extra_w = padded[0] - x.shape[-2], padded[1] - x.shape[-1]
    return F.pad(x, (0, extra_w, 0, extra_h)) if extra_h or extra_w else x
