"""`ops.exchange`: the shared-memory all-to-all of in-process CPU devices (exchange.cc)
against a plain numpy block transpose and XLA's `all_to_all`, on 2, 4 and 8 devices."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from embedmesh.device import ops
from embedmesh.device.ops import cpu

needs_kernels = pytest.mark.skipif(
    not cpu.ready(), reason=f"CPU kernels unavailable: {cpu.unavailable_reason()}"
)


def block_transpose(x: np.ndarray, n: int) -> np.ndarray:
    """The oracle: device s holds rows [s*n*b, (s+1)*n*b) as n blocks of b; block s of
    device r's result is block r of device s's input."""
    b = x.shape[0] // (n * n)
    blocks = x.reshape((n, n, b) + x.shape[1:])  # [source, destination, ...]
    return np.swapaxes(blocks, 0, 1).reshape(x.shape)


def mesh_of(n: int, two_axes: bool = False) -> Mesh:
    devices = np.array(jax.devices()[:n])
    if two_axes:
        return Mesh(devices.reshape(2, n // 2), ("a", "b"))
    return Mesh(devices, ("x",))


def exchange_fn(mesh: Mesh, in_process: bool, repeats: int = 1):
    axes = tuple(mesh.axis_names)
    n = mesh.size

    def body(x):
        for _ in range(repeats):  # one call site per repeat: separate rendezvous
            x = ops.exchange(x, axes, n, in_process=in_process)
        return x

    return jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=P(axes), out_specs=P(axes), check_vma=False)
    )


def random_array(rng, shape, dtype):
    if np.dtype(dtype).kind == "i":
        return rng.integers(-(2**31), 2**31 - 1, size=shape, dtype=np.int64).astype(dtype)
    return rng.standard_normal(shape).astype(np.float32).astype(dtype)


@needs_kernels
@settings(max_examples=20, deadline=None)
@given(
    n=st.sampled_from([2, 4, 8]),
    b=st.integers(1, 40),
    width=st.sampled_from([(), (1,), (3,), (16,), (2, 5)]),
    dtype=st.sampled_from([np.float32, np.int32, jnp.bfloat16]),
    two_axes=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_exchange_matches_block_transpose(n, b, width, dtype, two_axes, seed):
    mesh = mesh_of(n, two_axes and n >= 4)
    x = random_array(np.random.default_rng(seed), (n * n * b,) + width, dtype)
    placed = jax.device_put(x, NamedSharding(mesh, P(tuple(mesh.axis_names))))
    fn = exchange_fn(mesh, in_process=True)
    assert "embedmesh_exchange" in fn.lower(placed).as_text()
    got = np.asarray(fn(placed))
    np.testing.assert_array_equal(got, block_transpose(x, n))
    np.testing.assert_array_equal(got, np.asarray(exchange_fn(mesh, in_process=False)(placed)))


@needs_kernels
@pytest.mark.parametrize("n", [2, 8])
def test_exchanges_in_sequence_and_in_a_loop(n):
    """Three call sites in one program, and one call site run 5 times in a loop: each
    call pairs with the same call on the other devices (the rendezvous' generations)."""
    mesh = mesh_of(n)
    axes = tuple(mesh.axis_names)
    x = np.random.default_rng(n).standard_normal((n * n * 7, 4)).astype(np.float32)
    placed = jax.device_put(x, NamedSharding(mesh, P(axes)))
    want = x
    for _ in range(3):
        want = block_transpose(want, n)
    np.testing.assert_array_equal(np.asarray(exchange_fn(mesh, True, repeats=3)(placed)), want)

    def loop(a):
        return jax.lax.fori_loop(
            0, 5, lambda i, v: ops.exchange(v * 2.0 + 1.0, axes, n, in_process=True), a
        )

    fn = jax.jit(
        jax.shard_map(loop, mesh=mesh, in_specs=P(axes), out_specs=P(axes), check_vma=False)
    )
    want = x
    for _ in range(5):
        want = block_transpose(want * 2.0 + 1.0, n)
    for _ in range(3):  # and the program itself run again
        np.testing.assert_array_equal(np.asarray(fn(placed)), want)


@needs_kernels
def test_exchange_over_processes_uses_xla():
    """Only devices of one process share memory: `in_process=False` is XLA's all_to_all."""
    mesh = mesh_of(2)
    x = jax.device_put(jnp.arange(16.0).reshape(8, 2), NamedSharding(mesh, P("x")))
    text = exchange_fn(mesh, in_process=False).lower(x).as_text()
    assert "embedmesh_exchange" not in text and "all_to_all" in text
    # one device: no exchange at all
    assert ops.exchange(jnp.ones(3), "x", 1, in_process=True).shape == (3,)


def test_core_knows_its_mesh_is_in_process():
    from embedmesh import FeatureConfig, TableConfig
    from embedmesh.device.core import EmbeddingCore
    from embedmesh.layout.stacking import plan_stacking

    fc = {"f": FeatureConfig(TableConfig(16, 4, name="t"))}
    core = EmbeddingCore(plan_stacking(fc, 4), mesh_of(4))
    assert core.in_process
