"""Sharded vs unsharded output on CPU virtual meshes, for each backend, mesh and variant, and the
UMT5 text encoder's on the same meshes.

Each (backend, mesh) runs in its own process (``python -m wan_sharding.jobs.check``), which saves the
unsharded reference and the sharded output; the comparison is computed here. The text encoder's
cases run in the same workers (one process per backend and mesh for both components).
"""

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from wan_sharding.jobs.check import Case, run_in_subprocess
from wan_sharding.jobs.text_encoder import EncoderCase
from wan_sharding.mesh import mesh_from_preset
from wan_sharding.models import VARIANTS, latent_for_tokens

MESHES = ("1x4", "2x4", "8x4")
BACKENDS = ("xla", "jax")
CASES = (
    [Case(v, length, "fp32", "slice") for v in VARIANTS for length in ("aligned", "padded")]
    + [Case("t2v-a14b", "padded", "fp32", "mask"), Case("t2v-a14b", "padded", "bf16", "slice"),
       Case("ti2v-5b", "aligned", "bf16", "slice")]
)
PAD_AMOUNTS = (1, 5, 31)  # one token, a few, almost a full 32-token tile
# The text encoder: a prompt with padding tokens in its mask (11 of 16), and a batch of it and an
# unpadded one, in fp32; the padded prompt in bf16.
ENCODER_CASES = (EncoderCase("fp32", "11"), EncoderCase("fp32", "11+16"), EncoderCase("bf16", "11"))


def padding_cases(mesh):
    """Both exact modes with 1, 5 and 31 padded tokens on this mesh (L = 2 * SP*32 - pad)."""
    multiple = mesh_from_preset(mesh).seq_multiple
    shapes = {p: latent_for_tokens(2 * multiple - p) for p in PAD_AMOUNTS}
    return [Case("t2v-a14b", f"{s.frames},{s.height},{s.width}", "fp32", mode)
            for p, s in shapes.items() for mode in ("slice", "mask")]


def cases_for(mesh):
    return CASES + padding_cases(mesh) + list(ENCODER_CASES)


BOUNDS = {"fp32": (0.99999, 1e-4), "bf16": (0.99, 0.1)}  # (min PCC, max |difference|)


def _run(backend, mesh, root):
    cases = cases_for(mesh)
    return {r["case"]: r for r in run_in_subprocess(backend, mesh, cases, save=root / f"{backend}-{mesh}")}


@pytest.fixture(scope="session")
def results(request, tmp_path_factory):
    """The worker processes the selected tests need, two at a time (XLA compiles mostly on one
    core each)."""
    root = tmp_path_factory.mktemp("pcc")
    needed = {(it.callspec.params["backend"], it.callspec.params.get("mesh", "2x4"))
              for it in request.session.items
              if hasattr(it, "callspec") and it.module.__name__ == __name__ and "backend" in it.callspec.params}
    needed |= {("jax", it.callspec.params["mesh"]) for it in request.session.items
               if it.module.__name__ == __name__ and it.name.startswith("test_jax_program")}
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {key: pool.submit(_run, *key, root) for key in sorted(needed)}
        yield lambda backend, mesh: futures[(backend, mesh)].result()


def _pcc(a, b):
    a, b = a.double().flatten().numpy(), b.double().flatten().numpy()
    return float(np.corrcoef(a, b)[0, 1])


def _check(results, backend, mesh, case):
    r = results(backend, mesh)[str(case)]
    saved = torch.load(r["saved"])
    ref, out = saved["reference"], saved["sharded"]
    assert out.shape == ref.shape and out.dtype == ref.dtype
    min_pcc, max_abs = BOUNDS[case.dtype]
    assert _pcc(ref, out) >= min_pcc
    assert (ref.double() - out.double()).abs().max() <= max_abs
    m = mesh_from_preset(mesh)
    assert r["padded_tokens"] % m.seq_multiple == 0  # every SP shard is whole 32-token tiles
    assert (r["padded_tokens"] == r["tokens"]) == (r["tokens"] % m.seq_multiple == 0)  # skipped when aligned
    assert r["params"]["colwise"] > 0 and r["params"]["rowwise"] > 0
    return r


@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_sharded_output_matches_unsharded(results, backend, mesh, case):
    _check(results, backend, mesh, case)


@pytest.mark.parametrize("pad", PAD_AMOUNTS)
@pytest.mark.parametrize("mode", ["slice", "mask"])
@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_every_padding_mode_is_exact_for_any_padding_amount(results, backend, mesh, mode, pad):
    case = padding_cases(mesh)[PAD_AMOUNTS.index(pad) * 2 + ("slice", "mask").index(mode)]
    assert case.padding == mode
    r = _check(results, backend, mesh, case)
    assert r["padded_tokens"] - r["tokens"] == pad


@pytest.mark.parametrize("mesh", MESHES)
def test_jax_program_has_the_designed_collectives(results, mesh):
    """2 blocks: 7 all-reduces per block (3 large + 4 norm stats) + 2 in the condition embedder;
    with SP > 1, K and V all-gathered per block + 1 at proj_out."""
    coll = results("jax", mesh)[str(Case("t2v-a14b", "padded", "fp32", "mask"))]["collectives"]
    assert coll.get("all-reduce") == 7 * 2 + 2
    assert coll.get("all-gather", 0) == (2 * 2 + 1 if mesh_from_preset(mesh).sp > 1 else 0)


@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_text_encoder_matches_unsharded(results, backend, mesh):
    """The tiny UMT5 encoder (2 layers, 8 heads) sharded Megatron-style over TP 4: within the suite's
    grade with padding tokens in the mask, in a batch, in bf16; the handle gives the program's
    output, remove() restores the host weights (the tied embedding tied again); on JAX one all-reduce
    per attention and per FFN and nothing else for a prompt."""
    layers = 2
    for case in ENCODER_CASES:
        r = results(backend, mesh)[str(case)]
        saved = torch.load(r["saved"])
        ref, out = saved["reference"], saved["sharded"]
        assert out.shape == ref.shape == (len(case.rows()), 16, 32) and out.dtype == ref.dtype
        min_pcc, max_abs = BOUNDS[case.dtype]
        assert _pcc(ref, out) >= min_pcc and (ref.double() - out.double()).abs().max() <= max_abs, case
        assert r["ok"] and r["handle_matches_program"] and r["restored"], r
        assert r["params"] == {"colwise": 5 * layers, "rowwise": 2 * layers, "norm_colwise": 0,
                               "embedding_colwise": layers, "replicate": 2 * layers + 2}
        if backend == "jax" and len(case.rows()) == 1:
            assert r["collectives"] == {"all-reduce": 2 * layers}, r["collectives"]


@pytest.mark.parametrize("pipeline", [False, True])
def test_the_grade_the_commands_print_is_the_standard_one(pipeline):
    """``check`` and ``generate --compare`` grade a sharded result on CPU by fp32 PCC >= 0.99999 and
    max |difference| <= 1e-4 (a forward and a whole loop alike), bf16 by PCC >= 0.99; the chips by
    their own PCC table alone. A result with PCC ~1 whose largest difference is a leaked padded key's
    (~1e-3) fails."""
    from wan_sharding.jobs.pcc import grade

    for backend in BACKENDS:
        fp32, bf16 = grade(backend, "fp32", pipeline), grade(backend, "bf16", pipeline)
        assert (fp32.pcc, fp32.max_abs, bf16.pcc, bf16.max_abs) == (0.99999, 1e-4, 0.99, None)
        assert fp32.passes(0.9999999, 3e-6) and not fp32.passes(0.9999999, 1e-3) and not fp32.passes(0.9999, 3e-6)
        assert str(fp32) == "PCC >= 0.99999, max|diff| <= 1e-04"
    tt = grade("tt", "fp32", pipeline)
    assert tt.max_abs is None and tt.pcc == (0.97 if pipeline else 0.99) and tt.passes(tt.pcc, 1.0)
