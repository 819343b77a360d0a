"""``prompt_kv``: what only the prompt decides, computed once per prompt instead of every step. Exact.

Every denoising step of a Wan DiT recomputes, from the prompt embedding alone, the condition
embedder's text MLP (``condition_embedder.text_embedder``: Linear, GELU, Linear) and, in every
block, cross-attention's ``to_k`` / ``to_v`` projections and ``norm_k``. For one prompt these are
the same at all 40-50 steps of a video (per expert and per guidance branch). With this patch they
are one small program of their own per prompt (the *prompt program*), and the step's program
takes its results as inputs.

What the patch changes, on one model instance (undone by ``remove()``):

- every ``attn2`` gets a per-instance :class:`~wan_sharding.patches.processor.PatchedAttnProcessor`
  with ``prompt_key = "blocks.<i>"``;
- the condition embedder's forward (an instance attribute; the class is untouched) passes a prompt
  state through where diffusers' would run the text MLP.

The model then accepts, in place of ``encoder_hidden_states``, a *prompt state*: a plain dict
``{"blocks.<i>": (K, V)}`` with each block's cross-attention K (after ``norm_k``) and V, split
into heads and laid out heads first, (B, heads, S, head dim), in the model dtype
(:func:`prompt_state`): the head split runs in the prompt program too, and the step reads K and
V as SDPA takes them (its transpose back meets diffusers' dispatch's permute, and tt-mlir folds
the pair: measured, 4 ops per block fewer than a (B, S, channels) state). Given the prompt embedding itself, the
patched model computes exactly what the vanilla one does (so the ``check`` command, the compile
frontends' plain inputs and any direct ``backend.run`` work unchanged).

How the state lives across compiled programs. It is explicit data, never hidden module state: a
compiled step program (``jax.jit`` of the whole forward, a torch-xla lazy graph or a dynamo-compiled
cache program, tt's ``torch.compile``) gets it as ordinary inputs (a dict is a pytree to JAX and an
input structure to dynamo), so the same program serves every prompt of the same length and nothing
is baked in. (On the ``xla`` backend a block cache's programs given a state run lazily instead of
through torch-xla's dynamo bridge, which replayed them with the first prompt's K / V;
``docs/patches.md``.) The prompt program is the backend's :meth:`~wan_sharding.backends.Backend.run_function`:
one ``jax.jit`` over the weights (``jax``), one lazy graph materialised at once (``xla``, ``tt``),
its outputs constrained split over TP on the heads (each device keeps the heads its
cross-attention uses), so the state stays on the devices and the step never copies it from the host.

Where it is used: a sharded pipeline's stand-in (:class:`~wan_sharding.pipeline.ShardedTransformer`,
``shard_pipeline(..., patches=["prompt_kv"])``, ``generate`` / ``profile`` / ``serve`` with
``--patches prompt_kv``) calls :func:`prompt_inputs` before every forward. Its :class:`PromptCache`
(per model) keeps the state of the last :attr:`PromptCache.capacity` (2) prompts: the conditional
and the unconditional one of classifier-free guidance, per expert (each expert is a model of its
own). An entry is reused only when the prompt tensor's values equal, bit for bit, those it was
computed from (compared on the host: a new prompt recomputes, and so does the same tensor changed
in place, however it was changed), and only for the same backend, placement and weights (their
identity and version). A step cache's decisions are unchanged: the step computes the same values.

Memory it holds, per device, per cached prompt: ``blocks x 2 x B x S x channels / TP`` elements in
the model dtype: T2V/I2V-A14B (40 blocks, 5120 channels), S = 512, bf16: 400 MiB / TP (100 MiB on
TP 4), 200 MiB per expert for the two guidance branches, 400 MiB for a two-expert pipeline;
TI2V-5B (30 blocks, 3072): 180 MiB / TP. Plus a host copy of each cached prompt (4 MiB at
512 x 4096 in bf16). :func:`prompt_state_bytes` computes it.

Exactness: the prompt program runs the same modules on the same values, in a program of its own:
bit-identical on the CPU (fp32 max-abs 0, ``tests/test_patches.py``), floating-point reordering
at most where a compiler fuses differently. Composition: any order with the other patches
(``qkv``'s fused ``to_kv`` is read through the processor), before or after sequence parallelism
(SP wraps only self-attention). Refused: Wan 2.1 I2V's image cross-attention (``add_k_proj``) and
its image embedder.
"""

from __future__ import annotations

import types
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch

from .base import Patch, PatchContext, PatchError, Undo, blocks_of, instance_override, wan_classes
from .processor import PatchedAttnProcessor

PromptState = dict  # {"blocks.<i>": (K, V)}: a plain dict, a pytree to JAX and an input structure to dynamo


def is_prompt_state(value: Any) -> bool:
    """Whether ``value`` is a prompt state (what the patched model takes in place of the prompt)."""
    return isinstance(value, dict)


def kv_spec(mesh: Any) -> tuple:
    """The sharding of one K or V of the prompt state, (B, heads, S, head dim): split over TP on the
    heads (those a device's cross-attention uses), whole elsewhere (every SP device attends to the
    whole prompt)."""
    return (None, getattr(mesh, "tp_axis", None), None, None)


def _cross_attentions(dit: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    out = []
    for block in blocks_of(dit):
        proc = block.attn2.processor
        if not isinstance(proc, PatchedAttnProcessor) or proc.prompt_key is None:
            raise PatchError("the model does not carry the 'prompt_kv' patch (its cross-attentions compute their own "
                             "K / V); apply_patches(dit, ['prompt_kv']) first")
        out.append((proc.prompt_key, block.attn2))
    return out


def prompt_state(dit: torch.nn.Module, encoder_hidden_states: torch.Tensor,
                 constrain: Callable[[torch.Tensor], torch.Tensor] | None = None) -> PromptState:
    """The prompt program: the text MLP once, then every block's cross-attention K (after
    ``norm_k``) and V, as the vanilla forward computes them from ``encoder_hidden_states``.
    ``constrain``: applied to each K and V (a backend's sharding constraint)."""
    context = dit.condition_embedder.text_embedder(encoder_hidden_states)
    state = {}
    for key, attn in _cross_attentions(dit):
        k, v = attn.processor.prompt_kv(attn, context)
        state[key] = (k, v) if constrain is None else (constrain(k), constrain(v))
    return state


def prompt_state_like(dit: torch.nn.Module, batch: int, tokens: int, mesh: Any,
                      make: Callable[[tuple[int, ...], tuple], Any]) -> PromptState:
    """A prompt state of stand-ins for a compile: ``make(shape, spec)`` per K and V (e.g. a
    ``jax.ShapeDtypeStruct`` with that sharding), shapes for ``batch`` prompts of ``tokens``."""
    spec = kv_spec(mesh)
    return {key: (make((batch, attn.heads, tokens, attn.inner_dim // attn.heads), spec),
                  make((batch, attn.heads, tokens, attn.kv_inner_dim // attn.heads), spec))
            for key, attn in _cross_attentions(dit)}


def prompt_state_bytes(dit: torch.nn.Module, batch: int, tokens: int, tp: int, itemsize: int) -> int:
    """Bytes of one prompt's state on each device (K and V split over ``tp``)."""
    per_token = sum(attn.inner_dim + attn.kv_inner_dim for attn in (b.attn2 for b in blocks_of(dit)))
    return batch * tokens * per_token * itemsize // tp


def condition_forward(self, timestep: torch.Tensor, encoder_hidden_states: Any,
                      encoder_hidden_states_image: torch.Tensor | None = None, timestep_seq_len: int | None = None):
    """``WanTimeTextImageEmbedding.forward`` (diffusers 0.42) for a prompt state: the time embedding
    as diffusers computes it, the state passed through in place of the text MLP's output. A prompt
    embedding goes to diffusers' own forward."""
    if not is_prompt_state(encoder_hidden_states):
        return type(self).forward(self, timestep, encoder_hidden_states, encoder_hidden_states_image, timestep_seq_len)
    if encoder_hidden_states_image is not None:
        raise ValueError("a prompt state cannot carry image embeddings (Wan 2.1 I2V); pass the prompt embedding")
    timestep = self.timesteps_proj(timestep)
    if timestep_seq_len is not None:
        timestep = timestep.unflatten(0, (-1, timestep_seq_len))
    time_embedder_dtype = next(iter(self.time_embedder.parameters())).dtype
    if timestep.dtype != time_embedder_dtype and time_embedder_dtype != torch.int8:
        timestep = timestep.to(time_embedder_dtype)
    # diffusers casts to the prompt embedding's dtype, which is the model's (the text MLP takes
    # it), and so is the state's
    like = next(iter(encoder_hidden_states.values()))[1]
    temb = self.time_embedder(timestep).type_as(like)
    timestep_proj = self.time_proj(self.act_fn(temb))
    return temb, timestep_proj, encoder_hidden_states, None


# ---- the per-prompt cache a stand-in keeps (host side) ----------------------------------------


@dataclass
class _Entry:
    prompt: torch.Tensor  # a host copy of the values the state was computed from
    state: Any  # the backend's device values (pytree of the prompt state)


class PromptCache:
    """The prompt states of one model on one backend (see the module docstring).

    ``computed`` / ``reused``: prompt programs run and entries reused so far."""

    capacity = 2  # the two guidance branches of one expert

    def __init__(self) -> None:
        self.entries: list[_Entry] = []
        self.owner: tuple | None = None  # (backend, placement, weights) the entries belong to
        self._keep: tuple = ()  # the objects whose ids are in ``owner``, kept alive with it
        self._program: Callable | None = None
        self.computed = 0
        self.reused = 0

    def clear(self) -> None:
        """Forget every cached state (device memory is released with the last reference)."""
        self.entries.clear()
        self.owner, self._keep, self._program = None, (), None

    def state(self, dit: torch.nn.Module, backend: Any, placed: Any, prompt: torch.Tensor) -> Any:
        """The device prompt state for ``prompt`` (a host tensor): a cached one whose prompt has
        the same values, or a new one made by the backend's prompt program."""
        weights = tuple((id(p), p._version) for p in _prompt_weights(dit))
        owner = (id(backend), id(placed), weights)
        if owner != self.owner:
            self.clear()
            self.owner, self._keep = owner, (backend, placed)
            spec = kv_spec(backend.mesh)
            # one function object per owner: the backend compiles it once
            self._program = lambda model, p: prompt_state(model, p, lambda t: backend.constrain(t, spec))
        for i, entry in enumerate(self.entries):
            if (entry.prompt.shape == prompt.shape and entry.prompt.dtype == prompt.dtype
                    and torch.equal(entry.prompt, prompt)):
                self.entries.insert(0, self.entries.pop(i))  # most recent first
                self.reused += 1
                return entry.state
        state = backend.run_function(dit, placed, self._program, prompt)
        self.computed += 1
        self.entries.insert(0, _Entry(prompt.detach().clone(), state))
        del self.entries[self.capacity:]
        return state


def _prompt_weights(dit: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters the prompt program reads (the text MLP, every cross-attention's K / V
    projections and ``norm_k``)."""
    params = list(dit.condition_embedder.text_embedder.parameters())
    for block in blocks_of(dit):
        attn = block.attn2
        for name in ("to_k", "to_v", "to_kv", "norm_k"):
            module = getattr(attn, name, None)
            if module is not None:
                params.extend(module.parameters())
    return params


# model -> its cache while the patch is applied. Weak: a dropped model is forgotten.
_CACHES: "weakref.WeakKeyDictionary[torch.nn.Module, PromptCache]" = weakref.WeakKeyDictionary()


def prompt_cache(dit: torch.nn.Module) -> PromptCache | None:
    """The prompt cache of a model that carries the patch, else ``None``."""
    return _CACHES.get(dit)


def prompt_inputs(dit: torch.nn.Module, backend: Any, placed: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A forward's inputs with the prompt embedding replaced by its device prompt state, when
    ``dit`` carries the patch and the prompt is a host tensor; otherwise as they are. What a
    sharded pipeline's stand-in calls before each forward."""
    cache = _CACHES.get(dit)
    if cache is None:
        return args, kwargs
    if "encoder_hidden_states" in kwargs:
        prompt = kwargs["encoder_hidden_states"]
    elif len(args) > 2:
        prompt = args[2]
    else:
        return args, kwargs
    if not isinstance(prompt, torch.Tensor) or prompt.device.type != "cpu":
        return args, kwargs  # a device tensor or a state already: the forward computes what it needs
    state = cache.state(dit, backend, placed, prompt)
    if "encoder_hidden_states" in kwargs:
        return args, {**kwargs, "encoder_hidden_states": state}
    return (*args[:2], state, *args[3:]), kwargs


# ---- the patch ---------------------------------------------------------------------------------


class PromptKVPatch(Patch):
    name = "prompt_kv"
    exact = True
    after_sp = True
    summary = ("cross-attention K/V (with norm_k) and the text MLP computed once per prompt, passed into every "
               "step's program as inputs")

    def check(self, dit: torch.nn.Module, ctx: PatchContext) -> None:
        tw = wan_classes()
        embedder = getattr(dit, "condition_embedder", None)
        if type(embedder) is not tw.WanTimeTextImageEmbedding or instance_override(embedder) is not None:
            raise PatchError("patch 'prompt_kv' needs the model's stock WanTimeTextImageEmbedding as "
                             "dit.condition_embedder (its forward not replaced); remove whatever replaced it first")
        if embedder.image_embedder is not None:
            raise PatchError("patch 'prompt_kv' does not support image embeddings (Wan 2.1 I2V's image_embedder); "
                             "use it on Wan 2.2 models")
        for i, block in enumerate(blocks_of(dit)):
            attn = block.attn2
            why = PatchedAttnProcessor.fits(attn)
            if why is None and not attn.is_cross_attention:
                why = "it is not a cross-attention (is_cross_attention is False)"
            if why is not None:
                raise PatchError(f"patch 'prompt_kv' does not fit blocks.{i}.attn2: {why}")

    def apply(self, dit: torch.nn.Module, ctx: PatchContext) -> Undo:
        attns = [block.attn2 for block in blocks_of(dit)]
        for i, attn in enumerate(attns):
            PatchedAttnProcessor.on(attn).prompt_key = f"blocks.{i}"
        embedder = dit.condition_embedder
        embedder.forward = types.MethodType(condition_forward, embedder)
        _CACHES[dit] = PromptCache()

        def undo() -> None:
            cache = _CACHES.pop(dit, None)
            if cache is not None:
                cache.clear()
            del embedder.forward
            for attn in attns:
                attn.processor.prompt_key = None
                PatchedAttnProcessor.release(attn)

        return undo


PATCH = PromptKVPatch()
