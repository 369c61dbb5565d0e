"""Where rows live: the stacking plan (tables -> stacks) and the row layout
(a stack's rows -> shards). Pure Python and numpy; no jax programs, no host batches."""
