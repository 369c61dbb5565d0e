"""The tests' meshes (not a test module)."""

import jax
import numpy as np
from jax.sharding import Mesh


def mesh_of(n: int) -> Mesh:
    """A one-axis mesh ("x") of the first `n` devices."""
    return Mesh(np.array(jax.devices()[:n]), ("x",))
