"""The training application behind ``python -m hpcpax.train``.

Configuration, the training loop, checkpoints, metrics, the report and the
Slurm job scripts. Nothing below this layer imports it.
"""
