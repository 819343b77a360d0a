"""``shard_vae``: the Wan VAE split over H and W with a halo per conv, exact against the VAE's own
decode and encode on every CPU mesh and both backends; the frame's orientation on the mesh; the
compiled bill of a decode step; its checks before any change; ``remove()``.

The PCC rows come from the worker path ``check --component vae`` runs (``jobs/vae_check.py``):
one JAX worker for its three meshes and one torch-xla worker, each running its share of the matrix
on tiny random-weight VAEs of the real structure: both VAEs (Wan 2.1 of A14B, Wan 2.2 of TI2V-5B),
decode of 3 latent frames (the time cache carried over two steps) and encode of 5 video frames (two
chunks), H or W the mesh does not divide (padded and masked) and sizes it does, frames that lie
either way round on the mesh, fp32 and bf16. Beside them, ``compile --component vae`` compiles the
tiny Wan 2.2 VAE's decode steps at 480p on 8x4 through tt-mlir (the configuration whose bill
failed before the orientation and the cut gathers). The rows are shared by the tests that read
them (module scope). The in-process tests run on this process's 8 JAX CPU devices.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from wan_sharding import BackendError, ShardingError, shard_vae
from wan_sharding.compile import sysdesc
from wan_sharding.jobs.pcc import compare
from wan_sharding.jobs.vae_check import VaeCase, run_meshes
from wan_sharding.mesh import mesh_from_preset
from wan_sharding.models import build_vae
from wan_sharding.vae.halo import exchange, gather_pieces
from wan_sharding.vae.layout import channel_specs, frame_splits, halo_gather, plan_frame, vae_specs

C = VaeCase.parse
# One worker each, two at a time (the suite's machine has two cores, and a worker's traces and
# compiles use one), in about equal shares: JAX runs several meshes in one process, torch-xla one
# (its devices are the process's). Latent H x W: 5x8 does not split over H on 2 or 8 (padded to 6 /
# 8), 4x8 and 4x16 do; 4x16 on 8x4 (a wide frame, as a video's latent) lies W on the 8-long axis,
# 7x4 on 2x4 (tall, padded to 8) H on the 4-long one; an encode's video is 16x (Wan 2.2) or 8x
# (Wan 2.1) that. The default suite runs what the done-when names (both VAEs decoding on 2x4 and
# 8x4, a padded frame among them) and one encode; the rest is `slow` (scripts/bench_vae.py runs
# `check --component vae`, every case on every mesh and both backends, in full).
# Every strategy shard_vae offers beside the default, and so every halo exchange (halo-permute's is
# exchange="permute"), on a mesh that splits both H and W: one latent frame each (their use is the
# compile comparison of docs/vae.md, where tt-mlir refuses the first two; JAX partitions them all).
STRATEGY_CASES = [C("wan2.1:decode:1,4,8:fp32:halo-permute"), C("wan2.1:decode:1,4,8:fp32:annotate"),
                  C("wan2.1:decode:1,4,8:fp32:channels")]
MATRIX: list[tuple[str, dict[str, list[VaeCase]]]] = [
    ("jax", {"1x4": [C("wan2.1:decode:3,4,8:fp32"), C("wan2.1:decode:1,4,8:fp32:halo:none")],
             "2x4": [C("wan2.1:decode:3,5,8:fp32"), C("wan2.2:encode:2,4,8:bf16"), C("wan2.1:encode:3,4,8:fp32"),
                     *STRATEGY_CASES]}),
    ("jax", {"8x4": [C("wan2.1:decode:3,5,8:fp32"), C("wan2.2:decode:3,4,16:fp32")]}),
    ("xla", {"2x4": [C("wan2.2:decode:3,7,4:fp32")]}),
]
SLOW_MATRIX: list[tuple[str, dict[str, list[VaeCase]]]] = [
    ("jax", {"2x4": [C("wan2.2:decode:3,5,8:fp32")], "8x4": [C("wan2.1:encode:2,5,8:fp32")]}),
    ("xla", {"1x4": [C("wan2.1:decode:3,4,8:fp32")]}),
    ("xla", {"2x4": [C("wan2.1:encode:2,5,8:bf16")]}),
    ("xla", {"8x4": [C("wan2.1:decode:3,5,8:fp32"), C("wan2.2:decode:3,5,4:fp32")]}),
]
# `wan-sharding compile` as a user runs it: the tiny Wan 2.2 VAE at 480p on 8x4, the three decode steps.
COMPILE = ("compile", "--component", "vae", "--size", "tiny", "--vae-kind", "wan2.2", "--mesh", "8x4",
           "--resolution", "480p", "--json")


def _compile(out: Path) -> tuple[int, dict]:
    proc = subprocess.run([sys.executable, "-m", "wan_sharding.cli", *COMPILE, "--out", str(out)], capture_output=True,
                          text=True, timeout=900)
    return proc.returncode, json.loads(proc.stdout) if proc.stdout.strip() else {"stderr": proc.stderr[-3000:]}


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """Every worker of the default matrix and the compile, two at a time (the compile third: after
    the shorter of the first two)."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures: dict[str, Future] = {}
        for i, (backend, share) in enumerate(MATRIX):
            futures[f"{backend}-{i}"] = pool.submit(run_meshes, backend, share)
            if i == 1 and sysdesc.installed_plugin_version() is not None:
                futures["compile"] = pool.submit(_compile, tmp_path_factory.mktemp("vae-compile"))
        yield futures


@pytest.fixture(scope="module")
def rows(jobs) -> dict[tuple[str, str], list[dict]]:
    out: dict[tuple[str, str], list[dict]] = {}
    for name, future in jobs.items():
        if name != "compile":
            for r in future.result():
                out.setdefault((r["backend"], r["mesh"]), []).append(r)
    return out


def _row(rows: dict, backend: str, mesh: str, case: VaeCase) -> dict:
    return next(r for r in rows[(backend, mesh)] if r["case"] == str(case))


def _graded(r: dict) -> None:
    assert r["ok"], f"{r['case']}: PCC {r['pcc']:.9f}, max|diff| {r['max_abs']:.2e} (bound {r['max_abs_bound']})"
    assert r["halo_modules"] > 0 and r["split"].startswith("H/")


CASES = [(b, m, c) for b, share in MATRIX for m, cases in share.items() for c in cases
         if not c.exchange and c not in STRATEGY_CASES]


@pytest.mark.parametrize("backend,mesh,case", CASES, ids=[f"{b}-{m}-{c}" for b, m, c in CASES])
def test_sharded_vae_matches_the_vae_within_the_grade(rows, backend, mesh, case):
    _graded(_row(rows, backend, mesh, case))


@pytest.mark.slow
def test_the_rest_of_the_matrix_matches_too():
    with ThreadPoolExecutor(max_workers=2) as pool:
        for future in [pool.submit(run_meshes, b, share) for b, share in SLOW_MATRIX]:
            for r in future.result():
                _graded(r)


def test_the_matrix_covers_what_the_issue_asks(rows):
    """Both VAEs, decode and encode, padded and unpadded frames, fp32 and bf16, >= 3 latent frames,
    every CPU mesh, both backends, both orientations of a frame on the mesh."""
    cases = [c for _, _, c in CASES]
    assert {c.vae for c in cases} == {"wan2.1", "wan2.2"} and {c.part for c in cases} == {"decode", "encode"}
    assert {c.dtype for c in cases} == {"fp32", "bf16"}
    assert all(c.shape[0] >= 3 for c in cases if c.part == "decode")
    # an fp32 encode of 3 latent frames: the first video frame, then two chunks of four, the third
    # step being the one every later chunk reuses (its cache full)
    assert any(c.part == "encode" and c.dtype == "fp32" and c.shape[0] >= 3 for c in cases)
    assert {m for _, m, _ in CASES} == {"1x4", "2x4", "8x4"} and {b for b, _, _ in CASES} == {"jax", "xla"}
    assert {m for b, share in SLOW_MATRIX if b == "xla" for m in share} == {"1x4", "2x4", "8x4"}  # -m slow
    for mesh in ("2x4", "8x4"):  # the done-when: both VAEs decode on 2x4 and 8x4, a padded frame among them
        for vae in ("wan2.1", "wan2.2"):
            assert any(m == mesh and c.vae == vae and c.part == "decode" for _, m, c in CASES)
        found = [r for (b, m), rs in rows.items() if m == mesh for r in rs]
        assert any(r["frame"] != r["padded"] and r["part"] == "decode" and r["ok"] for r in found)
    splits = {(r["mesh"], r["split"]) for rs in rows.values() for r in rs}
    assert ("8x4", "H/4 on tp, W/8 on sp") in splits and ("8x4", "H/8 on sp, W/4 on tp") in splits
    assert ("2x4", "H/4 on tp, W/2 on sp") in splits and ("2x4", "H/2 on sp, W/4 on tp") in splits


@pytest.mark.parametrize("case", STRATEGY_CASES, ids=[c.strategy for c in STRATEGY_CASES])
def test_every_strategy_and_exchange_the_api_offers_is_exact(rows, case):
    """``halo-permute`` (the halo's shifts as collective-permutes: ``exchange="permute"``),
    ``annotate`` (only the frame's H/W annotations: the partitioner's own conv halo) and ``channels``
    (tt-xla's channel-parallel specs, the frame whole) decode within the grade on 2x4 with JAX."""
    r = _row(rows, "jax", "2x4", case)
    assert r["ok"], f"{r['case']}: PCC {r['pcc']:.9f}, max|diff| {r['max_abs']:.2e}"
    assert r["halo_modules"] == {"halo-permute": 42, "annotate": 0, "channels": 0}[case.strategy]
    assert r["split"] == ("-" if case.strategy == "channels" else "H/2 on sp, W/4 on tp")


def test_the_comparison_fails_without_the_halo(rows):
    """The same decode with every shard convolved alone (no neighbour rows): wrong at each shard
    border, and the grade says so."""
    r = _row(rows, "jax", "1x4", C("wan2.1:decode:1,4,8:fp32:halo:none"))
    assert not r["ok"] and r["pcc"] < 0.999 and r["max_abs"] > 1e-2


def test_no_collective_of_a_decode_step_moves_more_than_a_frame(jobs):
    """The bill rule, on tt-mlir's own output: the tiny Wan 2.2 VAE at 480p on 8x4 (whose 8-long axis
    carried H before, and whose later steps were refused: a ``dynamic_slice`` of the cache), both
    the first step's program, the second's and the one every later latent frame reuses. W lies on the 8-long
    axis; each collective is an all-gather of halo rows, none larger than a frame, but the
    attention's K and V gathers (four: each over one mesh axis, then the other)."""
    if "compile" not in jobs:
        pytest.skip("jax-tt-plugin is not installed")
    code, report = jobs["compile"].result()
    assert code == 0 and report["ok"] and report["bill_ok"], report
    by_step = {r["request"]["step"]: r for r in report["reports"]}
    assert set(by_step) == {"first", "second", "steady"} and by_step["steady"]["reused_by_later_frames"]
    assert not by_step["second"]["reused_by_later_frames"]  # its cache holds one frame: a program of its own
    for r in by_step.values():
        assert r["frame_split"] == "H/4 on tp, W/8 on sp"
        kinds = {c["kind"] for c in r["collectives"]} - {"mesh_partition"}
        assert kinds == {"all_gather"}, kinds  # no point-to-point chain, no all-to-all
        assert r["largest_collective_bytes"] == r["frame_limit_bytes"] == 32 * 32 * 56 * 2  # 30x52 padded, bf16
        # every collective is a halo's but the attention's K and V gathers, one all-gather each per mesh axis
        assert not r["bill_problems"] and r["attention_gathers"] == 4
        assert r["halo_collectives"] == r["collective_count"] - 4
        # the halo against what each chip needs of it (its neighbours' rows): H over 4, W over 8
        assert r["halo_bytes"] > 0 and 4 < r["halo_bytes"] / r["halo_neighbour_bytes"] < 8


# ---- the layout, as data --------------------------------------------------------------------------


def test_a_frame_lies_the_way_its_halo_gathers_are_smallest():
    """Per frame, from its shapes: H on one axis, W on the other, the way round whose larger halo
    all-gather per channel (on the decoder's output, 8x the latent) is smaller."""
    mesh = mesh_from_preset("8x4")
    h_on_8, w_on_8 = frame_splits(mesh)
    # Wan 2.2's 480p latent, 30x52: H/8 gathers 8 shards x 2 rows x 104 columns, W/8 gathers 8 x 2 x (64 + 2)
    assert halo_gather(h_on_8, 4 * 8, 13 * 8) == 8 * 2 * 104 and halo_gather(w_on_8, 8 * 8, 7 * 8) == 8 * 2 * 66
    frame = plan_frame(30, 52, mesh, "mask", 1, "latent", 8)
    assert frame.split == w_on_8 and frame.padded == (32, 56)
    assert plan_frame(60, 104, mesh, "mask", 1, "latent", 8).padded == (60, 104)  # Wan 2.1 480p: no padding now
    assert plan_frame(30, 52, mesh_from_preset("2x4"), "mask", 1, "latent", 8).split.describe() == "H/2 on sp, W/4 on tp"
    assert len(frame_splits(mesh_from_preset("8x8-dual-galaxy"))) == 1  # axes as long: one way only
    # 8x20: W/8 pads 20 to 24 and still gathers less; padding="none" takes the way round that needs
    # none, and refuses when neither way does
    assert plan_frame(8, 20, mesh, "mask", 1, "latent", 8).split == w_on_8
    assert plan_frame(8, 20, mesh, "none", 1, "latent", 8).split == h_on_8
    with pytest.raises(ShardingError, match="padding='mask'"):
        plan_frame(5, 20, mesh, "none", 1, "latent", 8)
    video = plan_frame(704, 1280, mesh, "mask", 16, "video", 0.5)  # an encode: 44 x 80 units of 16 pixels
    assert video.split == w_on_8 and video.padded == (704, 1280)


def test_a_halo_gather_larger_than_the_frame_gather_is_cut_and_gives_the_same_rows():
    """In the global view (no partitioner: the constraint is the identity): the pieces hand each
    chip at most ``max_gather`` values and the extended shards are the same."""
    x = torch.randn(12, 4, 3, 2, 5)  # (channels x frames, nh, h, nw, w)
    spec = (None, "sp", None, "tp", None)
    same = lambda t, s: t  # noqa: E731
    ends = torch.cat([x.narrow(2, 2, 1), x.narrow(2, 0, 1)], 2)  # what the H exchange gathers
    assert gather_pieces(ends, 1, spec, None) == 1
    assert gather_pieces(ends, 1, spec, 12 * 4 * 2 * 5) == 1  # per chip: 12 x 4 shards x 2 rows x 5
    assert gather_pieces(ends, 1, spec, 100) == 5 and gather_pieces(ends, 1, spec, 1) == 12  # at most one per lead row
    whole = exchange(x, 1, "sp", 1, 1, spec, same)
    assert torch.equal(exchange(x, 1, "sp", 1, 1, spec, same, max_gather=100), whole)
    assert torch.equal(whole[:, 1:, 0], x[:, :-1, 2]) and torch.equal(whole[:, :-1, -1], x[:, 1:, 0])  # neighbours' rows
    assert not whole[:, 0, 0].any() and not whole[:, -1, -1].any()  # the outermost: the conv's zero padding


# ---- in this process (JAX, 8 CPU devices) ------------------------------------------------------


def _state(vae):
    hooks = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in vae.modules())
    attrs = [(n, getattr(m, "_padding", None), getattr(m, "padding", None), "forward" in m.__dict__)
             for n, m in vae.named_modules()]
    params = [(n, id(p), p.detach().clone()) for n, p in vae.named_parameters()]
    return hooks, attrs, params


def _same(a, b):
    return a[0] == b[0] and a[1] == b[1] and all(
        n1 == n2 and i1 == i2 and torch.equal(t1, t2) for (n1, i1, t1), (n2, i2, t2) in zip(a[2], b[2]))


@torch.no_grad()
def test_decode_returns_what_the_vae_returns_and_remove_restores_it():
    """The hooks go on this instance only and come off exactly; the hooked model called by itself
    says how to run it. (The decode through the handle, against the VAE's own, in this process:
    tests/test_vae_pipeline.py; on every mesh: the worker rows above.)"""
    vae = build_vae("wan2.1")
    other = copy.deepcopy(vae)
    before = _state(vae)
    z = torch.randn(1, 16, 1, 4, 8)
    reference = vae.decode(z)
    handle = shard_vae(vae, "2x4", backend="jax")
    assert _state(vae)[0] > before[0] and vae.decoder.conv_in._padding == (0, 0, 0, 0, 0, 0)
    assert "forward" in vae.decoder.mid_block.attentions[0].__dict__  # the split attention, this instance's
    assert "forward" not in other.decoder.mid_block.attentions[0].__dict__
    assert not any(m._forward_hooks for m in other.modules())  # another instance is untouched
    with pytest.raises(ShardingError, match="through its handle"):
        vae.decode(z)  # the hooked model called by itself: one line saying how to run it
    handle.remove()
    assert _same(_state(vae), before)
    assert torch.equal(vae.decode(z).sample, reference.sample)


@torch.no_grad()
def test_bad_requests_are_refused_before_the_vae_is_changed():
    vae = build_vae("wan2.1")
    before = _state(vae)
    for call, error, text in [
        (lambda: shard_vae(torch.nn.Linear(2, 2), "2x4"), ShardingError, "expected a diffusers AutoencoderKLWan"),
        (lambda: shard_vae(vae, "2x4", padding="slice"), ShardingError, "does not apply to the VAE"),
        (lambda: shard_vae(vae, "2x4", strategy="rows"), ShardingError, "unknown VAE strategy"),
        (lambda: shard_vae(vae, "2x4", exchange="teleport"), ShardingError, "unknown halo exchange"),
        (lambda: shard_vae(vae, "8x4"), BackendError, "needs 32 devices"),
    ]:
        with pytest.raises(error, match=text):
            call()
        assert _same(_state(vae), before)
    handle = shard_vae(vae, "2x4", padding="none")
    with pytest.raises(ShardingError, match="already sharded"):
        shard_vae(vae, "2x4")
    with pytest.raises(ShardingError, match="padding='mask'"):
        handle.decode(torch.randn(1, 16, 1, 5, 8))  # 5 rows on 2: refused with padding none
    with pytest.raises(ShardingError, match="multiple of 8"):
        handle.encode(torch.randn(1, 3, 1, 36, 64))
    vae.enable_tiling()
    with pytest.raises(ShardingError, match="disable_tiling"):
        handle.decode(torch.randn(1, 16, 1, 4, 8))
    vae.disable_tiling()
    handle.remove()
    assert _same(_state(vae), before)


def test_specs_are_data():
    meta = build_vae("wan2.2", "full", device="meta")
    assert all(s == (None,) * len(s) for s in vae_specs(meta, mesh_from_preset("8x4")).by_name().values())
    channels = channel_specs(meta, mesh_from_preset("8x4"))  # tt-xla's recipe: conv1 out, norm2, conv2 in, on the 8-axis
    assert channels["decoder.mid_block.resnets.0.conv1.weight"][0] == "sp"
    assert channels["decoder.mid_block.resnets.0.conv2.weight"][1] == "sp"


@torch.no_grad()
def test_the_attention_is_split_and_shape_work_is_done_once():
    """A padded decode (latent 5x8 on 2x4: padded to 6x8, H/2 on sp, W/4 on tp) against the VAE's
    own, twice. The mid-block attention's program on each chip: scores of its 3x2 shard's 6
    queries against the 40 logical keys (padded pixels are no keys), never the frame's 40 x 40;
    K and V reach it by all-gathers of the padded frame's shards. Shape-only work, counted on its
    cache objects: one frame plan per shape (the same object at the second call), the step
    function made once, the mask row tables built once per size (two dims at the latent and at
    each of 3 upsamplings: 8) and the halo's selection matrices once per axis length and
    direction (2 and 4, +1 and -1: 4), every later conv reading them."""
    import re

    from wan_sharding.vae.halo import kept_rows, selection
    from wan_sharding.vae.programs import pad_frame

    vae = build_vae("wan2.1")
    z = torch.randn(1, 16, 1, 5, 8)
    reference = vae.decode(z).sample
    kept_rows.cache_clear()
    selection.cache_clear()
    handle = shard_vae(vae, "2x4", backend="jax")
    try:
        out = handle.decode(z).sample
        value, max_abs = compare(reference, out)
        assert value >= 0.99999 and max_abs <= 1e-4, (value, max_abs)
        frame, functions = handle.plan_decode(tuple(z.shape)), dict(handle.steps._functions)
        rows, picks = kept_rows.cache_info(), selection.cache_info()
        assert (frame.padded, frame.split.describe()) == ((6, 8), "H/2 on sp, W/4 on tp")
        assert rows.misses == 8 and rows.hits > rows.misses and picks.misses == 4 and picks.hits > picks.misses
        assert torch.equal(handle.decode(z).sample, out)  # the same shape again: nothing shape-only rebuilt
        assert list(handle.frames.values()) == [frame] and handle.plan_decode(tuple(z.shape)) is frame
        assert handle.steps._functions == functions and len(functions) == 1
        assert kept_rows.cache_info().misses == 8 and selection.cache_info().misses == 4
        # the first step's program as the devices run it (partitioned: per-device shapes)
        first = handle.step_function("decode", tuple(z.shape))
        with handle.tracing("decode", frame):
            program = handle.backend.step_program(vae, first)
            piece = handle.backend.upload(pad_frame(z[:, :, :1], frame.padded), frame.split.frame_spec(5))
            text = program.lower(handle.placed, (piece,)).compile().as_text()
    finally:
        handle.remove()
    dots = re.findall(r"= f32\[(\d+),(\d+)\]\{[^}]*\} dot\(", text)
    assert ("6", "40") in dots  # each chip's scores: its 6 queries x the 40 logical keys
    assert not any(set(d) <= {"40", "48"} for d in dots)  # never the frame's 40 x 40 (or padded 48 x 48)
    # K and V, each the padded frame at the block's width (32) on every chip
    assert len(re.findall(r"= f32\[1,32,6,8\]\{[^}]*\} all-gather\(", text)) == 2
