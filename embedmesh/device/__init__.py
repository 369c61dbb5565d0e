"""The device side: the functional core (state in, state out), one module per sharding
strategy (`strategies/`: how a stack's lookup and update cross the devices), the
per-shard program's shared pieces, and the ops they call (one dispatch point per op,
per-platform kernels behind it, one `ops.Transport` for where the devices are)."""
