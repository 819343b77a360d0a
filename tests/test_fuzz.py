"""The standing fuzz (scripts/fuzz_sharding.py): what it draws, and a small fixed-seed sample run.

The full run (>= 200 cases, docs/check.md) is a script; here the generator's reach is checked without a
worker, and six cases run sharded vs unsharded on both CPU backends (two workers).
"""

from collections import Counter

import pytest

from wan_sharding.jobs.fuzz import MAX_ABS, MESHES, fuzz_cases, run_fuzz
from wan_sharding.mesh import mesh_from_preset
from wan_sharding.models import VARIANTS
from wan_sharding.options import PADDING_NAMES


def test_the_draw_reaches_every_corner_and_is_repeatable():
    cases = fuzz_cases(300, seed=0, backends=("jax", "xla"))
    assert cases == fuzz_cases(300, seed=0, backends=("jax", "xla"))
    assert cases != fuzz_cases(300, seed=1, backends=("jax", "xla"))
    assert {c.variant for _, _, c in cases} == set(VARIANTS)
    assert {c.padding for _, _, c in cases} == set(PADDING_NAMES)
    assert {c.batch for _, _, c in cases} == {1, 2}
    assert {m for _, m, _ in cases} == set(MESHES) and Counter(b for b, _, _ in cases) == {"jax": 150, "xla": 150}
    kinds = Counter()
    for _, mesh, c in cases:
        m, cfg, lat = mesh_from_preset(mesh), c.overrides(), c.latent()
        assert cfg["num_attention_heads"] % m.tp == 0 and cfg["ffn_dim"] % m.tp == 0  # head-aligned TP
        assert 1 <= cfg["num_layers"] <= 3 and lat.height % 2 == 0 and lat.width % 2 == 0
        tokens = lat.tokens()
        kinds["1-2 tokens" if tokens <= 2 else "aligned" if tokens % m.seq_multiple == 0 else "unaligned"] += 1
        kinds[f"heads x{cfg['num_attention_heads'] // m.tp}"] += 1
    assert all(kinds[k] >= 20 for k in ("1-2 tokens", "aligned", "unaligned", "heads x1", "heads x2")), kinds


@pytest.mark.slow  # the standing fuzz is scripts/fuzz_sharding.py; this sample runs with -m slow
def test_fixed_seed_sample_matches_unsharded():
    # seed 2002 on 2x4: every variant and padding mode, batch 1 and 2, 2 / 3 / 18 / 64 / 128 / 162 tokens
    cases = fuzz_cases(6, seed=2002, backends=("jax", "xla"), meshes=("2x4",))
    assert {c.padding for _, _, c in cases} == set(PADDING_NAMES) and {c.variant for _, _, c in cases} == set(VARIANTS)
    summary = run_fuzz(cases)
    assert summary["cases"] == 6 and summary["crashed_workers"] == 0
    assert summary["mismatches"] == 0, summary["failed"]
    assert summary["worst_max_abs"] <= MAX_ABS
