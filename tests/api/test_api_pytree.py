"""Item 4: `{TableConfig: array}` dicts are usable pytrees (tree.map, device_put, jit)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from embedmesh import FeatureConfig, TableConfig
from embedmesh.facade import MeshEmbedding


def three_tables():
    # unnamed tables included, created out of name order
    t_z = TableConfig(10, 4, name="z")
    t_u1 = TableConfig(12, 4)
    t_a = TableConfig(9, 8, name="a")
    t_u2 = TableConfig(12, 4)
    return t_z, t_u1, t_a, t_u2


def test_table_config_total_order_and_identity():
    t_z, t_u1, t_a, t_u2 = three_tables()
    # named tables first, by name; then unnamed ones in creation order
    assert sorted([t_u2, t_z, t_u1, t_a]) == [t_a, t_z, t_u1, t_u2]
    assert t_a < t_z < t_u1 < t_u2
    assert t_u2 > t_u1 and t_u1 <= t_u1 and t_u1 >= t_u1
    # equality stays identity, hashing stays
    twin = TableConfig(12, 4)
    assert twin != t_u1 and len({t_u1, twin, t_u1}) == 2
    same_name = TableConfig(9, 8, name="a")
    assert same_name != t_a and t_a < same_name  # ties on name broken by creation
    with pytest.raises(TypeError):
        t_a < 3  # noqa: B015 - the comparison is what raises


def test_tree_map_device_put_jit_over_table_dict():
    t_z, t_u1, t_a, _ = three_tables()
    d = {
        t_z: np.ones((10, 4), np.float32),
        t_u1: np.full((12, 4), 2.0, np.float32),
        t_a: np.zeros((9, 8), np.float32),
    }
    doubled = jax.tree.map(lambda x: x * 2, d)
    assert set(doubled) == set(d)
    np.testing.assert_array_equal(doubled[t_u1], np.full((12, 4), 4.0))
    placed = jax.device_put(d)
    assert all(isinstance(v, jax.Array) for v in placed.values())
    out = jax.jit(lambda tabs: {t: v.sum() for t, v in tabs.items()})(placed)
    assert float(out[t_z]) == 40.0 and float(out[t_u1]) == 96.0 and float(out[t_a]) == 0.0
    # leaf order is the documented key order
    leaves = jax.tree.leaves(d)
    assert [x.shape for x in leaves] == [(9, 8), (10, 4), (12, 4)]


def test_embedding_tables_and_variables_as_jit_argument():
    t_z, t_u1, t_a, _ = three_tables()
    from embedmesh import Adagrad

    feats = {"z": FeatureConfig(t_z), "u": FeatureConfig(t_u1), "a": FeatureConfig(t_a)}
    emb = MeshEmbedding(feats, Adagrad(0.1), mesh=Mesh(np.array(jax.devices()[:2]), ("x",)))
    emb.build()
    tabs = emb.embedding_tables
    sums = jax.jit(lambda tabs: jax.tree.map(jnp.sum, tabs))(tabs)
    for t in (t_z, t_u1, t_a):
        np.testing.assert_allclose(float(sums[t]), tabs[t].sum(), rtol=1e-5)
    jax.device_put(emb.variables)
    jax.tree.map(lambda x: x + 1, emb.variables)
