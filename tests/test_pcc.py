"""Sharded vs unsharded output on CPU virtual meshes, for each backend, mesh and variant.

Each (backend, mesh) runs in its own process (``python -m wan_sharding.check``), which saves the
unsharded reference and the sharded output; the comparison is computed here.
"""

import functools

import numpy as np
import pytest
import torch

from wan_sharding.check import Case, run_in_subprocess
from wan_sharding.mesh import mesh_from_preset
from wan_sharding.models import VARIANTS

MESHES = ("1x4", "2x4", "8x4")
BACKENDS = ("xla", "jax")
CASES = (
    [Case(v, length, "fp32", "slice") for v in VARIANTS for length in ("aligned", "padded")]
    + [Case("t2v-a14b", "padded", "fp32", "mask"), Case("t2v-a14b", "padded", "bf16", "slice"),
       Case("ti2v-5b", "aligned", "bf16", "slice")]
)
BOUNDS = {"fp32": (0.99999, 1e-4), "bf16": (0.99, 0.1)}  # (min PCC, max |difference|)


@functools.lru_cache(maxsize=None)
def _results(backend, mesh, tmp_root):
    return {r["case"]: r for r in run_in_subprocess(backend, mesh, CASES, save=tmp_root / f"{backend}-{mesh}")}


@pytest.fixture(scope="session")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("pcc")
    return lambda backend, mesh: _results(backend, mesh, root)


def _pcc(a, b):
    a, b = a.double().flatten().numpy(), b.double().flatten().numpy()
    return float(np.corrcoef(a, b)[0, 1])


@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_sharded_output_matches_unsharded(results, backend, mesh, case):
    r = results(backend, mesh)[str(case)]
    saved = torch.load(r["saved"])
    ref, out = saved["reference"], saved["sharded"]
    assert out.shape == ref.shape and out.dtype == ref.dtype
    min_pcc, max_abs = BOUNDS[case.dtype]
    assert _pcc(ref, out) >= min_pcc
    assert (ref.double() - out.double()).abs().max() <= max_abs
    m = mesh_from_preset(mesh)
    assert r["padded_tokens"] % m.seq_multiple == 0  # every SP shard is whole 32-token tiles
    assert (r["padded_tokens"] == r["tokens"]) == (case.length == "aligned")  # no padding when aligned
    assert r["params"]["colwise"] > 0 and r["params"]["rowwise"] > 0


@pytest.mark.parametrize("mesh", MESHES)
def test_jax_program_has_the_designed_collectives(results, mesh):
    """2 blocks: 7 all-reduces per block (3 large + 4 norm stats) + 2 in the condition embedder;
    with SP > 1, K and V all-gathered per block + 1 at proj_out."""
    coll = results("jax", mesh)[str(Case("t2v-a14b", "padded", "fp32", "mask"))]["collectives"]
    assert coll.get("all-reduce") == 7 * 2 + 2
    assert coll.get("all-gather", 0) == (2 * 2 + 1 if mesh_from_preset(mesh).sp > 1 else 0)
