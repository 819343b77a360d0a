"""Sharded vs unsharded output on CPU virtual meshes, for each backend, mesh and variant.

Each (backend, mesh) runs in its own process (``python -m wan_sharding.jobs.check``), which saves the
unsharded reference and the sharded output; the comparison is computed here.
"""

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from wan_sharding.jobs.check import Case, run_in_subprocess
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


def padding_cases(mesh):
    """Both exact modes with 1, 5 and 31 padded tokens on this mesh (L = 2 * SP*32 - pad)."""
    multiple = mesh_from_preset(mesh).seq_multiple
    shapes = {p: latent_for_tokens(2 * multiple - p) for p in PAD_AMOUNTS}
    return [Case("t2v-a14b", f"{s.frames},{s.height},{s.width}", "fp32", mode)
            for p, s in shapes.items() for mode in ("slice", "mask")]


def cases_for(mesh):
    return CASES + padding_cases(mesh)


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
