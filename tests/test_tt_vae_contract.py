"""Contract test for the VAE and the text encoder on the ``tt`` backend, with stand-ins for
Tenstorrent's torch plugin (``tt_torch``), which cannot be installed here: in a torch-xla CPU
process (``tests/tt_vae_graphs.py``, over ``tests/tt_graphs.py``'s stand-ins: the
``tt::sharding_constraint`` op registered as tt-xla registers it and a graph-counting ``"tt"``
dynamo backend, ``inline_inbuilt_nn_modules=False`` as tt-xla sets it) the real ``shard_vae`` and
``shard_text_encoder`` run on the real ``TTBackend`` under real dynamo and torch-xla SPMD on 8 CPU
devices; the outputs are compared with the unsharded models' own ``decode`` / ``encode`` / forward.

What it shows, per VAE decode (4 latent frames) and encode (9 video frames: the first, then two
chunks of four), as the DiT's forward is compiled: one ``torch.compile(backend="tt")`` graph per
step kind (first, second, steady), no graph break, every sharding constraint inside a graph (none
eager), the weights the graph's own parameters and only the step's input and cache its inputs; a
warm call of the same shape compiles nothing; each step runs one program (no program replicating
an output for the host), and its input reaches the devices split (each device its piece). The text
encoder likewise for the pipeline's two prompts and a warm call.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from test_tt_contract import WAN_TEST_OPTIONS, run_standin


def _run(*parts: str) -> dict:
    return run_standin("tt_vae_graphs.py", list(parts), 8)


@pytest.fixture(scope="module")
def runs():
    """Two processes at once (each mostly one core's work): the decode and the text encoder, the encode."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = [pool.submit(_run, "decode", "text"), pool.submit(_run, "encode")]
        yield {k: v for f in futures for k, v in f.result().items()}


@pytest.mark.parametrize("part", ["decode", "encode"])
def test_a_vae_call_is_one_tt_graph_per_step_kind(runs, part):
    r = runs[part]
    first, warm = r["first"], r["warm"]
    assert first["breaks"] == {} and warm["breaks"] == {}
    assert len(first["graphs"]) == 3 and r["compiles"] == 3  # first, second, steady: whatever the frames
    assert first["eager"] == 0 and warm["eager"] == 0  # every constraint inside a compiled graph
    assert warm["graphs"] == [] and warm["counters"]["UncachedCompile"] == 0  # warm: nothing compiles
    # the step's input (and, after the first, its cache) are the graph's inputs; the weights its own
    assert first["inputs"][0] == 1 and all(n > 1 for n in first["inputs"][1:])
    assert all(p > 0 for p in first["parameters"])
    assert r["options"] == [WAN_TEST_OPTIONS]  # the DiT's compile options, sent once
    for call in (first, warm):
        assert call["pcc"] >= 0.99999 and call["max_abs"] <= 1e-4, call


@pytest.mark.parametrize("part", ["decode", "encode"])
def test_each_step_runs_one_program_and_its_output_leaves_shard_by_shard(runs, part):
    """Per step one program executed (torch-xla's ``ExecuteReplicated``), none replicating a split
    output for the host (``ReplicateShardedData``: what ``.cpu()`` of a split tensor runs), and the
    input sent once split (each device its piece), not once per device."""
    r = runs[part]
    for call in (r["first"], r["warm"]):
        assert call["counters"]["ExecuteReplicated"] == r["steps"], call["counters"]
        assert call["counters"]["ReplicateShardedData"] == 0
    assert r["frame"][0] != r["frame"][1] or part == "encode"  # the decode's frame is padded: cut on the host
    assert r["upload_bytes"] == r["input_bytes"]  # split on upload: the step's input sent once, not 8 times


def test_the_text_encoder_compiles_once_for_both_prompts_and_leaves_without_a_gather(runs):
    """The pipeline's two prompts (one shape) and the first again: one ``torch.compile``, its graphs
    made by the first call only (two: the padding-mask pre-hook on the encoder's root runs as a
    graph of its own before the forward's, which holds every weight), each call one program, no
    other (the output is replicated: ``.cpu()`` copies one device's copy; torch-xla counts its
    ``ReplicateShardedData`` call, which returns that copy without a program)."""
    r = runs["text"]
    assert r["compiles"] == 1
    assert [len(c["graphs"]) for c in r["calls"]] == [2, 0, 0]  # the second prompt and the warm call: none
    assert r["calls"][0]["parameters"][-1] > 0
    for c in r["calls"]:
        assert c["breaks"] == {} and c["eager"] == 0
        assert c["counters"]["ExecuteReplicated"] == 1  # the forward: no program gathers the output
        assert c["pcc"] >= 0.99999 and c["max_abs"] <= 1e-4, c
