"""The VAE beside the rest: ``shard_pipeline(..., vae=True)`` (the pipeline's own calls go through
the sharded VAE, ``remove()`` puts the same VAE back), the planner's VAE figures, and the compile
bill's rule. In this process on JAX's 8 CPU devices; the decoded video against the unsharded
pipeline is `generate --vae mesh --compare` (docs/vae.md), the compiled bills `scripts/bench_vae.py`.
"""

from __future__ import annotations

import pytest
import torch

from wan_sharding import ShardingError, shard_pipeline
from wan_sharding.compile.vae import VaeCompileRequest, frame_bytes, vae_bill
from wan_sharding.jobs.pcc import compare
from wan_sharding.pipeline.tiny import build_tiny_pipeline
from wan_sharding.pipeline.vae import ShardedVae


@pytest.mark.filterwarnings("ignore:WanPipeline will call torch_xla")  # sharded and removed here, never called
@torch.no_grad()
def test_shard_pipeline_puts_the_vae_on_the_mesh_and_back():
    pipe = build_tiny_pipeline("t2v-a14b")
    vae, entry = pipe.vae, pipe.config["vae"]
    z = torch.randn(1, 16, 1, 4, 8)
    reference = vae.decode(z).sample
    handle = shard_pipeline(pipe, "2x4", backend="jax", vae=True)
    try:
        assert isinstance(pipe.vae, ShardedVae) and pipe.vae.vae is vae
        assert pipe.vae.config is vae.config and pipe.vae.dtype == vae.dtype
        assert pipe.vae_scale_factor_spatial == 8  # what the pipeline read at init is the VAE's
        out = pipe.vae.decode(z)  # what vae.decode returns, computed on the mesh
        assert type(out).__name__ == "DecoderOutput" and out.sample.shape == reference.shape
        value, max_abs = compare(reference, out.sample)
        assert value > 0.99999 and max_abs < 1e-4
        # how the pipeline's __call__ decodes; the same shapes: the programs compiled above
        assert torch.equal(pipe.vae.decode(z, return_dict=False)[0], out.sample)
        assert pipe.vae.calls == {"decode": 2, "encode": 0}
        assert handle.describe()["vae"]["frame_split"] == "H/2 on sp, W/4 on tp"
        with pytest.raises(ShardingError, match="already sharded"):
            shard_pipeline(pipe, "2x4", backend="jax", vae=True)
    finally:
        handle.remove()
    assert pipe.vae is vae and pipe.config["vae"] == entry
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in vae.modules())


def test_the_planner_counts_the_vae():
    from wan_sharding.planner.vae import decode_flops, stage_table, vae_memory_per_chip, video_flops

    # 275 TFLOP for a 480p video through the Wan 2.1 VAE: the figure, counted here on meta
    assert video_flops("wan2.1", "480p") == pytest.approx(275e12, rel=0.01)
    first, later = decode_flops("wan2.1", "480p")
    assert later > 3 * first  # later latent frames decode to 4 video frames, the first to one
    small, big = vae_memory_per_chip("wan2.1", 8, "480p"), vae_memory_per_chip("wan2.1", 32, "720p")
    assert small.weights == big.weights == pytest.approx(126.9e6 * 2, rel=0.01)  # replicated, bf16
    # the cache split over the mesh: 720p's latent frame (90 x 160) has 2.31x the pixels of 480p's
    # (60 x 104), on 4x the chips; a cache not split would read 2.31 here, not 0.58
    pixels = (90 * 160) / (60 * 104)
    assert big.cache / small.cache == pytest.approx(pixels * 8 / 32, rel=0.01)
    # the mid-block attention runs whole on every chip: per latent frame its 4 L^2 c of SDPA (L the
    # latent pixels, c = 384) and 8 L c^2 of 1x1 convs, 67 GFLOP at 480p; the stage time counts it
    # on one chip, not divided over the mesh
    from wan_sharding.planner.vae import attention_flops, vae_stage

    pixels, width = 60 * 104, 384
    whole = attention_flops("wan2.1", "480p")
    assert whole == pytest.approx(4 * pixels**2 * width + 8 * pixels * width**2, rel=0.01)
    # 4x the chips: the rest a quarter, the attention (21 latent frames) the same on each chip
    small, big = (vae_stage("wan2.1", m, "blackhole", "480p").compute_s for m in ("2x4", "8x4"))
    total, attention = video_flops("wan2.1", "480p"), 21 * whole
    assert big / small == pytest.approx((total - attention + 32 * attention) / (4 * (total - attention) + 32 * attention),
                                        rel=1e-3)
    rows = {(r["system"], r["resolution"]): r for r in stage_table()}
    assert set(rows) == {("bh-2x4", "480p"), ("bh-galaxy", "720p"), ("bh-4x32", "720p")}
    for r in rows.values():
        assert set(r["stages"]) == {"text_encoder", "denoising", "vae"} and r["tt_metal_bound_s"]["vae"] > 0


def test_the_vae_bill_allows_one_latent_frame_and_halos():
    req = VaeCompileRequest("wan2.1", "2x4", "480p")
    limit = frame_bytes(req)
    assert limit == 384 * 60 * 104 * 2  # the mid block's width at the 480p latent, bf16
    halo = {"kind": "all_gather", "axis": "tp", "count": 33, "bytes": 1 << 20, "result": "r"}
    frame = {"kind": "all_gather", "axis": "tp", "count": 1, "bytes": limit, "result": "r"}
    local = {"kind": "mesh_partition", "axis": "sp", "count": 3, "bytes": 5 * limit, "result": "r"}
    ok = vae_bill([halo, frame, local], limit)
    assert ok["bill_ok"] and ok["halo_bytes"] == 33 << 20 and ok["largest_collective_bytes"] == limit
    assert ok["local_slices"] == 3 and ok["collective_count"] == 34
    over = vae_bill([halo, {**frame, "kind": "all_reduce", "bytes": 16 * limit}], limit)
    assert not over["bill_ok"] and "moves more than one latent frame" in over["bill_problems"][0]
