"""The router loss carried across pipeline stages ([Note: the router loss across
stages] in fsdpkit.sharding.pipeline.routing), in one process: the sums a stage sends
on give the one-process aux loss and its gradients, and the transformers families that
train today take that form."""

from __future__ import annotations

import pytest
import torch
from tiny_hf import MOE_ARCHS, tiny_config

from fsdpkit.loss.balance import aux_of_sums, balance_loss, routing_sums
from fsdpkit.loss.router import router_spec
from fsdpkit.models.moe import MoE, preset
from fsdpkit.sharding.pipeline.routing import takes_sums

transformers = pytest.importorskip("transformers")


def test_sums_carried_over_two_stages_are_the_one_process_aux_loss_and_gradient() -> None:
    """Layers 0-1 on one stage, 2 on the next: the first stage's sums plus the second's
    own give ``balance_loss``'s value, and the gradients of every layer's logits."""
    g = torch.Generator().manual_seed(3)
    logits = [torch.randn(9, 4, generator=g, requires_grad=True) for _ in range(3)]
    want, _ = balance_loss(tuple(logits), 4, 2)
    want_grads = torch.autograd.grad(want, logits)
    first = routing_sums(logits[:2], 4, 2)
    received = first.detach().requires_grad_()  # what the next stage receives
    got = aux_of_sums(received + routing_sums(logits[2:], 4, 2), 4)
    got.backward()
    assert received.grad is not None
    first.backward(received.grad)  # the schedule sends the gradient back
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    for x, w in zip(logits, want_grads, strict=True):
        torch.testing.assert_close(x.grad, w, rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_the_families_that_train_carry_their_own_router_loss(arch: str) -> None:
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(tiny_config(arch))
    spec = router_spec(model)
    assert spec is not None and spec.gathered and takes_sums(spec)


def test_the_builtin_model_carries_its_router_loss() -> None:
    with torch.device("meta"):
        model = MoE(preset("moe-tiny"))
    spec = router_spec(model)
    assert spec is not None and not spec.gathered and takes_sums(spec)
