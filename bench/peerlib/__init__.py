"""Pieces of bench/peers.py: the shared harness every implementation runs under
(``common``), the statistics (``stats``), the launcher (``launch``), the memory-scaling
measurement (``scaling``) and the probes of what peers do on CPU (``probes``). One
script per implementation (``impl_*.py``), each written the way its framework's docs
tell a user to write it."""
