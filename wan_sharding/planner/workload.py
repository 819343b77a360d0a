"""The workload being planned (model shape x request shape) and the per-chip memory estimate."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from ..mesh import padded_length
from ..mesh import TILE
from ..models import FULL_CONFIGS, PROMPT_TOKENS, RESOLUTIONS, VARIANTS, LatentShape
from ..plan import ShardingPlan

BF16, F32 = 2, 4
# A14B pipelines hold two experts (high noise, low noise) and run both in every request, so both
# stay resident; TI2V-5B has one (docs/design.md).
EXPERTS = {"t2v-a14b": 2, "i2v-a14b": 2, "ti2v-5b": 1}


class WorkloadError(ValueError):
    """Unknown variant or resolution, or a latent the model cannot take."""


@dataclass(frozen=True)
class Workload:
    """One Wan 2.2 DiT forward at one latent size, batch 1: everything the cost model needs."""

    variant: str
    latent: tuple[int, int, int]
    resolution: str | None
    dim: int
    heads: int
    head_dim: int
    ffn: int
    layers: int
    prompt_tokens: int
    patch: tuple[int, int, int]
    experts: int
    out_channels: int = 16
    # The row-parallel collectives in bfp8 (tt-xla's ``enable_activation_dtype_lowering``,
    # :mod:`wan_sharding.planner.bfp8`): about half their bytes, at bfp8's precision.
    bfp8_collectives: bool = False

    @classmethod
    def build(cls, variant: str = "t2v-a14b", resolution: str | None = "480p",
              latent: Sequence[int] | None = None) -> "Workload":
        """The full-size ``variant`` at ``resolution`` (``480p``, ``720p``, ``704p``) or ``latent``
        (frames, height, width of the VAE latent; wins when both are given)."""
        if variant not in FULL_CONFIGS:
            raise WorkloadError(f"unknown Wan variant {variant!r}; choose one of {', '.join(VARIANTS)}")
        cfg = FULL_CONFIGS[variant]
        if latent is None:
            if resolution not in RESOLUTIONS:
                raise WorkloadError(f"unknown resolution {resolution!r}; known: {', '.join(RESOLUTIONS)}")
            r = RESOLUTIONS[resolution]
            latent = (r.frames, r.height, r.width)
        else:
            resolution = None
        lat = tuple(int(v) for v in latent)
        if len(lat) != 3 or any(v % p for v, p in zip(lat, cfg["patch_size"])) or min(lat) < 1:
            raise WorkloadError(f"latent {lat} must be three positive sizes divisible by the patch {cfg['patch_size']}")
        heads, head_dim = cfg["num_attention_heads"], cfg["attention_head_dim"]
        return cls(variant, lat, resolution, heads * head_dim, heads, head_dim,  # type: ignore[arg-type]
                   cfg["ffn_dim"], cfg["num_layers"], PROMPT_TOKENS["full"], tuple(cfg["patch_size"]), EXPERTS[variant],
                   cfg["out_channels"])

    @property
    def tokens(self) -> int:
        """Flat token count L (patchified latent)."""
        return LatentShape(*self.latent).tokens(self.patch)

    def padded_tokens(self, sp: int, padding: str) -> int:
        """L after padding to a multiple of SP x 32 (what ``apply_dit_sp_activation_sharding``
        does; skipped when already a multiple, and with ``padding="none"``)."""
        if padding == "none":
            return self.tokens
        return padded_length(self.tokens, sp * TILE)

    def output_bytes(self) -> int:
        """Bytes of one forward's output (the noise prediction, bf16): what classifier-free guidance
        combines from the cond and uncond forwards."""
        return self.tokens * self.patch[0] * self.patch[1] * self.patch[2] * self.out_channels * BF16

    def block_weight_params(self) -> int:
        """Parameters of the large matrices of one block (attn1, attn2: 4 D x D each; FFN)."""
        return 8 * self.dim * self.dim + 2 * self.dim * self.ffn

    @property
    def label(self) -> str:
        return f"{self.variant} {self.resolution or 'x'.join(map(str, self.latent))} ({self.tokens} tokens)"

    def to_json(self) -> dict[str, Any]:
        return {"variant": self.variant, "resolution": self.resolution, "latent": list(self.latent),
                "tokens": self.tokens, "dim": self.dim, "heads": self.heads, "ffn": self.ffn,
                "layers": self.layers, "experts": self.experts}


# ----------------------------------------------------------------------------------- memory


@dataclass(frozen=True)
class Memory:
    """Per-chip bytes of one plan (both experts' weights resident, and the text encoder's when it
    is on the mesh)."""

    weights: float  # all experts, as sharded (ShardSpecs.bytes_per_device in bf16)
    fsdp_gathered: float  # one block's weights gathered back for use (FSDP only)
    activations: float  # live tensors of one block
    kv_gathered: float  # full-length K and V of the local heads
    scores: float  # one attention's score tensor if materialised (0 under a fused attention)
    scores_if_materialised: float  # what it would be
    text_encoder: float = 0.0  # the UMT5 encoder's weights as sharded, when it is on the mesh (resident too)

    @property
    def total(self) -> float:
        return self.weights + self.text_encoder + self.fsdp_gathered + self.activations + self.kv_gathered + self.scores

    def to_json(self) -> dict[str, float]:
        gb = lambda x: round(x / 1e9, 3)  # noqa: E731
        return {"total_gb": gb(self.total), "weights_gb": gb(self.weights), "text_encoder_gb": gb(self.text_encoder),
                "fsdp_gathered_gb": gb(self.fsdp_gathered),
                "activations_gb": gb(self.activations), "kv_gathered_gb": gb(self.kv_gathered),
                "scores_gb": gb(self.scores), "scores_if_materialised_gb": gb(self.scores_if_materialised)}


def memory_per_chip(work: Workload, plan: ShardingPlan, weight_bytes_per_expert: float,
                    attention: str = "fused", text_encoder_bytes: float = 0.0) -> Memory:
    """Per-chip memory of ``plan``: weights (exact, from the specs; ``text_encoder_bytes``: the
    UMT5 encoder's per chip when it is on the mesh too, 0 when it runs on the host), plus an
    estimate of the largest block's working set.

    Activations of one block, per chip (Ls = padded L / SP tokens, D/TP the local width): the bf16
    residual stream and two f32 LayerNorm temporaries on (Ls, D) (on (Ls, D/TP) with the sharded
    layout), Q, K, V and the attention output on (Ls, D/TP), and the FFN hidden before and after
    GELU on (Ls, F/TP); plus the rope tables. The gathered K and V are (L, D/TP) each. The score
    tensor (heads/TP, Ls, L) in f32 counts only with ``attention="materialised"``.
    """
    m = plan.mesh()
    sp, tp = m.sp, m.tp
    lp = work.padded_tokens(sp, plan.padding)
    ls = lp // sp
    d_local = work.dim // tp
    d_resid = d_local if plan.layout == "sharded" else work.dim
    acts = (ls * d_resid * BF16 + 2 * ls * d_resid * F32  # residual, LayerNorm temporaries
            + 4 * ls * d_local * BF16  # q, k, v, attention output
            + 2 * ls * (work.ffn // tp) * BF16  # FFN hidden, pre/post GELU
            + 2 * ls * work.head_dim * F32)  # rope cos/sin tables
    kv = 2 * lp * d_local * BF16
    scores = (work.heads // tp) * ls * lp * F32
    gathered = work.block_weight_params() // tp * BF16 if (plan.fsdp and sp > 1) else 0
    return Memory(weight_bytes_per_expert * work.experts, gathered, acts, kv,
                  scores if attention == "materialised" else 0.0, scores, text_encoder_bytes)
