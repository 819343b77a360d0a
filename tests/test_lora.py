"""LoRA adapters on sharded experts: the split of PEFT's layers beside their bases, the refusals,
the merge before sharding, and whole LoRA pipelines sharded against unsharded with the adapters
switched on the mesh (``wan_sharding.jobs.lora_check``; ``scripts/bench_lora.py`` runs every
variant, mesh, CFG parallel, cache and the merged mode sharded, this file one case per backend stack).

Adapter files are made in code (``wan_sharding.lora.tiny``); nothing is downloaded.
"""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from wan_sharding.jobs.launch import worker_env
from wan_sharding.lora.files import LoraRequest, check_adapter_state, parse_lora_arg, read_lora_file
from wan_sharding.lora.fuse import fuse_lora_layers
from wan_sharding.lora.tiny import adapter_state, write_adapter
from wan_sharding.lora_layers import LoraError, check_layers, live_scales
from wan_sharding.models import build_dit, dit_inputs, latent_for_tokens
from wan_sharding.dit.specs import shard_dit_specs
from wan_sharding.specs import LoraShardingError

PCC_MIN, MAX_ABS = 0.99999, 1e-4  # the suite's fp32 grade (observed: 1 - 1e-13, 3e-6)


@pytest.fixture(scope="module")
def jobs():
    """Both stacks' workers, started together: jax runs T2V-A14B, xla I2V-A14B (three adapters,
    every switch, a hotswap); the merged mode sharded, TI2V-5B, CFG parallel and the caches are
    ``scripts/bench_lora.py``'s."""
    cases = {"jax": [{"variant": "t2v-a14b", "backend": "jax", "mesh": "2x4"}],
             "xla": [{"variant": "i2v-a14b", "backend": "xla", "mesh": "2x4"}]}

    def run(backend: str) -> list[dict]:
        proc = subprocess.run([sys.executable, "-m", "wan_sharding.jobs.lora_check", json.dumps(cases[backend])],
                              env=worker_env(backend, 8), capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return [json.loads(line[7:]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]

    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {b: pool.submit(run, b) for b in cases}
        yield {b: f.result() for b, f in futures.items()}


@pytest.fixture()
def dit_with_lora():
    """A tiny T2V expert with one adapter (Wan's original keys, ``diff_b`` biases) on every Linear a
    Wan LoRA targets, loaded by diffusers."""
    from diffusers.loaders.lora_conversion_utils import _convert_non_diffusers_wan_lora_to_diffusers

    dit = build_dit("t2v-a14b")
    state = _convert_non_diffusers_wan_lora_to_diffusers(adapter_state(dit, rank=4, fmt="wan", bias=True))
    dit.load_lora_adapter(state, adapter_name="a")
    return dit


def test_lora_weights_split_beside_their_base(dit_with_lora):
    plain = shard_dit_specs(build_dit("t2v-a14b"), "2x4").by_name()
    specs = shard_dit_specs(dit_with_lora, "2x4").by_name()
    # the base weights keep their specs under PEFT's base_layer
    assert {n.replace(".base_layer.", "."): s for n, s in specs.items() if ".lora_" not in n} == plain
    q, o, head = "blocks.0.attn1.to_q", "blocks.0.attn1.to_out.0", "proj_out"
    assert specs[f"{q}.base_layer.weight"] == ("tp", None)  # column-parallel base
    assert specs[f"{q}.lora_A.a.weight"] == (None, None)
    assert specs[f"{q}.lora_B.a.weight"] == ("tp", None) and specs[f"{q}.lora_B.a.bias"] == ("tp",)
    assert specs[f"{o}.base_layer.weight"] == (None, "tp")  # row-parallel base
    assert specs[f"{o}.lora_A.a.weight"] == (None, "tp")
    assert specs[f"{o}.lora_B.a.weight"] == (None, None) and specs[f"{o}.lora_B.a.bias"] == (None,)
    assert all(specs[f"{head}.{p}"] == (None,) * len(specs[f"{head}.{p}"])
               for p in ("lora_A.a.weight", "lora_B.a.weight", "lora_B.a.bias"))
    lora = [n for n in specs if ".lora_" in n]
    assert len(lora) == 3 * (2 * 10 + 6)  # A, B and bias on 10 Linears per block (2 blocks) and 6 outside
    assert live_scales(dit_with_lora) == {f"{p}|a": 1.0 for p in {n.split(".lora_")[0] for n in lora}}


def test_what_cannot_be_split_exactly_is_refused(dit_with_lora):
    from peft import LoraConfig

    with pytest.raises(LoraError, match="patch 'qkv' rewrites Linear layers"):
        check_layers(dit_with_lora, ("qkv",))
    check_layers(dit_with_lora, ("rope",))
    dora = build_dit("t2v-a14b")
    dora.add_adapter(LoraConfig(r=2, target_modules=["to_q"], use_dora=True), adapter_name="d")
    with pytest.raises(LoraShardingError, match="DoRA's magnitude vector .* cannot be split exactly"):
        shard_dit_specs(dora, "2x4")
    with pytest.raises(LoraError, match="is a LoRA variant"):
        check_layers(dora)


def test_bad_adapter_inputs_are_refused_before_anything_changes(tmp_path, dit_with_lora):
    dit = dit_with_lora
    assert parse_lora_arg("x.safetensors:0.5:transformer_2") == LoraRequest("x.safetensors", 0.5, "transformer_2")
    assert parse_lora_arg("x.safetensors") == LoraRequest("x.safetensors")
    with pytest.raises(LoraError, match="scale 'big' is not a number"):
        parse_lora_arg("x.safetensors:big")
    with pytest.raises(LoraError, match="does not exist"):
        read_lora_file(tmp_path / "none.safetensors")
    torch.save({"w": torch.zeros(1)}, tmp_path / "a.pt")
    with pytest.raises(LoraError, match="is a pickle"):
        read_lora_file(tmp_path / "a.pt")
    (tmp_path / "bad.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(LoraError, match="not a valid safetensors file"):
        read_lora_file(tmp_path / "bad.safetensors")
    before = {n: p.clone() for n, p in dit.named_parameters()}
    deeper = adapter_state(build_dit("t2v-a14b", num_layers=3), blocks_only=True)
    with pytest.raises(LoraError, match="targets 'blocks.2.attn1.to_.', which this DiT .2 blocks. does not have"):
        check_adapter_state(dit, deeper)
    wider = adapter_state(build_dit("t2v-a14b", ffn_dim=64), blocks_only=True)
    with pytest.raises(LoraError, match="made for another Wan variant"):
        check_adapter_state(dit, wider)
    with pytest.raises(LoraError, match="hotswap: .* has rank 8 but adapter 'a' has rank 4"):
        check_adapter_state(dit, adapter_state(dit, rank=8), hotswap_of="a")
    with pytest.raises(LoraError, match="hotswap: adapter 'a' also targets"):
        check_adapter_state(dit, adapter_state(dit, rank=4, blocks_only=True), hotswap_of="a")
    norm = {"transformer.blocks.0.norm2.lora_A.weight": torch.zeros(2, 8),
            "transformer.blocks.0.norm2.lora_B.weight": torch.zeros(8, 2)}
    with pytest.raises(LoraError, match="which the TP plan does not split as a Linear"):
        check_adapter_state(dit, norm)
    assert list(dit.peft_config) == ["a"]
    assert all(torch.equal(before[n], p) for n, p in dit.named_parameters())
    write_adapter(tmp_path / "ok.safetensors", dit, rank=4)
    assert check_adapter_state(dit, read_lora_file(tmp_path / "ok.safetensors"), hotswap_of="a")


def test_fused_adapters_run_without_lora_ops_and_remove_is_bit_for_bit(dit_with_lora):
    dit = dit_with_lora.eval()
    dit.set_adapters(["a"], [0.7])
    inputs = dit_inputs("t2v-a14b", latent_for_tokens(48))
    with torch.no_grad():
        layered = dit(**inputs, return_dict=False)[0]
    bases = {n: p for n, p in dit.named_parameters() if ".base_layer." in n}
    fused = fuse_lora_layers(dit)
    assert fused.layers == 26 and live_scales(dit) == {}  # merged: no low-rank term left in the forward
    check_layers(dit)  # a merge made here is the sharding's own
    with torch.no_grad():
        merged = dit(**inputs, return_dict=False)[0]
    assert (merged - layered).abs().max() < 1e-5
    fused.remove()
    assert all(p is bases[n] for n, p in dit.named_parameters() if ".base_layer." in n)
    with torch.no_grad():
        assert torch.equal(dit(**inputs, return_dict=False)[0], layered)


def test_sharded_lora_pipelines_match_unsharded_through_every_switch(jobs):
    for r in jobs["jax"] + jobs["xla"]:
        where = f"{r['variant']} {r['backend']} {r['mesh']}"
        assert r["adapters"] == ["a", "b", "c"] and r["restored"], where
        for s in [*r["states"], r["hotswap"]]:
            assert s["pcc"] >= PCC_MIN and s["max_abs"] <= MAX_ABS, (where, s)
        assert r["hotswap"]["moved"] > 1e-2  # the swapped adapter changed the output
        c = {s["state"]: s["compiles"] for s in r["states"]}
        # a new weight and the hotswap (same rank and targets) reuse the compiled forwards;
        # disabling traces each expert's base forward once, and enabling again finds the first one
        assert c["new weights"] == c["weights"], where
        assert c["disabled"] > c["weights"] and c["enabled"] == c["disabled"] == r["hotswap"]["compiles"], where


def test_the_design_bill_counts_the_lora_partial_sums():
    """A LoRA on the row-parallel Linears adds three rank-sized all-reduces over TP per block
    (what ``compile --lora-rank 4`` measured through tt-mlir: 7 small, docs/lora.md); none on a
    mesh without TP."""
    from wan_sharding.compile.bill import design_bill

    base = design_bill("2x4")
    assert design_bill("2x4", lora_rank=4) == {**base, ("all_reduce", "small", "tp"): 7}
    assert design_bill("2x4", lora_rank=64) == {**base, ("all_reduce", "large", "tp"): 6}
    assert design_bill("1x1", lora_rank=64) == design_bill("1x1") == {}
