"""Expert parallelism (``parallel.ep``): one axis, one folder.

parallel  which modules are routed experts, the layout checks, and the experts
          split over the ep ranks (``expert_parallel``, ``shard_experts``)
dispatch  the token dispatch: capacity, the two all-to-alls and their backward
"""
