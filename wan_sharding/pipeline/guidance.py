"""CFG parallel inside a pipeline's own ``__call__``: a step's two expert calls as one program.

The Wan pipelines call the expert twice per denoising step, one call after the other: with the
prompt (``cache_context("cond")``), then with the negative prompt (``"uncond"``), on the same
latents and timestep, and combine the two outputs. On a cfg mesh the stand-in runs both at the
first call instead: the batch of (cond, uncond) halves goes into one forward whose batch dim is
split over the cfg axis (each half of the mesh runs one branch), the cond half is returned and the
uncond half kept for the call that follows.

Knowing the negative prompt at the first call: the pipeline's ``encode_prompt`` is wrapped on this
pipeline instance only (an instance attribute; the class is untouched and ``remove()`` deletes it),
and records the negative embeddings each call makes. The second call is served from what was kept
only when it is that step's uncond call (the very latents and timestep objects, and a prompt equal
to the recorded negative one); any other call runs as a forward of its own, so a result is never
taken from the wrong step. A call without a negative prompt (guidance off, or a step the pipeline
runs without guidance) runs the cond branch alone: its batch cannot be cut in two, so each half of
the mesh computes the same rows.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any, Callable

import torch

__all__ = ["BRANCH_INPUTS", "GuidancePairs", "as_pair"]

# The forward's inputs that carry the batch and are the same in both branches (repeated for the
# pair); the prompt is the one that differs.
BRANCH_INPUTS = ("hidden_states", "timestep", "encoder_hidden_states_image")


@dataclass
class _Kept:
    """The uncond half of a pair run at the cond call, kept for the uncond call."""

    hidden_states: torch.Tensor
    timestep: torch.Tensor
    negative: torch.Tensor
    others: dict
    output: torch.Tensor


class GuidancePairs:
    """The negative prompt of a pipeline's running call, and the uncond output kept between the
    two calls of a step. One per sharded pipeline (both experts share it)."""

    def __init__(self, pipe: Any):
        self.pipe = pipe
        self.negative: torch.Tensor | None = None
        self._cast: dict[torch.dtype, torch.Tensor] = {}
        self._pair: tuple | None = None  # (prompt, negative, cat): the pair's prompt batch, made once per prompt
        self._kept: _Kept | None = None
        self.paired = 0  # steps whose two calls ran as one program
        self.single = 0  # calls run on their own (no negative prompt, or not a step's pair)
        original = pipe.encode_prompt
        signature = inspect.signature(original)

        @functools.wraps(original)
        def encode_prompt(*args: Any, **kwargs: Any) -> Any:
            prompt_embeds, negative = original(*args, **kwargs)
            # guidance off: the pipeline makes no uncond call even when negative embeddings were given
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            self.record(negative if bound.arguments.get("do_classifier_free_guidance", True) else None)
            return prompt_embeds, negative

        self._wrapper = encode_prompt
        pipe.__dict__["encode_prompt"] = encode_prompt  # this instance only

    def remove(self) -> None:
        """Take the wrapper off the pipeline instance and forget what was kept."""
        if self.pipe.__dict__.get("encode_prompt") is self._wrapper:
            del self.pipe.__dict__["encode_prompt"]
        self.record(None)

    def record(self, negative: torch.Tensor | None) -> None:
        """A new call's negative prompt embeddings (``None``: no guidance)."""
        self.negative, self._cast, self._pair, self._kept = negative, {}, None, None

    def _negative_like(self, prompt: torch.Tensor) -> torch.Tensor | None:
        """The recorded negative prompt as the pipeline passes it (cast to the expert's dtype),
        when it can pair with ``prompt``; ``None`` when there is none or ``prompt`` is it."""
        if self.negative is None or self.negative.shape != prompt.shape:
            return None
        neg = self._cast.get(prompt.dtype)
        if neg is None:
            neg = self._cast[prompt.dtype] = self.negative.to(device=prompt.device, dtype=prompt.dtype)
        return None if torch.equal(neg, prompt) else neg

    def take(self, kwargs: dict) -> torch.Tensor | None:
        """The kept uncond output when this call is the uncond call of the step just run as a pair
        (same latents and timestep objects, the negative prompt, the same other inputs)."""
        kept, self._kept = self._kept, None
        if kept is None:
            return None
        same = (kwargs.get("hidden_states") is kept.hidden_states and kwargs.get("timestep") is kept.timestep
                and _same_prompt(kwargs.get("encoder_hidden_states"), kept.negative)
                and {k: v for k, v in kwargs.items() if k not in ("hidden_states", "timestep", "encoder_hidden_states")}
                .keys() == kept.others.keys()
                and all(kwargs[k] is v for k, v in kept.others.items()))
        return kept.output if same else None

    def run(self, kwargs: dict, forward: Callable[[dict], torch.Tensor]) -> torch.Tensor:
        """One expert call of the pipeline: the uncond call of a pair from what was kept, a cond
        call with a negative prompt as the pair in one ``forward``, anything else on its own."""
        kept = self.take(kwargs)
        if kept is not None:
            return kept
        prompt = kwargs.get("encoder_hidden_states")
        x, t = kwargs.get("hidden_states"), kwargs.get("timestep")
        neg = self._negative_like(prompt) if isinstance(prompt, torch.Tensor) else None
        if neg is None or not isinstance(x, torch.Tensor) or not isinstance(t, torch.Tensor):
            self.single += 1
            return forward(kwargs)
        out = forward(as_pair(kwargs, self._pair_prompt(prompt, neg)))
        cond, uncond = out.chunk(2)
        others = {k: v for k, v in kwargs.items() if k not in ("hidden_states", "timestep", "encoder_hidden_states")}
        self._kept = _Kept(x, t, neg, others, uncond)
        self.paired += 1
        return cond

    def _pair_prompt(self, prompt: torch.Tensor, neg: torch.Tensor) -> torch.Tensor:
        """The pair's prompt batch (cond rows, then uncond), made once per prompt: the same object
        every step, so what is made per prompt (the ``prompt_kv`` patch's state) is found again."""
        if self._pair is None or self._pair[0] is not prompt or self._pair[1] is not neg:
            self._pair = (prompt, neg, torch.cat([prompt, neg]))
        return self._pair[2]


def as_pair(kwargs: dict, prompts: torch.Tensor) -> dict:
    """A cond call's inputs as the pair's: the inputs both branches share repeated (cond rows, then
    uncond), ``prompts`` (the prompt, then the negative prompt) as the prompt."""
    pair = {k: (torch.cat([v, v]) if k in BRANCH_INPUTS and isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()}
    pair["encoder_hidden_states"] = prompts
    return pair


def _same_prompt(a: Any, b: torch.Tensor) -> bool:
    return a is b or (isinstance(a, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b))
