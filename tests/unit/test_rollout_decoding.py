"""Decoding with a KV cache gives the logits of a full forward over the same prefix, for
the built-in models and every transformers family the tests build; the embedded engine
samples the same completion for a seed whatever else its batch holds, and its log-probs
are the trainer's recomputation ([Note: decoding with a KV cache], [Note: the log-prob
gap])."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny_hf import ARCHS, tiny_config

from fsdpkit import init_weights
from fsdpkit.loss.contract import logits_of
from fsdpkit.loss.logprobs import completion_logps
from fsdpkit.models.llama import Llama, LlamaConfig
from fsdpkit.models.moe import MoE, MoEConfig
from fsdpkit.rollout.completion_rows import completion_logits, rollout_batch
from fsdpkit.rollout.decoding import RolloutModelError, decoder_factory
from fsdpkit.rollout.embedded import EmbeddedEngine
from fsdpkit.rollout.sampling import Sampling, completion_seed

SMALL = {"vocab_size": 96, "dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2}


def _builtin(kind: str) -> torch.nn.Module:
    if kind == "moe":
        model = MoE(MoEConfig(**SMALL, ffn_dim=64, max_seq_len=64, n_experts=4, top_k=2))
    else:
        model = Llama(LlamaConfig(**SMALL, ffn_dim=128, max_seq_len=64))
    init_weights(model, seed=0)  # the init a run gives it (not nn.Embedding's N(0, 1))
    return model


def _hf(arch: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config(arch, vocab_size=96))


def _assert_cached_equals_full(model: torch.nn.Module, vocab: int) -> None:
    model.eval()
    ids = torch.randint(1, vocab, (3, 12), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        full = logits_of(model(ids), tokens=ids)
        with decoder_factory(model)() as decoder:
            steps = [decoder.prefill(ids[:, :5])]
            steps += [decoder.step(ids[:, t]) for t in range(5, 12)]
    cached = torch.stack(steps, dim=1)
    torch.testing.assert_close(cached, full[:, 4:], rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("kind", ["llama", "moe"])
def test_builtin_kv_cache_equals_full_forward(kind: str) -> None:
    _assert_cached_equals_full(_builtin(kind), 96)


@pytest.mark.parametrize("arch", ARCHS)
def test_transformers_kv_cache_equals_full_forward(arch: str) -> None:
    _assert_cached_equals_full(_hf(arch), 96)


def test_a_model_without_a_known_cache_is_refused_by_name() -> None:
    with pytest.raises(RolloutModelError, match=r"model\.factory"):
        decoder_factory(torch.nn.Sequential(torch.nn.Embedding(8, 4), torch.nn.Linear(4, 8)))


def _engine(model: torch.nn.Module) -> EmbeddedEngine:
    return EmbeddedEngine(model, device=torch.device("cpu"), decode=lambda ids: "")


SAMPLING = Sampling(max_new_tokens=9, temperature=0.9, top_p=0.95, stop_ids=frozenset({3}))


def test_a_completion_depends_on_its_seed_not_on_its_batch() -> None:
    model = _builtin("llama")
    prompt = np.array([5, 9, 11, 2], dtype=np.int64)
    seeds = [completion_seed(seed=0, step=1, position=0, index=j) for j in range(4)]
    group = _engine(model).generate([prompt], seeds=[seeds], sampling=SAMPLING)[0]
    alone = _engine(model).generate([prompt], seeds=[seeds[2:3]], sampling=SAMPLING)[0]
    assert alone[0].ids == group[2].ids
    assert alone[0].logps == pytest.approx(group[2].logps, abs=1e-5)
    assert len({tuple(c.ids) for c in group}) > 1  # different seeds, different samples


def test_stop_tokens_end_a_completion_and_are_kept() -> None:
    model = _builtin("llama")
    prompt = np.array([5, 9], dtype=np.int64)
    seeds = [[completion_seed(seed=1, step=s, position=0, index=0) for s in range(30)]]
    every = Sampling(max_new_tokens=6, stop_ids=frozenset(range(48)))  # half the vocabulary
    for c in _engine(model).generate([prompt], seeds=seeds, sampling=every)[0]:
        ends = [i for i, t in enumerate(c.ids) if t in every.stop_ids]
        assert (ends == [len(c.ids) - 1] and c.finish == "stop") or (
            not ends and c.finish == "length" and len(c.ids) == 6
        )


@pytest.mark.parametrize("model_kind", ["llama", "gpt2"])
def test_engine_logps_are_the_trainers_recomputation(model_kind: str) -> None:
    """[Note: the log-prob gap] at float noise: the engine's token log-probs against the
    trainer's full forward over the rollout batch ([Note: rollout batches])."""
    model = _builtin("llama") if model_kind == "llama" else _hf("gpt2")
    model.eval()
    prompts = [np.array([5, 9, 11], dtype=np.int64), np.array([7, 1, 1, 4, 2], dtype=np.int64)]
    seeds = [
        [completion_seed(seed=0, step=1, position=p, index=j) for j in range(3)] for p in (0, 1)
    ]
    groups = _engine(model).generate(prompts, seeds=seeds, sampling=SAMPLING)
    comps = [c for g in groups for c in g]
    batch = rollout_batch(
        [p for p in prompts for _ in range(3)],
        [c.ids for c in comps],
        [c.logps for c in comps],
        advantages=torch.zeros(len(comps)),
        trains=[True] * len(comps),
        device=torch.device("cpu"),
    )
    with torch.no_grad():
        logits = completion_logits(
            logits_of(model(batch.inputs), tokens=batch.inputs), batch.positions
        )
        trainer = completion_logps(logits, batch.completion_ids, temperature=SAMPLING.temperature)
    gap = ((trainer - batch.engine_logps).abs() * batch.sampled).max()
    assert float(gap) < 1e-5
