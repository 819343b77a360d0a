"""Wan 2.2 pipelines that run offline: a tiny random-weight one built in code, or a local checkpoint.

:func:`build_tiny_pipeline` assembles the stock diffusers pipeline class of a variant from tiny
parts with the real structure:

- the expert(s) from :func:`wan_sharding.models.build_dit` (T2V/I2V-A14B: two experts switched at
  the pipeline's ``boundary_ratio``; TI2V-5B: one expert with per-token timesteps,
  ``expand_timesteps=True``);
- a tiny ``AutoencoderKLWan`` with the variant's latent channels and strides (Wan 2.1 VAE for the
  A14B experts: 16 channels, 4x8x8; Wan 2.2 VAE for TI2V-5B: 48 channels, 4x16x16, residual,
  patchified);
- the flow-matching ``UniPCMultistepScheduler`` Wan uses (``prediction_type="flow_prediction"``,
  ``use_flow_sigmas=True``);
- a tiny ``UMT5EncoderModel`` (:func:`wan_sharding.models.build_text_encoder`: the real
  structure, ``d_model`` = the tiny DiTs' ``text_dim``) and a tiny ``T5Tokenizer``
  (:func:`tiny_tokenizer`: transformers' own T5 tokenizer class, a Unigram vocabulary of a few
  hundred pieces built in code), so the pipeline encodes its prompt itself, as a real checkpoint
  does, in 16 tokens (``max_sequence_length``, what the tiny DiTs take); ``text_encoder=False``
  leaves both out, and prompts then become deterministic random embeddings (:func:`prompt_embeddings`).

Nothing is downloaded.
:func:`load_pipeline` loads a real local diffusers checkpoint directory instead.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..models import PROMPT_TOKENS, build_dit, build_text_encoder, config_for, text_encoder_config
from .shard import SUPPORTED_PIPELINES as PIPELINE_CLASSES


@dataclass(frozen=True)
class VariantPipeline:
    """How a Wan 2.2 variant is put together as a diffusers pipeline."""

    pipeline: str  # diffusers class name
    experts: int  # 2: transformer (high noise) + transformer_2 (low noise)
    boundary_ratio: float | None  # the switch point between the two experts, x num_train_timesteps
    expand_timesteps: bool  # TI2V-5B: one timestep per token
    vae: str  # "wan2.1" (16 ch, 8x spatial) or "wan2.2" (48 ch, 16x spatial)
    flow_shift: float
    size: tuple[int, int, int]  # default (frames, height, width) of the tiny run: 2 latent frames, 48 tokens


VARIANT_PIPELINES: dict[str, VariantPipeline] = {
    # Boundary ratios as in the Wan 2.2 diffusers checkpoints (T2V 0.875, I2V 0.9).
    "t2v-a14b": VariantPipeline("WanPipeline", 2, 0.875, False, "wan2.1", 3.0, (5, 64, 96)),
    "i2v-a14b": VariantPipeline("WanImageToVideoPipeline", 2, 0.9, False, "wan2.1", 3.0, (5, 64, 96)),
    "ti2v-5b": VariantPipeline("WanPipeline", 1, None, True, "wan2.2", 5.0, (5, 128, 192)),
}


class PipelineUnavailable(RuntimeError):
    """The diffusers Wan pipeline classes (or a checkpoint) cannot be loaded here."""


def pipeline_classes() -> dict[str, type]:
    """``{"WanPipeline": cls, "WanImageToVideoPipeline": cls}``, or a clear error when diffusers
    cannot provide them (it needs ``transformers`` for its Wan pipeline modules)."""
    import importlib.util

    if importlib.util.find_spec("transformers") is None:
        raise PipelineUnavailable(
            "diffusers' Wan pipelines (WanPipeline, WanImageToVideoPipeline) import the 'transformers' package, "
            "which is not installed; install it (pip install transformers) to use pipelines. The DiT-only paths "
            "(wan-sharding check / specs / compile) do not need it."
        )
    from diffusers.pipelines.wan.pipeline_wan import WanPipeline
    from diffusers.pipelines.wan.pipeline_wan_i2v import WanImageToVideoPipeline

    return {"WanPipeline": WanPipeline, "WanImageToVideoPipeline": WanImageToVideoPipeline}


def tiny_vae(kind: str, seed: int = 0):
    """A tiny ``AutoencoderKLWan`` with the strides and latent channels of the real one (float32, as
    Wan's VAE is run): ``models.TINY_VAE_CONFIGS``."""
    from ..models import build_vae

    return build_vae(kind, "tiny", seed=seed)


# The tiny tokenizer's whole words (each one piece); anything else is spelt out in letters.
TINY_WORDS = ("a an the of in on over through into with and at by from to is are red blue green white black golden "
              "fox bird cat dog horse lake snow river forest city sky sun hour night light running flying walking "
              "fresh long job video slow motion cinematic close up shot camera").split()


def tiny_tokenizer():
    """A tiny ``T5Tokenizer`` (transformers' T5 / UMT5 tokenizer class: SentencePiece-style Unigram
    over ``▁``-prefixed pieces, ``</s>`` appended) with a vocabulary built in code: ``<pad>`` 0,
    ``</s>`` 1, ``<unk>`` 2 as in UMT5, then :data:`TINY_WORDS` as whole pieces and single
    characters for the rest, within the tiny encoder's vocabulary (256)."""
    import string

    from transformers import T5Tokenizer

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    pieces += [(f"▁{w}", -1.0) for w in TINY_WORDS]  # a whole word scores above its letters
    pieces += [(c, -5.0) for c in string.ascii_lowercase + string.digits + string.punctuation]
    pieces += [(f"▁{c}", -4.0) for c in string.ascii_lowercase]
    if len(pieces) > text_encoder_config("tiny")["vocab_size"]:
        raise ValueError(f"the tiny tokenizer has {len(pieces)} pieces, more than the tiny encoder's vocabulary")
    return T5Tokenizer(vocab=pieces, extra_ids=0)


def flow_scheduler(flow_shift: float = 3.0):
    """The flow-matching UniPC scheduler of the Wan 2.2 diffusers checkpoints."""
    from diffusers import UniPCMultistepScheduler

    return UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=flow_shift,
                                   num_train_timesteps=1000, solver_order=2)


def build_tiny_pipeline(variant: str = "t2v-a14b", seed: int = 0, dtype: torch.dtype = torch.float32,
                        blocks: int | None = None, text_encoder: bool = True):
    """The stock diffusers pipeline of ``variant`` with tiny random-weight parts (see module doc).
    ``blocks``: transformer blocks per expert (the tiny config's own count when ``None``; more make
    the blocks dominate a forward, as they do at full size). ``text_encoder``: with the tiny UMT5
    encoder and tokenizer (default), or without (prompt embeddings given in their place)."""
    if variant not in VARIANT_PIPELINES:
        raise ValueError(f"unknown Wan variant {variant!r}; choose one of {', '.join(VARIANT_PIPELINES)}")
    if blocks is not None and blocks < 1:
        raise ValueError(f"blocks must be at least 1, got {blocks}")
    vp = VARIANT_PIPELINES[variant]
    cls = pipeline_classes()[vp.pipeline]
    depth = {} if blocks is None else {"num_layers": blocks}
    experts = {"transformer": build_dit(variant, "tiny", dtype=dtype, seed=seed, **depth)}
    if vp.experts == 2:
        experts["transformer_2"] = build_dit(variant, "tiny", dtype=dtype, seed=seed + 1, **depth)
    encoder = build_text_encoder("tiny", dtype=dtype, seed=seed + 2) if text_encoder else None
    kwargs: dict[str, Any] = dict(tokenizer=tiny_tokenizer() if text_encoder else None, text_encoder=encoder,
                                  vae=tiny_vae(vp.vae, seed),
                                  scheduler=flow_scheduler(vp.flow_shift), boundary_ratio=vp.boundary_ratio,
                                  expand_timesteps=vp.expand_timesteps, **experts)
    if vp.pipeline == "WanImageToVideoPipeline":
        kwargs.update(image_encoder=None, image_processor=None)
    pipe = cls(**kwargs)
    pipe.set_progress_bar_config(leave=True)
    return pipe


def prompt_embeddings(prompt: str, text_dim: int, seq_len: int = PROMPT_TOKENS["tiny"], seed: int = 0,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Stand-in UMT5 output for ``prompt``: (1, seq_len, text_dim), deterministic from the text and
    ``seed``. Like Wan's encoder output, rows past the prompt's tokens (one per word plus EOS) are zero."""
    digest = hashlib.sha256(f"{seed}\0{prompt}".encode()).digest()
    g = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))
    n = max(1, min(seq_len, len(prompt.split()) + 1))
    emb = torch.zeros(1, seq_len, text_dim)
    emb[:, :n] = torch.randn(1, n, text_dim, generator=g)
    return emb.to(dtype)


def test_image(height: int, width: int):
    """The I2V input image, made in code: smooth colour gradients with a disc (a PIL RGB image)."""
    import numpy as np
    from PIL import Image

    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    r = x / max(width - 1, 1)
    g = y / max(height - 1, 1)
    b = ((x - width / 2) ** 2 + (y - height / 2) ** 2 < (min(height, width) / 3) ** 2).astype(np.float32)
    rgb = (np.stack([r, g, 0.2 + 0.6 * b], axis=-1) * 255).astype(np.uint8)
    return Image.fromarray(rgb, "RGB")


def _variant(class_name: str, expand_timesteps: bool) -> str:
    if "ImageToVideo" in class_name:
        return "i2v-a14b"
    return "ti2v-5b" if expand_timesteps else "t2v-a14b"


def pipeline_variant(pipe: Any) -> str:
    """Which Wan 2.2 variant a pipeline is (from its class and config)."""
    return _variant(type(pipe).__name__, bool(getattr(pipe.config, "expand_timesteps", False)))


def checkpoint_variant(path: str | Path) -> str:
    """Which Wan 2.2 variant a checkpoint directory holds, from its ``model_index.json`` alone (the
    class and config :func:`pipeline_variant` reads once it is loaded)."""
    index = json.loads((Path(path) / "model_index.json").read_text())
    return _variant(str(index.get("_class_name")), bool(index.get("expand_timesteps", False)))


def call_kwargs(pipe: Any, prompt: str = "a red fox running through snow", negative_prompt: str = "",
                frames: int | None = None, height: int | None = None, width: int | None = None,
                steps: int = 3, guidance_scale: float = 4.0, seed: int = 0, tiny: bool = True,
                variant: str | None = None, image: Any = None, last_image: Any = None) -> dict[str, Any]:
    """Keyword arguments for ``pipe(**kwargs)``: sizes (when not given: the variant's tiny defaults,
    or 81 frames at 480x832 with ``tiny=False``), a seeded generator, the prompt (as precomputed
    embeddings when the pipeline has no text encoder, as text otherwise: 16 tokens, the tiny DiTs'
    prompt length, with ``tiny``) and, for an image-to-video
    pipeline, ``image`` (default: an input image made in code) and ``last_image`` when given."""
    variant = variant or pipeline_variant(pipe)
    d_frames, d_height, d_width = VARIANT_PIPELINES[variant].size if tiny else (81, 480, 832)
    frames, height, width = frames or d_frames, height or d_height, width or d_width
    kwargs: dict[str, Any] = dict(num_frames=frames, height=height, width=width, num_inference_steps=steps,
                                  guidance_scale=guidance_scale, generator=torch.Generator().manual_seed(seed))
    if getattr(pipe, "text_encoder", None) is None:
        expert = pipe.transformer if pipe.transformer is not None else pipe.transformer_2
        text_dim = expert.config.text_dim
        kwargs.update(prompt_embeds=prompt_embeddings(prompt, text_dim, seed=seed),
                      negative_prompt_embeds=prompt_embeddings(negative_prompt, text_dim, seed=seed))
    else:
        kwargs.update(prompt=prompt, negative_prompt=negative_prompt)
        if tiny:
            kwargs["max_sequence_length"] = PROMPT_TOKENS["tiny"]
    if type(pipe).__name__ == "WanImageToVideoPipeline":
        kwargs["image"] = image if image is not None else test_image(height, width)
        if last_image is not None:
            kwargs["last_image"] = last_image
    elif image is not None or last_image is not None:
        raise ValueError(f"{type(pipe).__name__} takes no image; use image_pipeline(pipe)")
    return kwargs


def image_pipeline(pipe: Any) -> Any:
    """The image-to-video pipeline of ``pipe``: itself when it is a ``WanImageToVideoPipeline``;
    for TI2V-5B (a ``WanPipeline`` with ``expand_timesteps``) a ``WanImageToVideoPipeline`` over the
    very same components (its experts, sharded or not, its VAE and scheduler: nothing is copied),
    which conditions the first frame on an image as diffusers' TI2V-5B image-to-video does; ``None``
    for a pipeline that takes no image (T2V-A14B)."""
    name = type(pipe).__name__
    if name == "WanImageToVideoPipeline":
        return pipe
    if not getattr(pipe.config, "expand_timesteps", False):
        return None
    cls = pipeline_classes()["WanImageToVideoPipeline"]
    i2v = cls(**pipe.components, image_encoder=None, image_processor=None,
              boundary_ratio=pipe.config.boundary_ratio, expand_timesteps=True)
    i2v.set_progress_bar_config(disable=True)
    return i2v


def load_pipeline(path: str | Path, dtype: torch.dtype = torch.bfloat16):
    """A Wan 2.2 diffusers pipeline from a local directory (``local_files_only``: nothing is
    downloaded): a real checkpoint (its UMT5 text encoder needs ``transformers``), or one saved with
    ``save_pretrained`` (the tiny pipeline loads too, with or without its text encoder)."""
    path = Path(path)
    if not (path / "model_index.json").is_file():
        raise PipelineUnavailable(
            f"{path} is not a diffusers pipeline directory (no model_index.json); pass the directory of a "
            "downloaded Wan 2.2 diffusers checkpoint, e.g. a local copy of Wan-AI/Wan2.2-T2V-A14B-Diffusers"
        )
    import json

    try:
        index = json.loads((path / "model_index.json").read_text())
    except ValueError as e:  # a truncated or hand-edited file: say which, not a JSON traceback
        raise PipelineUnavailable(f"{path / 'model_index.json'} is not valid JSON ({e}); re-download or re-save "
                                  "the checkpoint") from None
    if not isinstance(index, dict):
        raise PipelineUnavailable(f"{path / 'model_index.json'} is not a JSON object; re-download or re-save the checkpoint")
    classes = pipeline_classes()  # clear error when transformers is missing
    from diffusers import DiffusionPipeline

    # Components saved as [null, null] (a pipeline saved without a text encoder, like the tiny one)
    # must be passed as None explicitly.
    absent = {k: None for k, v in index.items() if isinstance(v, list) and v and v[0] is None}
    pipe = DiffusionPipeline.from_pretrained(str(path), local_files_only=True, dtype=dtype, **absent)
    if not isinstance(pipe, tuple(classes.values())):
        raise PipelineUnavailable(
            f"{path} holds a {type(pipe).__name__}, not a Wan 2.2 pipeline ({', '.join(PIPELINE_CLASSES)})"
        )
    return pipe


def tiny_text_dim(variant: str) -> int:
    return config_for(variant, "tiny")["text_dim"]
