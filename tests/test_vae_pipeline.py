"""The VAE beside the rest: ``shard_pipeline(..., vae=True)`` (the pipeline's own calls go through
the sharded VAE, ``remove()`` puts the same VAE back), the planner's VAE figures, and the compile
bill's rule. In this process on JAX's 8 CPU devices; the decoded video against the unsharded
pipeline is `generate --vae mesh --compare` (docs/vae.md), the compiled bills `scripts/bench_vae.py`.
"""

from __future__ import annotations

import pytest
import torch

from wan_sharding import ShardingError, shard_pipeline, shard_vae
from wan_sharding.compile.vae import VaeCompileRequest, frame_bytes, refusal, vae_bill
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
        # the pipeline's sharded VAE given to shard_vae: said as it is, and how to undo it
        with pytest.raises(ShardingError, match=r"^this VAE is already sharded: pipe.vae is the ShardedVae that "
                                                r"shard_pipeline\(\.\.\., vae=True\) put there .* remove\(\) first"):
            shard_vae(pipe.vae, "2x4", backend="jax")
        # a latent of the other VAE (Wan 2.2's 48 channels): one line, before any program runs
        with pytest.raises(ShardingError, match=r"^this VAE decodes a latent of 16 channels, got 48 "):
            pipe.vae.decode(torch.randn(1, 48, 1, 4, 8))
        # a short repr, not the VAE's modules and placed weights
        assert repr(pipe.vae.handle) == "VaeHandle(AutoencoderKLWan on 2x4, jax)"
    finally:
        handle.remove()
    assert pipe.vae is vae and pipe.config["vae"] == entry
    assert not any(m._forward_hooks or m._forward_pre_hooks or "forward" in m.__dict__ for m in vae.modules())


@pytest.mark.filterwarnings("ignore:WanPipeline will call torch_xla")  # sharded and removed here, never called
def test_the_pipelines_padding_none_reaches_the_vae():
    """``shard_pipeline(..., padding="none", vae=True)``: the VAE refuses a frame the mesh does not
    divide too, rather than padding it (the DiT's mask and slice pad it: the VAE's mask)."""
    pipe = build_tiny_pipeline("t2v-a14b")
    for padding, mode in (("none", "none"), ("slice", "mask"), (None, "mask")):
        handle = shard_pipeline(pipe, "2x4", backend="jax", padding=padding, vae=True)
        try:
            assert pipe.vae.handle.padding_mode == mode and pipe.vae.handle.describe()["padding"] == mode
            if mode == "none":
                with pytest.raises(ShardingError, match="latent frame 6x6 does not split .* use padding='mask'"):
                    pipe.vae.decode(torch.randn(1, 16, 1, 6, 6))
        finally:
            handle.remove()


def test_the_planner_counts_the_vae():
    from wan_sharding.planner.stages import stage_table
    from wan_sharding.planner.vae import decode_flops, vae_memory_per_chip, video_flops

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
    # the mid-block attention: per latent frame its 4 L^2 c of SDPA (L the latent pixels, c = 384)
    # and 8 L c^2 of 1x1 convs, 67 GFLOP at 480p whole; on the mesh each chip runs its shard's
    # queries against the frame's keys: every term a chip's pixels over the frame's
    from wan_sharding.planner.vae import attention_flops, attention_share, vae_stage

    pixels, width = 60 * 104, 384
    whole = attention_flops("wan2.1", "480p")
    assert whole == pytest.approx(4 * pixels**2 * width + 8 * pixels * width**2, rel=0.01)
    assert attention_share("wan2.1", "480p", "2x4") == pytest.approx(whole / 8)  # 60 x 104 splits whole
    assert attention_share("wan2.1", "480p", "8x4") == pytest.approx(whole / 32)
    # 720p's 90 x 160 on 8x4: H on the 4-long axis padded to 92, each chip 23 x 20 queries
    assert attention_share("wan2.1", "720p", "8x4") == pytest.approx(
        attention_flops("wan2.1", "720p") * 23 * 20 / (90 * 160), rel=1e-9)
    # 4x the chips at 480p (no padding on either): the whole decode, attention included, a quarter
    small, big = (vae_stage("wan2.1", m, "blackhole", "480p").compute_s for m in ("2x4", "8x4"))
    assert big / small == pytest.approx(1 / 4, rel=1e-9)
    rows = {(r["system"], r["resolution"]): r for r in stage_table()}
    assert set(rows) == {("bh-2x4", "480p"), ("bh-galaxy", "720p"), ("bh-4x32", "720p")}
    for r in rows.values():
        assert set(r["stages"]) == {"text_encoder", "denoising", "vae"} and r["tt_metal_bound_s"]["vae"] > 0


def test_the_text_encoder_stage_counts_one_tp_group():
    """UMT5-XXL's FLOPs per prompt pair, counted from the real config's layers on meta (the weights
    of every matmul, 2 FLOP each per token), and its seconds over the TP group only: every SP
    replica encodes the same prompts, so 2x4, 8x4 and 4x32 (TP 4 each) take the same time."""
    from wan_sharding.models import build_text_encoder
    from wan_sharding.planner.vae import text_encoder_flops, text_encoder_stage

    encoder = build_text_encoder("full", device="meta")
    matmul_weights = sum(m.weight.numel() for m in encoder.encoder.block.modules() if isinstance(m, torch.nn.Linear))
    assert text_encoder_flops() == 2 * matmul_weights * 512 * 2 == pytest.approx(9.48e12, rel=1e-3)
    small, galaxy, big = (text_encoder_stage(m, "blackhole") for m in ("2x4", "8x4", "4x32-tt-metal"))
    assert small.compute_s == galaxy.compute_s == big.compute_s > 0
    one_chip = text_encoder_stage("1x1", "blackhole").compute_s
    assert small.compute_s == pytest.approx(one_chip / 4)


def test_the_vae_bill_allows_one_latent_frame_and_halos():
    req = VaeCompileRequest("wan2.1", "2x4", "480p")
    limit = frame_bytes(req)
    assert limit == 384 * 60 * 104 * 2  # the mid block's width at the 480p latent, bf16
    # a halo gather (vae/halo.py's (lead, nh, rows, nw, cols) view): each of the 4 chips of tp gives
    # one shard's 2 boundary columns, 1 on the shard dim; a chip needs its two neighbours' only
    halo = {"kind": "all_gather", "axis": "tp", "count": 33, "bytes": 1152 * 32 * 4 * 2 * 2,
            "payload": "1152x1x32x1x2xbf16", "result": "1152x1x32x4x2xbf16"}
    rows = {"kind": "all_gather", "axis": "sp", "count": 2, "bytes": 1152 * 2 * 2 * 26 * 2,
            "payload": "1152x1x2x1x26xbf16", "result": "1152x2x2x1x26xbf16"}
    # the mid-block attention's K and V gathers: whole shards of the frame, no halo
    frame = {"kind": "all_gather", "axis": "tp", "count": 2, "bytes": limit,
             "payload": "1x384x60x26xbf16", "result": "1x384x60x104xbf16"}
    local = {"kind": "mesh_partition", "axis": "sp", "count": 3, "bytes": 5 * limit, "payload": "p", "result": "r"}
    ok = vae_bill([halo, rows, frame, local], limit)
    moved = 33 * halo["bytes"] + 2 * rows["bytes"]
    assert ok["bill_ok"] and ok["halo_bytes"] == moved and ok["largest_collective_bytes"] == limit
    assert ok["halo_neighbour_bytes"] == 33 * halo["bytes"] // 4 + 2 * rows["bytes"] // 2
    assert ok["halo_ratio"] == round(moved / ok["halo_neighbour_bytes"], 2) and 2 < ok["halo_ratio"] < 4
    assert ok["halo_collectives"] == 35 and ok["local_slices"] == 3 and ok["collective_count"] == 37
    assert ok["attention_gathers"] == 2 and ok["attention_gather_bytes"] == 2 * limit
    over = vae_bill([halo, {**frame, "kind": "all_reduce", "bytes": 16 * limit}], limit)
    assert not over["bill_ok"] and "moves more than one latent frame" in over["bill_problems"][0]


def test_a_refusal_is_cut_at_whole_clauses():
    error = ("XlaRuntimeError: INTERNAL: Could not apply propagated tensor shardings to tensor dimensions; "
             "Could not update shapes based on their tensor sharding attributes; Failed to run stablehlo pipeline")
    assert refusal(error) == error  # it fits: whole
    short = refusal(error, limit=120)
    assert short == ("XlaRuntimeError: INTERNAL: Could not apply propagated tensor shardings to tensor dimensions "
                     "(and 2 more in the report)")
    assert refusal("Traceback ...\n  lost\n" + "word " * 100, limit=50).endswith("word") and refusal(None)


def test_strategy_all_lists_the_refused_strategies_as_rows():
    """``compile --component vae --strategy all`` on the last bench run's reports (tt-mlir's own
    results, ``results/vae.json``): the halo compiled and holds its bill, so the run is ok (exit 0)
    although tt-mlir refused two of the alternatives, which are rows with whole-clause reasons;
    the same refusal for the strategy asked for is the command's one error line."""
    import json
    from pathlib import Path

    from wan_sharding.cli.vae import format_vae_reports, vae_outcome

    runs = json.loads((Path(__file__).resolve().parents[1] / "results" / "vae.json").read_text())["compile"]
    # each compiled one billed as compile_vae bills it now (the run predates the neighbour-only figures)
    reports = [{**r, **vae_bill(r["collectives"], r["frame_limit_bytes"])} if r.get("ok") else r
               for r in runs if (r["request"]["kind"], r["request"]["mesh"], r["request"]["resolution"],
                                   r["request"]["frontend"], r["request"]["step"]) == ("wan2.1", "2x4", "480p",
                                                                                     "torchax", "first")]
    assert [r["request"]["strategy"] for r in reports] == ["halo", "halo-permute", "annotate", "channels"]
    out = vae_outcome(reports, "halo")
    assert out["ok"] and out["bill_ok"] and out["error"] is None
    assert [r["strategy"] for r in out["refused"]] == ["halo-permute", "annotate"]
    for row in out["refused"]:  # whole clauses of tt-mlir's message, in order
        error = next(r["error"] for r in reports if r["request"]["strategy"] == row["strategy"])
        assert error.startswith(row["reason"].split(" (and ")[0]) and len(row["reason"]) <= 330
    text = format_vae_reports(reports)
    assert text.count("tt-mlir refused it: ") == 2 and "3.1x" in text
    alone = vae_outcome([r for r in reports if r["request"]["strategy"] == "annotate"], "annotate")
    assert not alone["ok"] and alone["error"].startswith("tt-mlir refused the annotate strategy's first step: "
                                                         "XlaRuntimeError: INTERNAL: Could not convert shardy")
