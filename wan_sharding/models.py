"""Wan 2.2 DiT variants: the real configs, tiny configs with the same structure, and builders.

Tiny configs keep what the sharding depends on (head-aligned TP up to 8, RMSNorm across heads,
affine cross-attention norm, the variant's channel counts and per-token timesteps for TI2V) at a
size that runs on CPU virtual meshes in seconds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

# diffusers WanTransformer3DModel configs, as the Wan-AI/Wan2.2-*-Diffusers checkpoints' transformer
# config.json files give them (docs/hardware-facts.md lists them with their sources).
_A14B = dict(
    patch_size=(1, 2, 2), num_attention_heads=40, attention_head_dim=128, text_dim=4096, freq_dim=256,
    ffn_dim=13824, num_layers=40, cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6,
    rope_max_seq_len=1024,
)
FULL_CONFIGS: dict[str, dict[str, Any]] = {
    "t2v-a14b": {**_A14B, "in_channels": 16, "out_channels": 16},
    "i2v-a14b": {**_A14B, "in_channels": 36, "out_channels": 16},
    "ti2v-5b": {**_A14B, "num_attention_heads": 24, "ffn_dim": 14336, "num_layers": 30,
                "in_channels": 48, "out_channels": 48},
}
_TINY = dict(
    patch_size=(1, 2, 2), num_attention_heads=8, attention_head_dim=16, text_dim=32, freq_dim=32,
    ffn_dim=256, num_layers=2, cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6,
    rope_max_seq_len=256,
)
TINY_CONFIGS: dict[str, dict[str, Any]] = {
    "t2v-a14b": {**_TINY, "in_channels": 16, "out_channels": 16},
    "i2v-a14b": {**_TINY, "in_channels": 36, "out_channels": 16},
    "ti2v-5b": {**_TINY, "num_attention_heads": 12, "ffn_dim": 192, "in_channels": 48, "out_channels": 48},
}
VARIANTS = tuple(FULL_CONFIGS)
# TI2V-5B takes one timestep per token (the pipeline's expand_timesteps), the A14B experts one per sample.
PER_TOKEN_TIMESTEPS = {"ti2v-5b"}
PROMPT_TOKENS = {"full": 512, "tiny": 16}


def config_for(variant: str, size: str = "tiny", **overrides: Any) -> dict[str, Any]:
    table = {"tiny": TINY_CONFIGS, "full": FULL_CONFIGS}.get(size)
    if table is None:
        raise ValueError(f"unknown model size {size!r}; choose 'tiny' or 'full'")
    if variant not in table:
        raise ValueError(f"unknown Wan variant {variant!r}; choose one of {', '.join(VARIANTS)}")
    return {**table[variant], **overrides}


def build_dit(variant: str = "t2v-a14b", size: str = "tiny", device: str | torch.device = "cpu",
              dtype: torch.dtype = torch.float32, seed: int = 0, **overrides: Any):
    """A ``WanTransformer3DModel`` of ``variant``. ``device="meta"`` builds it without memory
    (names, shapes, dtypes only), which is what compile-only lowering needs for the full model."""
    from diffusers import WanTransformer3DModel

    cfg = config_for(variant, size, **overrides)
    if str(device) == "meta":
        with torch.device("meta"):
            return cast_like_pretrained(WanTransformer3DModel(**cfg), dtype)
    torch.manual_seed(seed)
    dit = WanTransformer3DModel(**cfg)
    # diffusers zero-initialises nothing we rely on, but the default init makes some layers
    # near-identity; random-normal weights exercise every sharded path.
    with torch.no_grad():
        for p in dit.parameters():
            p.normal_(0.0, 0.5 / max(p.shape[-1], 1) ** 0.5 if p.ndim > 1 else 0.1)
    return cast_like_pretrained(dit, dtype).to(device).eval()


def cast_like_pretrained(dit: torch.nn.Module, dtype: torch.dtype, keep: tuple[str, ...] | None = None) -> torch.nn.Module:
    """Cast floating parameters to ``dtype`` except the modules named in ``keep`` (default: those
    diffusers keeps in float32, ``_keep_in_fp32_modules``), as ``from_pretrained(torch_dtype=...)`` does."""
    keep = tuple(getattr(dit, "_keep_in_fp32_modules", None) or ()) if keep is None else keep
    for name, p in dit.named_parameters():
        if p.is_floating_point() and not any(k in name.split(".") for k in keep):
            p.data = p.data.to(dtype)
    return dit


@dataclass(frozen=True)
class LatentShape:
    """Latent video (frames, height, width) after the VAE; tokens = F * H/2 * W/2 for patch 1x2x2."""

    frames: int
    height: int
    width: int

    def tokens(self, patch: tuple[int, int, int] = (1, 2, 2)) -> int:
        return (self.frames // patch[0]) * (self.height // patch[1]) * (self.width // patch[2])


def latent_for_tokens(tokens: int, limit: int = 256) -> LatentShape:
    """A latent shape with exactly ``tokens`` patch tokens (patch 1x2x2), every axis of the
    patchified grid at most ``limit`` (the tiny configs' rope table length)."""
    for frames in range(1, limit + 1):
        if tokens % frames:
            continue
        rest = tokens // frames
        for h in range(1, limit + 1):
            if rest % h == 0 and rest // h <= limit:
                return LatentShape(frames, 2 * h, 2 * (rest // h))
    raise ValueError(f"no latent shape with {tokens} tokens and every axis <= {limit}")


RESOLUTIONS = {
    "480p": LatentShape(21, 60, 104),  # 480x832, 81 frames: 32760 tokens
    "720p": LatentShape(21, 90, 160),  # 720x1280, 81 frames: 75600 tokens
    "704p": LatentShape(31, 44, 80),  # TI2V-5B 704x1280, 121 frames: 27280 tokens
}


def dit_inputs(variant: str, latent: LatentShape, size: str = "tiny", batch: int = 1,
               dtype: torch.dtype = torch.float32, seed: int = 1) -> dict[str, torch.Tensor]:
    """Random forward inputs for ``variant`` at ``latent`` shape (keyword arguments of ``forward``)."""
    cfg = config_for(variant, size)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, cfg["in_channels"], latent.frames, latent.height, latent.width, generator=g)
    if variant in PER_TOKEN_TIMESTEPS:
        t = torch.randint(0, 1000, (batch, latent.tokens(cfg["patch_size"])), generator=g).float()
    else:
        t = torch.randint(0, 1000, (batch,), generator=g).float()
    text = torch.randn(batch, PROMPT_TOKENS[size], cfg["text_dim"], generator=g)
    return {"hidden_states": x.to(dtype), "timestep": t, "encoder_hidden_states": text.to(dtype)}


def guidance_pair(inputs: dict[str, torch.Tensor], seed: int = 2) -> tuple[dict, dict, dict]:
    """A denoising step's two expert calls as the Wan pipelines make them, from ``inputs``: the
    cond call (``inputs``), the uncond call (the same latents and timestep, a random negative
    prompt) and the two as one batch, cond rows first, as CFG parallel runs them."""
    text = inputs["encoder_hidden_states"]
    g = torch.Generator().manual_seed(seed)
    uncond = {**inputs, "encoder_hidden_states": torch.randn(text.shape, generator=g).to(text.dtype)}
    both = {k: torch.cat([inputs[k], uncond[k]]) for k in inputs}
    return inputs, uncond, both


# ---- the UMT5 text encoder -------------------------------------------------------------------
# transformers UMT5EncoderModel configs. Full: UMT5-XXL as every Wan 2.2 diffusers checkpoint holds
# it in text_encoder/config.json (diffusers' scripts/convert_wan_to_diffusers.py takes the encoder
# and tokenizer from google/umt5-xxl; docs/hardware-facts.md lists the figures with their sources):
# 5.7B parameters, a gated-GELU FFN, a relative attention bias in every layer's self-attention.
# Tiny: the same structure (gated gelu_new, per-layer bias, 8 heads for TP up to 8) at the width the
# tiny DiTs take as their prompt (text_dim 32).
_UMT5 = dict(feed_forward_proj="gated-gelu", relative_attention_num_buckets=32, relative_attention_max_distance=128,
             layer_norm_epsilon=1e-6, is_encoder_decoder=False, use_cache=False, tie_word_embeddings=False,
             dropout_rate=0.0, pad_token_id=0, eos_token_id=1)
TEXT_ENCODER_CONFIGS: dict[str, dict[str, Any]] = {
    "full": {**_UMT5, "vocab_size": 256384, "d_model": 4096, "d_kv": 64, "d_ff": 10240, "num_heads": 64,
             "num_layers": 24},
    "tiny": {**_UMT5, "vocab_size": 256, "d_model": 32, "d_kv": 8, "d_ff": 128, "num_heads": 8, "num_layers": 2},
}


def text_encoder_config(size: str = "tiny", **overrides: Any) -> dict[str, Any]:
    """The UMT5 encoder's config of ``size`` (``"tiny"`` or ``"full"``), with ``overrides``."""
    if size not in TEXT_ENCODER_CONFIGS:
        raise ValueError(f"unknown model size {size!r}; choose 'tiny' or 'full'")
    return {**TEXT_ENCODER_CONFIGS[size], **overrides}


def build_text_encoder(size: str = "tiny", device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                       seed: int = 0, **overrides: Any):
    """A transformers ``UMT5EncoderModel`` of ``size`` (random weights, no download). ``device="meta"``
    builds it without memory, as compile-only lowering needs for the 5.7B full one; ``dtype`` is applied
    as transformers' ``from_pretrained(dtype=...)`` applies it (:func:`transformers_fp32_modules`)."""
    from transformers import UMT5Config, UMT5EncoderModel

    config = UMT5Config(**text_encoder_config(size, **overrides))
    if str(device) == "meta":
        with torch.device("meta"):
            encoder = UMT5EncoderModel(config)
            return cast_like_pretrained(encoder, dtype, transformers_fp32_modules(encoder, dtype)).eval()
    torch.manual_seed(seed)
    encoder = UMT5EncoderModel(config)
    with torch.no_grad():  # a scale that keeps every layer's contribution visible in a tiny model
        for p in encoder.parameters():
            p.normal_(0.0, 0.5 / max(p.shape[-1], 1) ** 0.5 if p.ndim > 1 else 0.1)
            if p.ndim == 1:
                p.add_(1.0)  # the layer norms' scales around one
    return cast_like_pretrained(encoder, dtype, transformers_fp32_modules(encoder, dtype)).to(device).eval()


def transformers_fp32_modules(model: torch.nn.Module, dtype: torch.dtype) -> tuple[str, ...]:
    """The modules transformers' ``from_pretrained`` keeps in float32 at ``dtype``: its
    ``_keep_in_fp32_modules`` only for float16 (UMT5's ``wo``: not for bfloat16, which Wan loads),
    ``_keep_in_fp32_modules_strict`` for float16 and bfloat16 (transformers ``modeling_utils.py``)."""
    keep = tuple(getattr(model, "_keep_in_fp32_modules_strict", None) or ())
    if dtype == torch.float16:
        keep += tuple(getattr(model, "_keep_in_fp32_modules", None) or ())
    return keep


def text_encoder_inputs(size: str = "tiny", tokens: int | None = None, valid: tuple[int, ...] = (11,),
                        seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)`` as the Wan pipelines make them: one row per entry of ``valid``
    (that many tokens, the last an EOS, then padding ids with a zero mask) over ``tokens`` positions
    (default: the size's prompt length)."""
    cfg = text_encoder_config(size)
    tokens = PROMPT_TOKENS[size] if tokens is None else tokens
    g = torch.Generator().manual_seed(seed)
    ids = torch.full((len(valid), tokens), cfg["pad_token_id"], dtype=torch.long)
    mask = torch.zeros(len(valid), tokens, dtype=torch.long)
    for row, n in enumerate(valid):
        if not 1 <= n <= tokens:
            raise ValueError(f"a row of {n} valid tokens does not fit {tokens} positions")
        ids[row, :n - 1] = torch.randint(2, cfg["vocab_size"], (n - 1,), generator=g)
        ids[row, n - 1] = cfg["eos_token_id"]
        mask[row, :n] = 1
    return ids, mask
# ---- the VAE (diffusers AutoencoderKLWan) -----------------------------------------------------
# "wan2.1": the Wan 2.1 VAE of the A14B pipelines, AutoencoderKLWan's own defaults (base_dim 96,
# z_dim 16, 4x8x8). "wan2.2": the Wan 2.2 VAE of TI2V-5B, as the Wan-AI/Wan2.2-TI2V-5B-Diffusers
# checkpoint's vae/config.json gives it (residual blocks, 2x2 patchified pixels, 48 channels, 4x16x16;
# latents_mean/std left at the class defaults: they scale latents outside decode and encode).
VAE_KINDS = ("wan2.1", "wan2.2")
FULL_VAE_CONFIGS: dict[str, dict[str, Any]] = {
    "wan2.1": {},
    "wan2.2": dict(base_dim=160, decoder_base_dim=256, z_dim=48, dim_mult=[1, 2, 4, 4], num_res_blocks=2,
                   is_residual=True, in_channels=12, out_channels=12, patch_size=2, scale_factor_spatial=16,
                   scale_factor_temporal=4, temperal_downsample=[False, True, True]),
}
# Tiny: the same structure (strides, residual blocks, patchify, the mid-block attention) with 8 base
# channels and one residual block per level; every channel count divides by 8 (the channel-parallel
# alternative splits them over a mesh axis).
TINY_VAE_CONFIGS: dict[str, dict[str, Any]] = {
    "wan2.1": dict(base_dim=8, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=1, temperal_downsample=[False, True, True]),
    "wan2.2": dict(base_dim=8, z_dim=48, dim_mult=[1, 2, 4, 4], num_res_blocks=1, temperal_downsample=[False, True, True],
                   is_residual=True, patch_size=2, in_channels=12, out_channels=12, scale_factor_spatial=16),
}
# The VAE each DiT variant's pipeline carries.
VAE_OF_VARIANT = {"t2v-a14b": "wan2.1", "i2v-a14b": "wan2.1", "ti2v-5b": "wan2.2"}


# The video frames of the two resolutions (height, width), as the Wan 2.2 pipelines make them.
VIDEO_PIXELS = {"480p": (480, 832), "720p": (720, 1280)}


def vae_latent_hw(kind: str, resolution: str) -> tuple[int, int]:
    """The latent frame of ``resolution``'s video for the VAE ``kind`` (its spatial compression:
    8x for Wan 2.1, 16x for Wan 2.2)."""
    h, w = VIDEO_PIXELS[resolution]
    scale = vae_config(kind, "full").get("scale_factor_spatial", 8)
    return h // scale, w // scale


def vae_config(kind: str, size: str = "tiny") -> dict[str, Any]:
    table = {"tiny": TINY_VAE_CONFIGS, "full": FULL_VAE_CONFIGS}.get(size)
    if table is None:
        raise ValueError(f"unknown model size {size!r}; choose 'tiny' or 'full'")
    if kind not in table:
        raise ValueError(f"unknown VAE {kind!r}; choose one of {', '.join(VAE_KINDS)}")
    return dict(table[kind])


def build_vae(kind: str = "wan2.1", size: str = "tiny", device: str | torch.device = "cpu",
              dtype: torch.dtype = torch.float32, seed: int = 0, **overrides: Any):
    """An ``AutoencoderKLWan`` of ``kind`` (``"wan2.1"`` or ``"wan2.2"``); ``device="meta"`` without
    memory (compile-only). Random weights with a spread that keeps activations O(1) through the
    whole decoder, so a sharding error shows at the output; ``latents_mean``/``std`` random too."""
    from diffusers import AutoencoderKLWan

    cfg = {**vae_config(kind, size), **overrides}
    if str(device) == "meta":
        with torch.device("meta"):
            return torch.nn.Module.to(AutoencoderKLWan(**cfg), dtype)
    g = torch.Generator().manual_seed(seed + 7)
    z_dim = cfg.get("z_dim", 16)
    cfg.setdefault("latents_mean", (torch.randn(z_dim, generator=g) * 0.5).tolist())
    cfg.setdefault("latents_std", (torch.rand(z_dim, generator=g) + 0.5).tolist())
    torch.manual_seed(seed)
    vae = AutoencoderKLWan(**cfg)
    # torch's own cast: diffusers' ModelMixin.to would log that modules "should be kept in float32",
    # naming none (AutoencoderKLWan keeps no module in float32)
    return torch.nn.Module.to(vae, device=device, dtype=dtype).eval()
