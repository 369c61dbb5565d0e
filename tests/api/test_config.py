"""Config validation, naming and hashing."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import embedmesh as em
from embedmesh import FeatureConfig, QuantizationConfig, TableConfig


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(vocabulary_size=0, dim=4), "vocabulary_size"),
        (dict(vocabulary_size=2.5, dim=4), "vocabulary_size"),
        (dict(vocabulary_size=True, dim=4), "vocabulary_size"),
        (dict(vocabulary_size=10, dim=0), "dim"),
        (dict(vocabulary_size=10, dim="8"), "dim"),
        (dict(vocabulary_size=10, dim=4, initializer=3), "initializer"),
        (dict(vocabulary_size=10, dim=4, combiner="max"), "combiner"),
        (dict(vocabulary_size=10, dim=4, name=""), "name"),
        (dict(vocabulary_size=10, dim=4, optimizer="sgd"), "optimizer"),
        (dict(vocabulary_size=10, dim=4, quantization_config=4), "quantization_config"),
    ],
)
def test_table_config_validation_names_field(kwargs, field):
    with pytest.raises(ValueError, match=f"TableConfig.{field}"):
        TableConfig(**kwargs)


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(max_sequence_length=-1), "max_sequence_length"),
        (dict(max_sequence_length=1.5), "max_sequence_length"),
        (dict(validate_weights_and_indices=1), "validate_weights_and_indices"),
        (dict(output_shape=[2, 0]), "output_shape"),
        (dict(output_shape="ab"), "output_shape"),
        (dict(name=5), "name"),
    ],
)
def test_feature_config_validation_names_field(kwargs, field):
    with pytest.raises(ValueError, match=f"FeatureConfig.{field}"):
        FeatureConfig(TableConfig(10, 4), **kwargs)
    with pytest.raises(ValueError, match="FeatureConfig.table"):
        FeatureConfig("table")


def test_quantization_config_validation():
    QuantizationConfig(num_buckets=2, lower=-1.0, upper=1.0)
    with pytest.raises(ValueError, match="num_buckets"):
        QuantizationConfig(num_buckets=1, lower=-1.0, upper=1.0)
    with pytest.raises(ValueError, match="upper"):
        QuantizationConfig(num_buckets=4, lower=1.0, upper=1.0)


def test_defaults_and_frozen():
    t = TableConfig(100, 16)
    assert t.combiner == "mean" and t.initializer is None and t.optimizer is None
    f = FeatureConfig(t, output_shape=[4, 2])
    assert f.output_shape == (4, 2) and f.max_sequence_length == 0
    assert f.validate_weights_and_indices is True
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.dim = 3
    assert "vocabulary_size=100" in repr(t) and "dim=16" in repr(t)
    assert "max_sequence_length=0" in repr(f)


def test_identity_hashing_keeps_equal_looking_tables_apart():
    a, b = TableConfig(10, 4), TableConfig(10, 4)
    assert len({a: 1, b: 2}) == 2
    assert hash(a) == hash(a)


def test_default_initializer_is_truncated_normal_with_stddev_one_over_sqrt_dim():
    t = TableConfig(20000, 16)
    x = np.asarray(t.initialize(jax.random.key(0)))
    assert x.shape == (20000, 16)
    # truncated at 2 stddev: std of the truncated unit normal is ~0.8796
    assert abs(x.std() - 0.8796 / 4.0) < 0.01
    assert np.abs(x).max() <= 2.0 / 4.0 + 1e-6
    custom = TableConfig(3, 2, initializer=lambda key, shape, dtype: np.full(shape, 7.0, dtype))
    np.testing.assert_array_equal(custom.initialize(None), np.full((3, 2), 7.0))


def _truncated_unit_normal_cdf(x):
    """float64 CDF of a unit normal truncated to [-2, 2]."""
    phi = np.vectorize(lambda v: 0.5 * (1.0 + math.erf(v / math.sqrt(2.0))))
    return (phi(np.clip(x, -2.0, 2.0)) - phi(-2.0)) / (phi(2.0) - phi(-2.0))


@pytest.mark.parametrize(
    # one block of 16 values, of 4096, two of 4096, two of 65536 (twice)
    "shape",
    [(3, 5), (4000, 1), (4097, 1), (300, 300), (70000, 1)],
)
def test_default_initializer_draws_a_truncated_normal_across_its_blocks(shape):
    """Drawn in fixed-size blocks and cut to the shape: every value, each block's too, is
    stddev x a unit normal truncated at +-2 (Kolmogorov-Smirnov against the float64 CDF),
    no two blocks repeat, the same key gives the same table and the dtype is kept."""
    dim = shape[1]
    t = TableConfig(shape[0] + 7, dim)
    x = np.asarray(t.initialize(jax.random.key(3), shape), np.float64)
    assert x.shape == shape
    u = np.sort(x.reshape(-1) * math.sqrt(dim))
    assert np.abs(u).max() <= 2.0 + 1e-6
    if u.size >= 1000:  # KS at 1e-4: a critical value of 1.95 / sqrt(n)
        ecdf = np.arange(1, u.size + 1) / u.size
        assert np.abs(ecdf - _truncated_unit_normal_cdf(u)).max() < 1.95 / math.sqrt(u.size)
    flat = x.reshape(-1)
    for block in (1 << 12, 1 << 16):  # the second block is not the first again
        second = flat[block : 2 * block]
        assert second.size == 0 or (second == flat[: second.size]).mean() < 0.01
    again = np.asarray(t.initialize(jax.random.key(3), shape), np.float64)
    np.testing.assert_array_equal(again, x)
    other = np.asarray(t.initialize(jax.random.key(4), shape), np.float64)
    assert (other == x).mean() < 0.01
    low = t.initialize(jax.random.key(3), shape, jnp.bfloat16)
    assert low.dtype == jnp.bfloat16 and low.shape == shape
    # drawn inside a program (a table of raw ids re-initialises its fresh rows there):
    # the same values as drawn eagerly
    traced = jax.jit(lambda k: t.initialize(k, shape))(jax.random.key(3))
    np.testing.assert_array_equal(np.asarray(traced, np.float64), x)


def test_resolve_names_tables_in_order_of_first_use():
    t_unnamed_1, t_named, t_unnamed_2 = (
        TableConfig(5, 2),
        TableConfig(5, 2, name="x"),
        TableConfig(7, 2),
    )
    fc = {
        "b": FeatureConfig(t_unnamed_2),
        "a": [FeatureConfig(t_unnamed_1), FeatureConfig(t_named, name="named")],
        "c": FeatureConfig(t_unnamed_1),
    }
    r = em.resolve_feature_config(fc)
    # pytree order sorts dict keys: a/0, a/1 (named), b, c
    assert r.feature_names == ("a/0", "named", "b", "c")
    assert r.table_names == ("table_0", "x", "table_2")
    assert r.table_name(t_unnamed_2) == "table_2"
    assert t_unnamed_1.name is None  # configs are never mutated


def test_resolution_reuse_follows_the_structure_and_its_configs():
    """Resolutions are reused only for the same structure holding the same configs;
    changing either (a dict edited in place included) resolves afresh."""
    t1, t2 = TableConfig(5, 2), TableConfig(5, 2, name="x")
    fc = {"a": FeatureConfig(t1), "b": FeatureConfig(t2)}
    first = em.resolve_feature_config(fc)
    assert em.resolve_feature_config(fc) is first
    assert em.resolve_feature_config(dict(fc)) is first  # same shape, same configs
    fc["b"] = FeatureConfig(t1, name="renamed")  # edited in place
    second = em.resolve_feature_config(fc)
    assert second.feature_names == ("a", "renamed") and second.table_names == ("table_0",)
    fc["c"] = FeatureConfig(t2)
    third = em.resolve_feature_config(fc)
    assert third.feature_names == ("a", "renamed", "c")
    assert third.table_names == ("table_0", "x")
    del fc["c"]
    assert em.resolve_feature_config(fc) is second
    with pytest.raises(ValueError, match="named 't'"):  # errors are never cached away
        for _ in range(2):
            em.resolve_feature_config(
                [
                    FeatureConfig(TableConfig(5, 2, name="t")),
                    FeatureConfig(TableConfig(6, 2, name="t")),
                ]
            )


def test_duplicate_table_names_rejected():
    fc = [FeatureConfig(TableConfig(5, 2, name="t")), FeatureConfig(TableConfig(6, 2, name="t"))]
    with pytest.raises(ValueError, match="named 't'"):
        em.resolve_feature_config(fc)


def test_non_feature_leaf_rejected():
    with pytest.raises(ValueError, match="must be a FeatureConfig"):
        em.resolve_feature_config({"a": 3})
