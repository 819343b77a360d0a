"""The rest of the pipeline in the planner's hardware model: the VAE's memory on the mesh beside the
experts', and a per-video estimate of the text encoder's and the VAE's stages (the stage table
with denoising beside them: :mod:`.stages`).

Every figure comes from the same model the planner costs plans with (:mod:`.hardware`: a chip's
peak and matmul efficiency, the fabric's collective cost) applied to counted work:

- **VAE FLOPs**: counted by torch's ``FlopCounterMode`` on the real ``AutoencoderKLWan`` on the
  ``meta`` device (no weights, no compute): the first latent frame's decode and each later one's
  (``decode_flops``). Wan 2.1 VAE, 480p, 81 frames: 275.4 TFLOP. All of it divides over the mesh,
  the mid-block attention too (``attention_flops``: 67 GFLOP per latent frame at 480p): each chip
  runs the queries of its shard of the frame against the whole frame's keys (``attention_share``:
  its padded shard's part).
- **VAE halo**: per decode step, every 3x3 conv exchanges one row per side with its neighbours on
  both axes (two all-gathers of the boundary rows of every frame it convolves, cut as
  ``shard_vae`` cuts them) and the mid-block attention gathers the latent frame's K and V; the frame split
  as ``shard_vae`` lays it; costed with :func:`.hardware.collective_seconds` on the mesh's own
  axes.
- **Text encoder**: UMT5-XXL's encoder (24 layers, d_model 4096, d_ff 10240, 512 tokens, prompt and
  negative prompt) as dense matmul FLOPs, tensor-parallel over the mesh.

Compute runs at the chip's matmul efficiency (the model's one figure, calibrated on the DiT). A
conv3d on Tenstorrent chips reaches much less (tt-metal's own VAE: docs/pipeline-stages.md), so
the VAE estimate is the compute-bound floor of a decode, not a prediction of one.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from ..mesh import mesh_from_preset
from .hardware import chip as chip_for, collective_seconds, fabric_for

BF16 = 2
STEPS = 40  # tt-metal's Wan 2.2 performance test: 40 denoising steps, 81 frames
FRAMES = 81
# The prompt length the Wan 2.2 pipelines encode (``max_sequence_length``), and the prompts per video
# (the prompt and, under guidance, the negative prompt).
PROMPT_TOKENS = 512
PROMPTS = 2


@lru_cache(maxsize=8)
def decode_flops(kind: str, resolution: str) -> tuple[float, float]:
    """(first latent frame, each later latent frame): FLOPs of the VAE's decode, counted on the
    ``meta`` device by torch's flop counter (convs and attention)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from ..models import build_vae

    vae = build_vae(kind, "full", device="meta", dtype=torch.bfloat16)
    h, w = latent_hw(kind, resolution)
    counts = []
    for frames in (1, 2):
        z = torch.empty(1, vae.config.z_dim, frames, h, w, device="meta", dtype=torch.bfloat16)
        with FlopCounterMode(display=False) as counter, torch.no_grad():
            vae.decode(z)
        counts.append(float(counter.get_total_flops()))
    return counts[0], counts[1] - counts[0]


@lru_cache(maxsize=8)
def attention_flops(kind: str, resolution: str) -> float:
    """FLOPs of the decoder's mid-block attention block (norm, to_qkv, SDPA, proj) on one latent
    frame, counted on the ``meta`` device: 67 GFLOP for Wan 2.1 at 480p, 335 at 720p, whole (on one
    chip); on the mesh each chip runs its share (:func:`attention_share`)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from ..models import build_vae

    block = build_vae(kind, "full", device="meta", dtype=torch.bfloat16).decoder.mid_block.attentions[0]
    x = torch.empty(1, block.dim, 1, *latent_hw(kind, resolution), device="meta", dtype=torch.bfloat16)
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        block(x)
    return float(counter.get_total_flops())


def attention_share(kind: str, resolution: str, mesh: str) -> float:
    """FLOPs of the mid-block attention on each chip of ``mesh`` for one latent frame, split as
    ``shard_vae`` splits it (``vae/hooks.py``, ``split_attention``): a chip's queries are its shard
    of the frame as it lies on the mesh (padded), its keys the logical frame's. Every term of the
    block grows with the queries (``4 q L c`` for the scores and their weighted sum, ``8 q c^2`` for
    ``to_qkv`` and ``proj``), so the share is :func:`attention_flops` times the shard's pixels over
    the frame's: at 480p 67 GFLOP whole, 8.4 on each chip of 2x4, 2.1 of 8x4."""
    frame = _latent_frame(kind, resolution, mesh_from_preset(mesh))
    chips = frame.split.nh * frame.split.nw
    return attention_flops(kind, resolution) * frame.padded[0] * frame.padded[1] / chips / (frame.logical[0] * frame.logical[1])


def _latent_frame(kind: str, resolution: str, spec: Any) -> Any:
    """The latent frame of a decode as ``shard_vae`` lays it on ``spec`` (:func:`~wan_sharding.vae.layout.plan_frame`)."""
    from ..models import vae_config
    from ..vae.layout import plan_frame, widest_scale

    return plan_frame(*latent_hw(kind, resolution), spec, "mask", 1, "latent frame",
                      widest_scale(vae_config(kind, "full"), "decode"))


def latent_hw(kind: str, resolution: str) -> tuple[int, int]:
    from ..models import vae_latent_hw

    return vae_latent_hw(kind, resolution)


def video_flops(kind: str, resolution: str, frames: int = FRAMES) -> float:
    first, later = decode_flops(kind, resolution)
    return first + (1 + (frames - 1) // 4 - 1) * later


@lru_cache(maxsize=8)
def _decoder_shapes(kind: str, resolution: str) -> tuple[list[tuple[int, int]], int, int]:
    """Every halo'd conv of one steady decode step (the program every latent frame from the third
    runs) as (values per row and column of its input: channels x the frames it convolves, its
    scale over the latent frame), the step's largest activation in elements, and its time-cache
    elements; from a ``meta`` run with hooks. A causal conv convolves its input's frames plus two
    (the cached ones, or the causal zero pad); an upsampler's 2-D conv each frame."""
    import torch

    from ..models import build_vae

    vae = build_vae(kind, "full", device="meta", dtype=torch.bfloat16)
    h, w = latent_hw(kind, resolution)
    convs: list[tuple[int, int]] = []
    largest = [0]

    def seen(mod, args):
        x = args[0]
        largest[0] = max(largest[0], x.numel())
        if isinstance(mod, torch.nn.Conv3d) and mod.kernel_size[1] == 3:
            convs.append((x.shape[1] * (x.shape[2] + mod.kernel_size[0] - 1), x.shape[-2] // h))
        elif isinstance(mod, torch.nn.Conv2d) and mod.kernel_size[0] == 3:
            convs.append((x.shape[0] * x.shape[1], x.shape[-2] // h))

    handles = [m.register_forward_pre_hook(seen) for m in vae.decoder.modules()
               if isinstance(m, (torch.nn.Conv2d, torch.nn.Conv3d))]
    z = torch.empty(1, vae.config.z_dim, 3, h, w, device="meta", dtype=torch.bfloat16)
    with torch.no_grad():
        vae.clear_cache()
        x = vae.post_quant_conv(z)
        for i in range(3):  # the third step's shapes: the cache is full
            convs.clear()
            largest[0] = 0
            vae.decoder(x[:, :, i:i + 1], feat_cache=vae._feat_map, feat_idx=[0], first_chunk=i == 0)
        cache = sum(c.numel() for c in vae._feat_map if isinstance(c, torch.Tensor))
    for handle in handles:
        handle.remove()
    return convs, largest[0], cache


@dataclass(frozen=True)
class VaeMemory:
    """Per-chip bytes of the VAE on the mesh (bf16): its weights (replicated), the time cache and
    the largest activation of a decode step (split over the mesh, four such tensors live at once:
    a conv's input, its halo'd copy, its output and the residual)."""

    weights: float
    cache: float
    activations: float

    @property
    def total(self) -> float:
        return self.weights + self.cache + self.activations

    def to_json(self) -> dict[str, float]:
        gb = lambda x: round(x / 1e9, 3)  # noqa: E731
        return {"total_gb": gb(self.total), "weights_gb": gb(self.weights), "cache_gb": gb(self.cache),
                "activations_gb": gb(self.activations)}


def vae_memory_per_chip(kind: str, chips: int, resolution: str) -> VaeMemory:
    """The VAE's bytes on each of ``chips`` chips while it decodes ``resolution``."""
    import torch

    from ..models import build_vae

    params = sum(p.numel() for p in build_vae(kind, "full", device="meta", dtype=torch.bfloat16).parameters())
    _, largest, cache = _decoder_shapes(kind, resolution)
    return VaeMemory(params * BF16, cache * BF16 / chips, 4 * largest * BF16 / chips)


@dataclass(frozen=True)
class StageEstimate:
    """Seconds per video of one stage: compute at the model's efficiency, plus communication."""

    stage: str
    compute_s: float
    comm_s: float
    flops: float
    plan: dict[str, Any] | None = None  # denoising: the plan it runs and which ranking chose it

    @property
    def seconds(self) -> float:
        return self.compute_s + self.comm_s

    def to_json(self) -> dict[str, Any]:
        out = {"stage": self.stage, "seconds": round(self.seconds, 4), "compute_s": round(self.compute_s, 4),
               "comm_s": round(self.comm_s, 4), "tflop": round(self.flops / 1e12, 2)}
        return {**out, "plan": self.plan} if self.plan is not None else out


def _mesh_tflops(arch: str, chips: int) -> float:
    c = chip_for(arch)
    return c.peak_tflops * c.matmul_efficiency * chips * 1e12


def vae_stage(kind: str, mesh: str, arch: str, resolution: str, frames: int = FRAMES) -> StageEstimate:
    """The VAE decode of one video on ``mesh``: FLOPs over the mesh (the mid-block attention as each
    chip's share, :func:`attention_share`), plus each step's halo all-gathers and the mid-block
    attention's K and V gathers, on the mesh's own axes, with the frame
    split and padded as ``shard_vae`` lays it (:func:`~wan_sharding.vae.layout.plan_frame`) and
    each halo gather cut as it cuts them (no piece larger than a K or V gather)."""
    from ..models import vae_config
    from ..vae.halo import gather_pieces_for
    from ..vae.layout import frame_values

    spec = mesh_from_preset(mesh)
    fabric = fabric_for(arch, spec.shape)
    flops = video_flops(kind, resolution, frames)
    convs, _, _ = _decoder_shapes(kind, resolution)
    cfg = vae_config(kind, "full")
    frame = _latent_frame(kind, resolution, spec)
    split, (ph, pw) = frame.split, frame.padded
    limit = frame_values(cfg, "decode", frame) * BF16
    axis = {name: fabric.axis(i) for i, name in enumerate(spec.axis_names)}
    comm = 0.0
    for lead, s in convs:  # each shard's boundary rows, then its H-extended boundary columns
        for n, name, payload in ((split.nh, split.h_axis, 2 * pw // split.nw * s * lead * BF16),
                                 (split.nw, split.w_axis, 2 * (ph // split.nh * s + 2) * lead * BF16)):
            if n > 1:
                pieces = gather_pieces_for(n * payload, limit, lead)
                comm += pieces * collective_seconds("all_gather", payload / pieces, n, axis[name], fabric).seconds
    for i, n in enumerate(spec.shape):  # the attention's K and V: a frame each, gathered over both axes
        if n > 1:
            comm += 2 * collective_seconds("all_gather", limit / spec.num_devices, n, fabric.axis(i), fabric).seconds
    steps = 1 + (frames - 1) // 4
    # the mid-block attention (one latent frame per step) as each chip's share of its padded frame;
    # the rest divides over the mesh
    whole, share = (f * steps for f in (attention_flops(kind, resolution), attention_share(kind, resolution, mesh)))
    compute = (flops - whole) / _mesh_tflops(arch, spec.num_devices) + share / _mesh_tflops(arch, 1)
    return StageEstimate("vae", compute, comm * steps, flops)


def text_encoder_flops() -> float:
    """UMT5-XXL (the Wan 2.2 checkpoints' config, ``models.text_encoder_config("full")``) on the prompt
    and the negative prompt of 512 tokens: 2 FLOP per weight of each layer's matmuls (Q, K, V, O;
    the gated FFN's two inputs and output) per token. 9.48 TFLOP per pair; the attention scores add
    about 2 % more and are left out, as the embedding lookup is."""
    from ..models import text_encoder_config

    c = text_encoder_config("full")
    inner = c["num_heads"] * c["d_kv"]
    per_token = 2 * c["num_layers"] * (4 * c["d_model"] * inner + 3 * c["d_model"] * c["d_ff"])
    return per_token * PROMPT_TOKENS * PROMPTS


def text_encoder_stage(mesh: str, arch: str) -> StageEstimate:
    """UMT5-XXL on the prompt and the negative prompt (:func:`text_encoder_flops`) over one TP group
    of the mesh: ``shard_text_encoder`` splits it over the TP axis only, and every SP replica runs
    the same program on the same prompts, so the other chips add nothing (compute only: its
    all-reduces move 512 x 4096 values per layer, microseconds)."""
    spec = mesh_from_preset(mesh)
    flops = text_encoder_flops()
    return StageEstimate("text_encoder", flops / _mesh_tflops(arch, spec.axis_size(spec.tp_axis)), 0.0, flops)
