import pytest
import torch

from wan_sharding import ShardingError, shard_dit_specs
from wan_sharding.models import VARIANTS, build_dit
from wan_sharding.plan import WAN_SP_POINTS, WAN_TP_TABLE, SPGather, SPSplit


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("mesh", ["1x4", "2x4", "8x4"])
def test_full_models_on_meta_get_a_spec_for_every_parameter(variant, mesh):
    dit = build_dit(variant, "full", device="meta")
    specs = shard_dit_specs(dit, mesh)
    names = [n for n, _ in dit.named_parameters()]
    assert list(specs.by_name()) == names  # every parameter, replicated ones spelled out
    for p in dit.parameters():
        assert len(specs[p]) == p.ndim
    blocks = dit.config.num_layers
    counts = specs.counts()
    # per block: q,k,v in both attentions + ffn up = 7 colwise weights + 7 biases
    assert counts["colwise"] == 14 * blocks + 4  # + the two condition-embedder pairs' colwise w+b
    assert counts["rowwise"] == 3 * blocks + 2  # to_out x2, ffn down; time/text linear_2 (weights)
    assert counts["norm_colwise"] == 4 * blocks


def test_megatron_layout_of_one_block():
    dit = build_dit("t2v-a14b", "full", device="meta")
    s = shard_dit_specs(dit, "8x4").by_name()
    for attn in ("attn1", "attn2"):
        for proj in ("to_q", "to_k", "to_v"):
            assert s[f"blocks.7.{attn}.{proj}.weight"] == ("tp", None)
            assert s[f"blocks.7.{attn}.{proj}.bias"] == ("tp",)
        assert s[f"blocks.7.{attn}.norm_q.weight"] == ("tp",)
        assert s[f"blocks.7.{attn}.norm_k.weight"] == ("tp",)
        assert s[f"blocks.7.{attn}.to_out.0.weight"] == (None, "tp")
        assert s[f"blocks.7.{attn}.to_out.0.bias"] == (None,)
    assert s["blocks.7.ffn.net.0.proj.weight"] == ("tp", None)
    assert s["blocks.7.ffn.net.2.weight"] == (None, "tp")
    assert s["blocks.7.norm2.weight"] == (None,)
    assert s["blocks.7.scale_shift_table"] == (None, None, None)
    for emb in ("time_embedder", "text_embedder"):
        assert s[f"condition_embedder.{emb}.linear_1.weight"] == ("tp", None)
        assert s[f"condition_embedder.{emb}.linear_2.weight"] == (None, "tp")
    assert s["condition_embedder.time_proj.weight"] == (None, None)
    assert s["patch_embedding.weight"] == (None,) * 5
    assert s["proj_out.weight"] == (None, None)
    assert s["scale_shift_table"] == (None, None, None)


def test_specs_use_the_meshs_own_axis_names():
    from wan_sharding import MeshSpec

    dit = build_dit("t2v-a14b", "tiny")
    s = shard_dit_specs(dit, MeshSpec((2, 4), ("batch", "model"))).by_name()
    assert s["blocks.0.attn1.to_q.weight"] == ("model", None)


def test_specs_print_by_parameter_name():
    dit = build_dit("t2v-a14b", "tiny")
    text = str(shard_dit_specs(dit, "2x4"))
    assert "blocks.1.ffn.net.2.weight" in text and "(None, 'tp')" in text


def test_heads_not_divisible_by_tp_is_refused_before_anything_changes():
    dit = build_dit("t2v-a14b", "tiny", num_attention_heads=6)
    before = {n: p.clone() for n, p in dit.named_parameters()}
    with pytest.raises(ShardingError, match=r"6 attention heads are not divisible by TP=4.*\[1, 2, 3, 6\]"):
        shard_dit_specs(dit, "2x4")
    assert all(torch.equal(before[n], p) for n, p in dit.named_parameters())


def test_ffn_dim_not_divisible_by_tp_is_refused():
    dit = build_dit("t2v-a14b", "tiny", ffn_dim=250)
    with pytest.raises(ShardingError, match="ffn.net.0.proj.weight: dim 0 of size 250 is not divisible"):
        shard_dit_specs(dit, "1x4")


def test_non_wan_model_is_refused():
    with pytest.raises(ShardingError, match="expected a diffusers WanTransformer3DModel, got Linear"):
        shard_dit_specs(torch.nn.Linear(4, 4), "1x4")


def test_parameter_outside_the_plan_is_an_error_not_a_replication():
    dit = build_dit("t2v-a14b", "tiny")
    dit.blocks[0].extra = torch.nn.Linear(4, 4)  # a layer a future diffusers might add
    with pytest.raises(ShardingError, match=r"2 parameters are not covered by the TP plan \(blocks.0.extra.weight"):
        shard_dit_specs(dit, "1x4")


def test_unknown_style_in_a_plan_is_refused():
    dit = build_dit("t2v-a14b", "tiny")
    with pytest.raises(ShardingError, match="unknown style 'sharded'"):
        shard_dit_specs(dit, "1x4", tp_table={**WAN_TP_TABLE, "proj_out": "sharded"})


def test_sp_plan_matches_diffusers_cp_plan():
    from diffusers import WanTransformer3DModel

    cp = WanTransformer3DModel._cp_plan
    for point in WAN_SP_POINTS:
        entry = cp[point.module]
        if isinstance(point, SPGather):
            assert entry.gather_dim == point.dim
        elif point.arg is None:
            assert all(v.split_dim == point.dim and v.split_output for v in entry.values())
        else:
            assert entry[point.arg].split_dim == point.dim
    assert isinstance(WAN_SP_POINTS[0], SPSplit)
