import pytest

from wan_sharding import MeshError, MeshSpec, mesh_for_device_count, mesh_from_preset
from wan_sharding.mesh import as_mesh_spec


@pytest.mark.parametrize("name,sp,tp", [("1x1", 1, 1), ("1x2", 1, 2), ("1x4", 1, 4), ("1x8", 1, 8),
                                        ("2x4", 2, 4), ("4x8", 4, 8), ("8x4", 8, 4)])
def test_presets_put_sp_on_first_axis_and_tp_on_second(name, sp, tp):
    m = mesh_from_preset(name)
    assert (m.sp, m.tp) == (sp, tp)
    assert m.num_devices == sp * tp
    assert m.seq_multiple == sp * 32


@pytest.mark.parametrize("n,name", [(1, "1x1"), (2, "1x2"), (4, "1x4"), (8, "2x4"), (32, "8x4")])
def test_mesh_from_device_count_follows_reference_recipe(n, name):
    assert mesh_for_device_count(n).name == name


def test_unsupported_device_count_names_the_supported_ones():
    with pytest.raises(MeshError, match=r"no mesh preset for 6 devices.*\[1, 2, 4, 8, 32\]"):
        mesh_for_device_count(6)


def test_unknown_preset_lists_known_ones():
    with pytest.raises(MeshError, match="unknown mesh '3x3'.*8x4"):
        mesh_from_preset("3x3")


def test_unknown_axis_in_roles_is_an_error_not_a_replication():
    with pytest.raises(MeshError, match="role 'tp' names axis 'model'"):
        MeshSpec((2, 4), ("batch", "heads"), roles={"sp": "batch", "tp": "model"})
    with pytest.raises(MeshError, match="unknown mesh axis 'x'"):
        MeshSpec((2, 4)).axis_size("x")


def test_bad_shapes_are_rejected():
    with pytest.raises(MeshError):
        MeshSpec((2, 4), ("sp",))
    with pytest.raises(MeshError):
        MeshSpec((0, 4))


def test_reference_style_axis_names_keep_roles_by_position():
    class XlaLikeMesh:  # the attributes torch_xla's Mesh exposes
        mesh_shape = (2, 4)
        axis_names = ("batch", "model")

    m = as_mesh_spec(XlaLikeMesh())
    assert (m.sp_axis, m.tp_axis, m.sp, m.tp) == ("batch", "model", 2, 4)


def test_jax_mesh_is_accepted():
    import jax
    import numpy as np
    from jax.sharding import Mesh

    m = as_mesh_spec(Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("sp", "tp")))
    assert m.name == "2x4"
