"""The pipelined run: building the stages of a run and stepping them.

build  the stages of ``shard_trainable`` under ``parallel.pp`` ([Note: one builder])
step   [Note: the pipelined step]: one optimizer step and evaluation through torch's
       schedule
"""
