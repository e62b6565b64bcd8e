"""The router's aux loss of transformers MoE families, in one process: what the family
declares is found, the coefficient counts, evaluation leaves it out."""

from __future__ import annotations

import pytest
import torch
from tiny_hf import MOE_ARCHS, tiny_config

from fsdpkit.loss.contract import next_token_loss
from fsdpkit.loss.router import RouterLoss, router_spec, with_router_loss

transformers = pytest.importorskip("transformers")

TOKENS = torch.arange(2 * 17).reshape(2, 17) * 5 % 320


def _model(arch: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(tiny_config(arch), dtype=torch.float32)


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_router_loss_is_the_familys_own(arch: str) -> None:
    model = _model(arch)
    spec = router_spec(model)
    assert spec is not None and spec.aux_fn is not None
    assert (spec.experts, spec.top_k) == (4, 2)
    assert spec.coef == model.config.router_aux_loss_coef
    loss_fn = with_router_loss(next_token_loss, model=model, coef=1.0)
    assert isinstance(loss_fn, RouterLoss)
    inputs = TOKENS[:, :-1]
    out = model(input_ids=inputs, output_router_logits=True)
    plain = next_token_loss(model, TOKENS)
    with_aux = loss_fn(model, TOKENS)
    torch.testing.assert_close(with_aux - plain, out.aux_loss, rtol=1e-6, atol=0)
    metrics = loss_fn.step_metrics()
    assert metrics["aux_loss"] == pytest.approx(float(out.aux_loss), rel=1e-6)
    assert 0 < metrics["expert_load_min"] <= 1 <= metrics["expert_load_max"]
    assert len(metrics["expert_load_max_by_layer"]) == model.config.num_hidden_layers


def test_coefficient_zero_and_one_train_differently() -> None:
    losses = {}
    for coef in (0.0, 1.0):
        model = _model("mixtral")
        loss_fn = with_router_loss(next_token_loss, model=model, coef=coef)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        for _ in range(2):
            loss = loss_fn(model, TOKENS)
            loss.backward()
            opt.step()
            opt.zero_grad()
        losses[coef] = float(next_token_loss(model, TOKENS))
    assert abs(losses[0.0] - losses[1.0]) > 1e-4, losses


def test_eval_reports_the_lm_loss_alone_and_dense_models_get_none() -> None:
    model = _model("olmoe")
    loss_fn = with_router_loss(next_token_loss, model=model, coef=1.0)
    model.eval()
    with torch.no_grad():
        assert float(loss_fn(model, TOKENS)) == float(next_token_loss(model, TOKENS))
    dense = transformers.AutoModelForCausalLM.from_config(tiny_config("llama"))
    assert with_router_loss(next_token_loss, model=dense, coef=1.0) is next_token_loss
