"""Contract test for the ``tt`` backend with a stand-in for Tenstorrent's ``tt_torch``.

Tenstorrent's torch plugin (``pjrt-plugin-tt``, providing ``tt_torch``) and their torch-xla fork
come from Tenstorrent's own package index and cannot be installed here. This test replaces only
``tt_torch.sharding`` with a recorder (a fake, said plainly) and checks exactly what the backend
would send it: which tensors (shapes), with which partition specs, in which order, and the Shardy
strings ``sharding_constraint_tensor`` would emit for them (its documented format). The model runs
eagerly on CPU: the recorder returns each tensor unchanged.
"""

import sys
import types
from types import SimpleNamespace

import pytest
import torch

from wan_sharding import apply_dit_sp_activation_sharding
from wan_sharding.backends.tt import TTBackend
from wan_sharding.mesh import mesh_from_preset
from wan_sharding.models import LatentShape, build_dit, dit_inputs


def sdy_string(axis_names, spec):
    """What tt_torch emits: one {...} per tensor dim, mesh axis i named "mesh_idx_<i>"."""
    dims = ", ".join("{}" if a is None else '{"mesh_idx_%d"}' % axis_names.index(a) for a in spec)
    return f"#sdy.sharding_per_value<[<@mesh, [{dims}]>]>"


@pytest.fixture
def tt_recorder(monkeypatch):
    calls = []

    def sharding_constraint_tensor(tensor, mesh, partition_spec, unreduced=None):
        calls.append((tuple(tensor.shape), tuple(partition_spec), sdy_string(mesh.axis_names, partition_spec)))
        return tensor

    sharding = types.ModuleType("tt_torch.sharding")
    sharding.sharding_constraint_tensor = sharding_constraint_tensor
    pkg = types.ModuleType("tt_torch")
    pkg.sharding = sharding
    monkeypatch.setitem(sys.modules, "tt_torch", pkg)
    monkeypatch.setitem(sys.modules, "tt_torch.sharding", sharding)
    return calls


@pytest.mark.parametrize("padding", ["slice", "mask"])
def test_tt_backend_sends_the_double_constraint_and_the_exit_gather(tt_recorder, padding):
    mesh = mesh_from_preset("2x4")
    # A torch-xla Mesh needs Tenstorrent devices; the constraint call only reads its axis names.
    backend = TTBackend(mesh, native_mesh=SimpleNamespace(mesh_shape=(2, 4), axis_names=("sp", "tp")))
    dit = build_dit("t2v-a14b")
    inputs = dit_inputs("t2v-a14b", LatentShape(3, 10, 14))  # 105 tokens -> 128
    with torch.no_grad():
        ref = dit(**inputs, return_dict=False)[0]
    handle = apply_dit_sp_activation_sharding(dit, mesh, backend=backend, padding=padding)
    with torch.no_grad():
        out = dit(**inputs, return_dict=False)[0]
    handle.remove()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)

    rep4, sp4 = "[{}, {}, {}, {}]", '[{}, {"mesh_idx_0"}, {}, {}]'
    rep3, sp3 = "[{}, {}, {}]", '[{}, {"mesh_idx_0"}, {}]'
    wrap = lambda s: f"#sdy.sharding_per_value<[<@mesh, {s}>]>"  # noqa: E731
    assert tt_recorder == [
        # rope tables: replicated anchor, then padded and L-on-SP (cos, then sin)
        ((1, 105, 1, 16), (None, None, None, None), wrap(rep4)),
        ((1, 128, 1, 16), (None, "sp", None, None), wrap(sp4)),
        ((1, 105, 1, 16), (None, None, None, None), wrap(rep4)),
        ((1, 128, 1, 16), (None, "sp", None, None), wrap(sp4)),
        # block-stack entry: the same double constraint on (B, L, D)
        ((1, 105, 128), (None, None, None), wrap(rep3)),
        ((1, 128, 128), (None, "sp", None), wrap(sp3)),
        # proj_out: one constraint back to replicated, on the padded length (sliced after)
        ((1, 128, 64), (None, None, None), wrap(rep3)),
    ]


def test_tt_backend_without_the_plugin_says_where_to_get_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "tt_torch", None)
    from wan_sharding import BackendError

    with pytest.raises(BackendError, match="pjrt-plugin-tt.*Tenstorrent's package index"):
        TTBackend(mesh_from_preset("2x4"))
