"""Make the shared test support importable (also in spawned ranks, which inherit sys.path)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
