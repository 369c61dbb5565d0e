"""MovieLens-100k demo: a recommender trained with sharded embedding tables, then served.

Run from the repository root: `python -m examples.movielens` (see `run.py`).
Nothing here imports jax at package import time, so the entry point can set
XLA's host device count first.
"""
