"""The serving lookup's host kernels, one module per backend.

Every backend module implements the same interface (the ops the serving lookup
and `inputs` use), over numpy memory, with outputs from `embedmesh.serving.pool`:

- `NAME`: "native", "numba" or "numpy";
- `load()`: what the backend needs (its library, its compiled module), or None
  where it cannot run here;
- `prepare_gather(table, ids)`: a plain lookup of signed ids, ready to run: a
  callable giving `table[ids]`, bit for bit, or raising `IdOutOfRange`;
- `prepare_bag(table, ids, offsets, weights, mode, prune_ids, prune_w)`: the bags
  `ids[offsets[r]:offsets[r+1]]` summed with their weights (None: ones), in float32
  and entry order, normalised by `mode` (`_runtime.combiner_code`), TensorFlow's
  pruning in the same pass, ready to run: a callable giving float32 [bags, dim];
  `table` may be a `QuantizedTable` (`embedmesh.serving.quantized`, numpy arrays):
  its rows decoded to float32 in the sum (C++: `EmServingBagQ`; numba and numpy:
  `common.decoded_bag`, the same values bit for bit);
- `sparse_offsets(indices, shape, num_rows)`: COO indices checked and turned into
  bag offsets (`embedmesh.sparse_index.sparse_offsets`'s contract), or None where
  the backend's kernel does not apply (the numpy form then).

The backends (`set_backend` in `embedmesh.serving.kernels`, the one place that
picks one):

- `native` (the default where its library loads): C++ kernels;
- `numba` (when the C++ kernels are unavailable and numba is importable);
- `numpy` (always available).

Every backend gives the same values, bit for bit (tests/device/test_kernels.py). Where
they share code (errors, pruning, widening non-float32 tables): `common`.
"""
