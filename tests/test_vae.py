"""``shard_vae``: the Wan VAE split over H and W with a halo per conv, exact against the VAE's own
decode and encode on every CPU mesh and both backends; its checks before any change; ``remove()``.

The PCC rows come from one worker per (backend, mesh) (``jobs/vae_check.py``, the path ``check
--component vae`` runs), each running its share of the matrix on tiny random-weight VAEs of the
real structure: both VAEs (Wan 2.1 of A14B, Wan 2.2 of TI2V-5B), decode of 3 latent frames (the
time cache carried over two steps) and encode of 5 video frames (two chunks), H or W the mesh does
not divide (padded and masked) and sizes it does, fp32 and bf16. The rows are shared by the tests
that read them (module scope). The in-process tests run on this process's 8 JAX CPU devices.
"""

from __future__ import annotations

import copy
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from wan_sharding import BackendError, ShardingError, shard_vae
from wan_sharding.jobs.vae_check import VaeCase, run_in_subprocess
from wan_sharding.models import build_vae
from wan_sharding.vae.layout import channel_specs, plan_frame, vae_specs
from wan_sharding.vae.halo import FrameSplit

C = VaeCase.parse
# Each worker's share. Latent H x W: 5x8 does not split over H on 2 or 8 (padded to 6 / 8), 4x8 and
# 8x8 do; an encode's video is 16x (Wan 2.2) or 8x (Wan 2.1) that. The default suite runs JAX on
# every mesh and torch-xla on 2x4, what the done-when names (both VAEs decoding on 2x4 and 8x4, a
# padded frame among them) and one encode; the rest is `slow` (scripts/bench_vae.py runs `check
# --component vae`, every case on every mesh and both backends, in full).
MATRIX: dict[tuple[str, str], list[VaeCase]] = {
    ("jax", "1x4"): [C("wan2.1:decode:3,4,8:fp32"), C("wan2.1:decode:1,4,8:fp32:halo:none")],
    ("jax", "2x4"): [C("wan2.1:decode:3,5,8:fp32"), C("wan2.2:encode:2,4,8:bf16")],
    ("jax", "8x4"): [C("wan2.1:decode:3,5,8:fp32"), C("wan2.2:decode:3,8,8:bf16")],
    ("xla", "2x4"): [C("wan2.2:decode:3,5,8:fp32")],
}
SLOW_MATRIX: dict[tuple[str, str], list[VaeCase]] = {
    ("jax", "2x4"): [C("wan2.2:decode:3,5,8:fp32")],
    ("jax", "8x4"): [C("wan2.1:encode:2,5,8:fp32")],
    ("xla", "1x4"): [C("wan2.1:decode:3,4,8:fp32")],
    ("xla", "2x4"): [C("wan2.1:encode:2,5,8:bf16")],
    ("xla", "8x4"): [C("wan2.1:decode:3,5,8:fp32"), C("wan2.2:decode:3,5,4:fp32")],
}


def _run_all(matrix: dict) -> dict:
    """Every worker of ``matrix``, two at a time: a worker's compiles and traces use one core, and
    the suite's machine has two."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {key: pool.submit(run_in_subprocess, *key, cases) for key, cases in matrix.items()}
        return {key: f.result() for key, f in futures.items()}


@pytest.fixture(scope="module")
def rows():
    return _run_all(MATRIX)


def _row(rows: dict, backend: str, mesh: str, case: VaeCase) -> dict:
    return next(r for r in rows[(backend, mesh)] if r["case"] == str(case))


def _graded(r: dict) -> None:
    assert r["ok"], f"{r['case']}: PCC {r['pcc']:.9f}, max|diff| {r['max_abs']:.2e} (bound {r['max_abs_bound']})"
    assert r["halo_modules"] > 0 and r["split"].startswith("H/")


CASES = [(b, m, c) for (b, m), cases in MATRIX.items() for c in cases if not c.exchange]


@pytest.mark.parametrize("backend,mesh,case", CASES, ids=[f"{b}-{m}-{c}" for b, m, c in CASES])
def test_sharded_vae_matches_the_vae_within_the_grade(rows, backend, mesh, case):
    _graded(_row(rows, backend, mesh, case))


@pytest.mark.slow
def test_the_rest_of_the_matrix_matches_too():
    for (backend, mesh), results in _run_all(SLOW_MATRIX).items():
        for r in results:
            _graded(r)


def test_the_matrix_covers_what_the_issue_asks(rows):
    """Both VAEs, decode and encode, padded and unpadded frames, fp32 and bf16, >= 3 latent frames,
    every CPU mesh, both backends."""
    cases = [c for _, _, c in CASES]
    assert {c.vae for c in cases} == {"wan2.1", "wan2.2"} and {c.part for c in cases} == {"decode", "encode"}
    assert {c.dtype for c in cases} == {"fp32", "bf16"}
    assert all(c.shape[0] >= 3 for c in cases if c.part == "decode")
    assert {m for _, m, _ in CASES} == {"1x4", "2x4", "8x4"} and {b for b, _, _ in CASES} == {"jax", "xla"}
    assert {m for b, m in SLOW_MATRIX if b == "xla"} == {"1x4", "2x4", "8x4"}  # torch-xla on every mesh, -m slow
    for mesh in ("2x4", "8x4"):  # the done-when: both VAEs decode on 2x4 and 8x4, a padded frame among them
        for vae in ("wan2.1", "wan2.2"):
            assert any(m == mesh and c.vae == vae and c.part == "decode" for _, m, c in CASES)
        found = [r for (b, m), rs in rows.items() if m == mesh for r in rs]
        assert any(r["frame"] != r["padded"] and r["part"] == "decode" and r["ok"] for r in found)


def test_the_comparison_fails_without_the_halo(rows):
    """The same decode with every shard convolved alone (no neighbour rows): wrong at each shard
    border, and the grade says so."""
    r = _row(rows, "jax", "1x4", C("wan2.1:decode:1,4,8:fp32:halo:none"))
    assert not r["ok"] and r["pcc"] < 0.999 and r["max_abs"] > 1e-2


# ---- in this process (JAX, 8 CPU devices) ------------------------------------------------------


def _state(vae):
    hooks = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in vae.modules())
    attrs = [(n, getattr(m, "_padding", None), getattr(m, "padding", None)) for n, m in vae.named_modules()]
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


def test_frames_are_padded_to_whole_shards_and_specs_are_data():
    split = FrameSplit("sp", "tp", 8, 4)
    frame = plan_frame(60, 104, split, "mask", 1, "latent")  # 480p: 60 rows do not divide by 8
    assert frame.padded == (64, 104) and frame.logical_at(512, 832) == (480, 832)
    assert plan_frame(704, 1280, split, "mask", 16, "video").padded == (768, 1280)
    meta = build_vae("wan2.2", "full", device="meta")
    assert all(s == (None,) * len(s) for s in vae_specs(meta, _mesh("8x4")).by_name().values())
    channels = channel_specs(meta, _mesh("8x4"))  # tt-xla's recipe: conv1 out, norm2, conv2 in, on the 8-axis
    assert channels["decoder.mid_block.resnets.0.conv1.weight"][0] == "sp"
    assert channels["decoder.mid_block.resnets.0.conv2.weight"][1] == "sp"


def _mesh(name):
    from wan_sharding.mesh import mesh_from_preset

    return mesh_from_preset(name)
