"""`python -m examples.movielens [--epochs N] [--seed S] [--devices D] [--large-tables]`.

See run.py (which sets XLA's host device count before jax loads).
"""

from examples.movielens.run import main

main()
