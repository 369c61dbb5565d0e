"""The host side of a step: user inputs -> partitioned CSR batches, and the
prefetch thread that feeds them. Never imports the device side.

- `preprocess`: the entry points (`preprocess_features`, `preprocess_batch`,
  `compute_sparse_core_stats`) and the per-stack orchestration over the
  features' `inputs.Csr` bags;
  (what it produces, `PartitionedCsrFormatTensor` and its sizes and
  statistics, is declared in `embedmesh.batch`, which the device side reads);
- `native_backend` (C++, `cpu/preprocess.cc`, the default) / `numba_backend` /
  `numpy_backend`: the three bit-identical backends (`kernel_params`: what the two
  compiled ones share; numba is imported at first use, and only where it runs);
- `preprocess_tf`: TensorFlow's call form of `preprocess_features`;
- `prefetch`: `background_map`, preprocessing ahead of the device step.
"""
