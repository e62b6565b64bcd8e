"""``compile_seconds`` ([Note: compile time] in fsdpkit.sharding.compile): the seconds
the training loop reports as ``compile_s`` and keeps out of tokens/s (the CLI side:
tests/e2e/test_compile_time_cli.py)."""

from __future__ import annotations

import torch
from torch import nn

from fsdpkit.sharding.compile import compile_blocks, compile_seconds


class Block(nn.Module):
    """A block of the user's own class (``nn.Module.compile`` of torch.nn's own
    containers, such as ``nn.Sequential``, compiles nothing: see the last test)."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(dim, dim), nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(torch.tanh(self.a(x)))


def test_compile_seconds_counts_the_forward_and_the_lazy_backward_compile() -> None:
    """[Note: compile time]: nothing before any compile; the forward graph's compile at
    the first call, the backward graph's at the first backward; nothing more while
    dynamo reuses the graphs. aot_eager compiles both graphs without a C++ compiler."""
    torch._dynamo.reset()  # as a process that has compiled nothing (clears dynamo's timers)
    assert compile_seconds() == 0.0
    block, x = Block(), torch.randn(4, 16)
    block.compile(backend="aot_eager")
    loss = block(x).sum()
    forward = compile_seconds()
    assert forward > 0.0
    loss.backward()
    both = compile_seconds()
    assert both > forward
    block(x).sum().backward()  # same shapes: the guards hold, no compile
    assert compile_seconds() == both
    torch._dynamo.reset()


def test_compile_blocks_compiles_blocks_whose_forward_is_torchs() -> None:
    """[Note: blocks whose forward is torch's own]: ``.compile()`` of an ``nn.Sequential``
    block compiled nothing; ``compile_blocks`` gives it a frame dynamo compiles, with
    the eager numbers."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
    x = torch.randn(4, 16)
    plain = nn.Sequential(*eager)  # the same modules, compiled as before
    plain.compile(backend="aot_eager")
    plain(x)
    assert compile_seconds() == 0.0  # torch's own forward: no frame, no graph
    compiled = nn.Sequential(*eager)
    compile_blocks([compiled], backend="aot_eager")
    out = compiled(x)
    assert compile_seconds() > 0.0
    torch.testing.assert_close(out, eager(x), rtol=0, atol=0)
    torch._dynamo.reset()
