"""The device side: the functional core (state in, state out), the per-shard
program it maps over the mesh, and the ops that program calls (one dispatch
point per op, per-platform kernels behind it)."""
