"""Run composition, the top of the library: a run's final config (``resolve``: the file,
overrides and ``parallel.auto`` for a world size) and the body of one training worker
(``worker``: resolve, build the session, train, report, exit). The launcher, torchrun /
SLURM joins and the CLI all enter here; nothing below imports it.
"""
