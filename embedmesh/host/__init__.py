"""The host side of a step: user inputs -> partitioned CSR batches (numba or
numpy backend), and the prefetch thread that feeds them. Never imports the
device side."""
