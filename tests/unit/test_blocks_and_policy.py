"""Pure logic of sharding decisions: block detection, precision presets, AC choice."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fsdpkit import BlockDetectionError, detect_blocks
from fsdpkit.config import ActivationsConfig, ParallelConfig, PrecisionConfig
from fsdpkit.models.llama import Llama, LlamaConfig, preset
from fsdpkit.sharding import choose_blocks, unit_specs
from fsdpkit.sharding.activations import checkpointed_blocks
from fsdpkit.sharding.policy import reshard_after_forward, resolve_precision

SMALL = LlamaConfig(
    vocab_size=64, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=16
)


class ResBlock(nn.Module):
    def __init__(self, ch: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(ch, ch, 3, padding=1)
        self.conv2 = nn.Conv2d(ch, ch, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv2(torch.relu(self.conv1(x)))


class TinyResNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3)
        self.stages = nn.Sequential(*(ResBlock(16) for _ in range(4)))
        self.fc = nn.Linear(16, 10)


def test_llama_blocks_are_decoder_layers() -> None:
    model = Llama(SMALL)
    blocks = detect_blocks(model)
    assert [type(b).__name__ for b in blocks] == ["DecoderLayer"] * 3


def test_cnn_blocks_are_residual_blocks() -> None:
    assert [type(b).__name__ for b in detect_blocks(TinyResNet())] == ["ResBlock"] * 4


def test_block_class_override_and_unknown_name() -> None:
    model = Llama(SMALL)
    assert len(detect_blocks(model, class_names=["MLP"])) == 3
    with pytest.raises(BlockDetectionError, match="DecoderLayer"):
        detect_blocks(model, class_names=["TransformerBlock"])


def test_block_sharing_a_tied_weight_is_not_split_out() -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(8, 8)
            self.b = nn.Linear(8, 8)
            self.b.weight = self.a.weight

    model = Tied()
    assert detect_blocks(model, class_names=["Linear"]) == []


def test_precision_presets() -> None:
    p = resolve_precision(PrecisionConfig(mode="auto"), device_type="cpu")
    assert (p.name, p.param_dtype) == ("fp32", torch.float32)
    p = resolve_precision(PrecisionConfig(mode="bf16"), device_type="cpu")
    assert (p.param_dtype, p.reduce_dtype, p.scaler) == (torch.bfloat16, torch.float32, False)
    assert resolve_precision(PrecisionConfig(mode="fp16"), device_type="cpu").scaler


def test_reshard_and_ac_choices() -> None:
    assert reshard_after_forward(ParallelConfig(strategy="full")) is True
    assert reshard_after_forward(ParallelConfig(strategy="grad_op")) is False
    assert reshard_after_forward(ParallelConfig(strategy="hybrid_grad_op")) is False
    assert reshard_after_forward(ParallelConfig(reshard_after_forward=2)) == 2
    blocks = [nn.Linear(1, 1) for _ in range(6)]
    assert checkpointed_blocks(blocks, ActivationsConfig(mode="none")) == []
    assert len(checkpointed_blocks(blocks, ActivationsConfig(mode="full"))) == 6
    every = checkpointed_blocks(blocks, ActivationsConfig(mode="every", every=3))
    assert every == [blocks[2], blocks[5]]


def test_presets_have_published_sizes() -> None:
    sizes = {
        name: preset(name).num_params() / 1e9
        for name in ("llama3-1b", "llama3-3b", "llama3-8b", "llama3-70b", "llama3-405b")
    }
    assert sizes["llama3-1b"] == pytest.approx(1.24, abs=0.01)
    assert sizes["llama3-3b"] == pytest.approx(3.21, abs=0.01)
    assert sizes["llama3-8b"] == pytest.approx(8.03, abs=0.01)
    assert sizes["llama3-70b"] == pytest.approx(70.6, abs=0.1)
    assert sizes["llama3-405b"] == pytest.approx(405.9, abs=0.5)


def test_meta_and_normal_init_agree_and_flops_are_standard() -> None:
    from fsdpkit import init_weights

    a, b = Llama(SMALL), Llama(SMALL)
    init_weights(a, seed=1)
    init_weights(b, seed=1)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), name
    cfg = SMALL
    dense = cfg.num_params()  # tied: the head's matmul counts, the lookup does not
    assert a.flops_per_token(16) == 6 * dense + 12 * cfg.n_layers * cfg.n_heads * cfg.head_dim * 16


@pytest.mark.parametrize(("dim", "vocab", "tied"), [(128, 2000, False), (256, 32000, True)])
def test_large_vocabulary_still_picks_decoder_layers(dim: int, vocab: int, tied: bool) -> None:
    """Embedding and head hold most parameters: the trunk is still the decoder layers
    (issue 8: every Linear used to become its own unit)."""
    shape = LlamaConfig(
        vocab_size=vocab, dim=dim, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=2 * dim,
        tie_embeddings=tied,
    )  # fmt: skip
    with torch.device("meta"):
        model = Llama(shape)
    choice = choose_blocks(model)
    assert [type(b).__name__ for b in choice.blocks] == ["DecoderLayer"] * 2
    assert "repeated trunk" in choice.reason and "% of the parameters" in choice.reason


def test_declared_unsplittable_modules_win() -> None:
    model = TinyResNet()
    model._no_split_modules = ["Conv2d"]  # type: ignore[assignment]
    choice = choose_blocks(model)
    assert choice.class_name == "Conv2d" and "_no_split_modules" in choice.reason
    assert len(choice.blocks) == 9  # stem + 2 per ResBlock


def test_coarsest_repeated_class_without_containers() -> None:
    class Pair(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first, self.second = ResBlock(4), ResBlock(4)
            self.head = nn.Linear(4, 4)

    assert choose_blocks(Pair()).class_name == "ResBlock"


def test_unit_specs_group_blocks_and_keep_last_and_root_unsharded() -> None:
    specs = unit_specs(
        7, parallel=ParallelConfig(blocks_per_unit=3), activations=ActivationsConfig(mode="full")
    )
    assert [s.blocks for s in specs] == [(0, 1, 2), (3, 4, 5), (6,), ()]
    assert [s.reshard_after_forward for s in specs] == [True, True, False, False]
    assert sum(sum(s.checkpointed) for s in specs) == 7
