"""The real step under fake tensors, and real CPU peaks.

trace         [Note: traced planning]: the run's own step at any world size, no devices
tracker       what torch's FSDP2 memory tracker misses or miscounts
fake_patches  what tracing changes in torch and the model code, and why
depth         deep built-in models planned from shallow traces
measure       the true per-rank peak of real steps on CPU ranks
"""
