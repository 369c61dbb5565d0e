"""The cost model's TPU v5e slice: its ICI taken at the slice's bisection, and the planner
picking it for a mesh of TPU chips (told by their kind and coordinates)."""

import types

import numpy as np
import pytest

from embedmesh.layout import planner
from embedmesh.layout.cost_model import Machine


def chips(shape):
    """Stand-ins for TPU devices of a slice of `shape` (as topology descriptions have)."""
    coords = [(x, y, 0) for y in range(shape[1]) for x in range(shape[0])]
    return [types.SimpleNamespace(coords=c, device_kind="TPU v5 lite", process_index=0,
                                  platform="tpu") for c in coords]  # fmt: skip


@pytest.mark.parametrize(
    "shape,gbps", [((1, 1), 200), ((2, 2), 100), ((2, 4), 50), ((4, 4), 50), ((8, 8), 25)]
)
def test_ici_at_the_bisection(shape, gbps):
    m = Machine.tpu_v5e(shape)
    # 4 ports of 50 GB/s a way; the longer side's bisection bounds an all-to-all
    assert m.intra.bandwidth == pytest.approx(gbps * 1e9)
    assert m.inter == m.intra and m.memory_per_device == pytest.approx(15.7 * 2**30)


def test_calibrated_row_costs_replace_the_defaults():
    m = Machine.tpu_v5e((2, 2), read_row_s=1e-8, pair_row_s=2e-8, update_row_s=3e-8)
    assert (m.read_row_s, m.pair_row_s, m.update_row_s) == (1e-8, 2e-8, 3e-8)


@pytest.mark.parametrize("shape", [(2, 2), (2, 4), (8, 8)])
def test_planner_takes_the_slice_of_a_tpu_mesh(shape):
    devices = chips(shape)
    assert planner.tpu_slice_shape(devices) == (shape[0], shape[1], 1)
    mesh = types.SimpleNamespace(devices=np.array(devices, dtype=object))
    m = planner.machine_for(mesh, on_cpu=False)
    assert m.name == f"TPU v5e {shape[0]}x{shape[1]}x1"
    assert m.intra.bandwidth == Machine.tpu_v5e(shape).intra.bandwidth


def test_devices_without_coordinates_are_one_axis():
    devices = [types.SimpleNamespace(device_kind="TPU v5 lite") for _ in range(4)]
    assert planner.tpu_slice_shape(devices) == (4,)
