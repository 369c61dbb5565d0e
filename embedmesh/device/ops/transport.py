"""The transport: which devices an exchange pairs up, and how they reach each other.

One immutable value travels from `EmbeddingCore` through the sharding strategies
(`embedmesh.device.strategies`) and the ops (`embedmesh.device.ops`) down to the
kernels (`ops/cpu/kernels.py`), where it chooses among the shared memory of one
process and the POSIX shared memory of the processes of one host (the C++ kernels'
two transports, `cpu/transport.h`) and XLA's collectives (`all_to_all`: gloo on CPU,
NCCL on GPU).
"""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["Transport"]


@dataclasses.dataclass(frozen=True)
class Transport:
    """Where the devices of an exchange are (inside `shard_map`).

    axis_name: the mesh axis (or tuple of axes) the devices are numbered along.
    num_shards: N, the devices of that axis (1: nothing crosses).
    in_process: every device of the mesh is in this process, so they can read each
      other's buffers.
    host_job: nonzero when the mesh spans processes that are all on this host: the
      job's key (`embedmesh.device.peers.same_host_job`), which names its
      shared-memory segments; 0 otherwise.
    channel: this call's name, the same in every process and distinct among the
      calls of one program (the processes' calls pair up by it; `at` extends it).
    """

    axis_name: Any = None
    num_shards: int = 1
    in_process: bool = False
    host_job: int = 0
    channel: str = ""

    @property
    def crosses(self) -> bool:
        """Whether anything crosses between devices (more than one): only then do a
        program's exchanges need an order among them (`shard_program.after`)."""
        return self.num_shards > 1

    def on(self, channel: str) -> Transport:
        """The same devices, calls named `channel`."""
        return dataclasses.replace(self, channel=str(channel))

    def at(self, *names: str) -> Transport:
        """The channel extended by `names`, each after a "/" (`"t"` at "lookup", "ids":
        `"t/lookup/ids"`)."""
        return dataclasses.replace(self, channel=self.channel + "".join(f"/{n}" for n in names))
