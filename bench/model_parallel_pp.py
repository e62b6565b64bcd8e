"""Pipeline parallelism next to FSDP only on 4 CPU ranks (gloo): bench/model_parallel.py's
pipeline rows (issue 38), with their own results file and docs block.

    .venv/bin/python bench/model_parallel_pp.py                 # 3 rounds
    .venv/bin/python bench/model_parallel_pp.py --quick         # 1 round, 4 steps
    .venv/bin/python bench/model_parallel_pp.py --render-docs docs/parallelism.md

Rows and method: bench/model_parallel.py (``--pp``). Writes
bench/results/model_parallel_pp.json.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from model_parallel import main, render

__all__ = ["render"]

if __name__ == "__main__":
    main(["--pp", *sys.argv[1:]])
