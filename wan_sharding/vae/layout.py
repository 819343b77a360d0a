"""Where the VAE's work goes on the mesh, as data: which convs need a halo, how a frame is split and
padded, and every parameter's spec. Pure: reads the model (a ``meta`` one too), changes nothing.

The VAE's weights are small (~127 M parameters for the Wan 2.1 VAE, ~700 M for Wan 2.2's) and
every device needs all of them for its piece of the frame, so the spatial strategies keep them
replicated. The channel-parallel alternative (``"channels"``) is tt-xla's recipe for the same class
(``tests/torch/models/wan14b/shared.py``, ``shard_vae_decoder_specs`` / ``shard_vae_encoder_specs``),
written here as data for the side-by-side compile bill: in every residual block ``conv1``'s output
channels split, ``norm2``'s gamma with them, ``conv2``'s input channels split (a Megatron pair per
block); attention, resamplers and the boundary convs replicated; on the mesh's longer axis.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..mesh import MeshSpec
from ..options import PADDING_NAMES
from ..specs import ShardingError, ShardSpecs
from .halo import FrameSplit

# How the VAE can be laid on the mesh. ``halo`` is the package's (H and W split, a halo exchange per
# conv through a small all-gather); the others exist to be compared with it (docs/vae.md):
# ``halo-permute`` (the same with collective-permute shifts), ``annotate`` (only H/W annotations: what
# the partitioner makes of a split conv by itself), ``channels`` (tt-xla's channel-parallel specs).
STRATEGIES: tuple[str, ...] = ("halo", "halo-permute", "annotate", "channels")
DEFAULT_STRATEGY = "halo"
# ``mask``: a frame the mesh does not divide is padded and the padded rows zeroed before every conv
# (exact); ``none``: such a frame is refused. The DiT's K/V slice-back (``slice``) has no meaning here.
VAE_PADDINGS: tuple[str, ...] = ("mask", "none")
DEFAULT_VAE_PADDING = "mask"

# The diffusers module classes of AutoencoderKLWan (0.42.1) the halo plan was written for. A model
# with any other module is refused: a new layer could mix rows across shards unseen.
KNOWN_MODULES = frozenset({
    "AutoencoderKLWan", "WanEncoder3d", "WanDecoder3d", "WanCausalConv3d", "WanRMS_norm", "WanResidualBlock",
    "WanAttentionBlock", "WanMidBlock", "WanResample", "WanUpsample", "WanUpBlock", "WanResidualUpBlock",
    "WanResidualDownBlock", "AvgDown3D", "DupUp3D", "Conv2d", "ZeroPad2d", "Sequential", "ModuleList",
    "Identity", "Dropout", "SiLU",
})


def check_vae_model(vae: Any) -> None:
    """Refuse anything but a diffusers ``AutoencoderKLWan`` made of the modules the plan knows."""
    from diffusers import AutoencoderKLWan

    if getattr(vae, "component", None) == "vae" and isinstance(getattr(vae, "_model", None), AutoencoderKLWan):
        raise ShardingError("this VAE is already sharded: pipe.vae is the ShardedVae that shard_pipeline(..., vae=True) "
                            "put there (its handle: pipe.vae.handle); use it as it is, or call the pipeline handle's "
                            "remove() first (pipe.vae is then the VAE again) and shard that")
    if not isinstance(vae, AutoencoderKLWan):
        raise ShardingError(f"expected a diffusers AutoencoderKLWan, got {type(vae).__name__}; pass the "
                            "pipeline's vae (pipe.vae), or use shard_pipeline(..., vae=True)")
    unknown = sorted({type(m).__name__ for m in vae.modules()} - KNOWN_MODULES)
    if unknown:
        raise ShardingError(f"this AutoencoderKLWan has modules the VAE's halo plan does not know ({', '.join(unknown)}); "
                            "it was written for diffusers 0.42.1's Wan VAE: extend wan_sharding/vae/layout.py first")
    for name, m in vae.named_modules():
        if type(m).__name__ == "WanCausalConv3d" and tuple(m.kernel_size[1:]) not in ((1, 1), (3, 3)):
            raise ShardingError(f"{name} has a {m.kernel_size} kernel; the halo plan covers 1x1 and 3x3 spatial kernels")


def check_strategy(strategy: str, padding: str) -> None:
    if strategy not in STRATEGIES:
        raise ShardingError(f"unknown VAE strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")
    if padding not in VAE_PADDINGS:
        why = "the DiT's K/V slice-back" if padding in PADDING_NAMES else "not a padding mode"
        raise ShardingError(f"padding {padding!r} ({why}) does not apply to the VAE; choose one of {', '.join(VAE_PADDINGS)}")


# Why the VAE is not sharded on a cfg mesh (``--cfg 2``): a decode has no guidance branches, and the
# backends keep a cfg axis for a batch of (cond, uncond) halves; said by the API and the commands.
CFG_MESH_REFUSAL = ("the VAE splits each frame over the mesh's two axes and has no guidance branches, while a cfg "
                    "mesh keeps an axis for the two guidance halves of a batch")


def frame_splits(mesh: MeshSpec) -> tuple[FrameSplit, ...]:
    """The ways a frame can lie on a 2-D mesh: H over the first axis and W over the second, then the
    other way round (one way when both axes are as long)."""
    names = mesh.axis_names
    if mesh.cfg_axis is not None:
        raise ShardingError(f"{CFG_MESH_REFUSAL} ({mesh.name}); shard the VAE on the mesh without cfg (the same "
                            "devices), or leave the VAE off the mesh (vae=False)")
    if len(names) != 2:
        raise ShardingError(f"the VAE needs a 2-D mesh, got axes {names}")
    a, b = mesh.shape
    first = FrameSplit(names[0], names[1], a, b)
    return (first,) if a == b else (first, FrameSplit(names[1], names[0], b, a))


def halo_gather(split: FrameSplit, h: float, w: float) -> float:
    """Per channel and frame, the values the larger of a 3x3 conv's two halo all-gathers hands each
    chip, for shards of ``h x w``: the H exchange gathers one row per side of every shard on H's axis
    (``nh x 2 x w``), the W exchange one column per side of every shard on W's axis, over the rows
    the H exchange extended (``nw x 2 x (h + 2)``). An axis of one shard gathers nothing."""
    return max(split.nh * 2 * w if split.nh > 1 else 0, split.nw * 2 * (h + 2) if split.nw > 1 else 0)


def channel_axis(mesh: MeshSpec) -> str:
    """tt-xla's channel-parallel specs split on the mesh's longer axis (the first on a tie)."""
    return mesh.axis_names[max(range(len(mesh.shape)), key=lambda i: (mesh.shape[i], -i))]


@dataclass(frozen=True)
class Frame:
    """One call's frame: ``logical`` (H, W) as given, ``padded`` (H, W) as it lies on the mesh, at
    the input's resolution (latent for a decode, pixels for an encode), and how it is split
    (``None`` when it stays whole: the ``channels`` strategy)."""

    logical: tuple[int, int]
    padded: tuple[int, int]
    split: FrameSplit | None = None

    def logical_at(self, h: int, w: int) -> tuple[int, int]:
        """The logical size at another resolution whose padded size is ``(h, w)``."""
        return self.logical[0] * h // self.padded[0], self.logical[1] * w // self.padded[1]

    @property
    def is_padded(self) -> bool:
        return self.logical != self.padded


def plan_frame(height: int, width: int, mesh: MeshSpec, padding: str, unit: int, what: str,
               scale: float = 1.0) -> Frame:
    """The frame for ``height x width`` at the input's resolution: split the way whose largest halo
    all-gather is smallest (:func:`halo_gather`, counted on the step's largest frame, ``scale`` times
    the input's: the decoder's output, the encoder's input), and each of H and W padded to a
    multiple of its shard count times ``unit`` (the rows one shard's piece must keep whole through
    the model's downsamplers). The orientation matters on a mesh whose axes differ: an all-gather
    over the 8-long axis of 8x4 hands every chip 8 shards' boundary rows, each as long as a shard's
    extent along the other dim, so that axis carries the dim that gives it the shorter rows (W, for
    a wide video frame). Ties keep H on the first axis. ``padding="none"`` takes only a way that
    needs no padding and refuses the size when there is none."""
    if height % unit or width % unit:
        raise ShardingError(f"{what} {height}x{width} is not a multiple of {unit} (the VAE's spatial compression); "
                            f"use a size divisible by {unit}")
    options = []
    for order, split in enumerate(frame_splits(mesh)):
        padded = tuple(-(-size // (n * unit)) * n * unit for size, n in ((height, split.nh), (width, split.nw)))
        cost = halo_gather(split, padded[0] // split.nh * scale, padded[1] // split.nw * scale)
        options.append((cost, padded[0] * padded[1], order, Frame((height, width), padded, split)))
    fits = [o for o in options if not o[3].is_padded]
    if padding == "none" and not fits:
        frame = min(options)[3]
        raise ShardingError(f"{what} {height}x{width} does not split into {frame.split.nh}x{frame.split.nw} shards of "
                            f"whole {unit}-pixel units; use padding='mask' (pads to {frame.padded[0]}x{frame.padded[1]}, "
                            "exact) or a divisible size")
    return min(fits if padding == "none" else options)[3]


def vae_specs(vae: torch.nn.Module, mesh: MeshSpec, strategy: str = DEFAULT_STRATEGY) -> ShardSpecs:
    """Every parameter's spec: replicated for the spatial strategies, tt-xla's Megatron pairs per
    residual block for ``channels`` (checked: each split channel count divides by the axis)."""
    split: dict[str, tuple] = {}
    if strategy == "channels":
        split = channel_specs(vae, mesh)
    entries = []
    for name, p in vae.named_parameters():
        spec = split.get(name, (None,) * p.ndim)
        entries.append((name, p, spec, "replicate" if name not in split else ("colwise" if spec[0] else "rowwise")))
    return ShardSpecs(entries, mesh)


def channel_specs(vae: torch.nn.Module, mesh: MeshSpec) -> dict[str, tuple]:
    """tt-xla's channel-parallel VAE specs (decoder and encoder residual blocks), by parameter name."""
    axis = channel_axis(mesh)
    n = mesh.axis_size(axis)
    out: dict[str, tuple] = {}
    for name, m in vae.named_modules():
        if type(m).__name__ != "WanResidualBlock":
            continue
        if m.out_dim % n:
            raise ShardingError(f"{name} has {m.out_dim} channels, which {n} devices on axis {axis!r} do not divide; "
                                "the channel-parallel specs need a divisible channel count")
        out[f"{name}.conv1.weight"] = (axis, None, None, None, None)
        out[f"{name}.conv1.bias"] = (axis,)
        out[f"{name}.norm2.gamma"] = (axis, None, None, None)
        out[f"{name}.conv2.weight"] = (None, axis, None, None, None)
    return out


def spatial_units(vae: Any) -> tuple[int, int]:
    """(decode unit, encode unit): the rows a latent shard keeps whole (1), and the pixels of one
    latent row (the VAE's spatial compression, patchify included), which an encode input's shards
    must keep whole so every downsampler halves them exactly."""
    return 1, int(vae.config.scale_factor_spatial)


def frame_values(config: Any, part: str, frame: Frame) -> int:
    """Values of one frame at the mid block's width and the latent resolution, as it lies on the
    mesh (``frame``'s padded size; an encode's frame at its latent rows): what the mid-block
    attention gathers of its K, and of its V, per batch item in one step of ``part``, the frame
    limit of the bill (docs/vae.md).
    ``config`` is the VAE's (``vae.config``) or its config dict (AutoencoderKLWan's defaults filled in)."""
    get = config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d)
    base = get("base_dim", 96)
    width = ((get("decoder_base_dim", None) or base) if part == "decode" else base) * get("dim_mult", [1, 2, 4, 4])[-1]
    unit = 1 if part == "decode" else int(get("scale_factor_spatial", 8))
    h, w = frame.padded
    return width * (h // unit) * (w // unit)


def attention_gather(vae: Any, part: str, batch: int, frame: Frame) -> int:
    """The values each of the mid-block attention's K and V gathers in one step of ``part`` (the
    whole latent frame at its width, per batch item: :func:`frame_values`): the collectives a step
    needs the size of a frame, and the most any halo all-gather is let hand a chip (the bill rule of
    docs/vae.md)."""
    return batch * frame_values(vae.config, part, frame)


def widest_scale(config: Any, part: str) -> float:
    """How much larger the step's largest convolved frame is than its input: a decode's output
    before unpatchify (the latent times the spatial compression over the patch), an encode's input
    after patchify."""
    get = config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d)
    patch = get("patch_size", None) or 1
    return get("scale_factor_spatial", 8) / patch if part == "decode" else 1 / patch
