"""``fsdpkit migrate``: realistic Accelerate configs (FSDP1 and FSDP2, contradictory,
unknown keys, legacy JSON) and FSDP1 constructor descriptions become fsdpkit TOML that
``fsdpkit.config.load`` accepts, with a comment where the meaning changed; bad input
is one clear error naming the key."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from fsdpkit import config as configuration
from fsdpkit.migrate import (
    MigrateError,
    convert_accelerate,
    convert_fsdp1,
    parse_spec,
    render,
    validate,
)

CONFIGS = Path(__file__).parent / "accelerate_configs"


def converted(migration: Any, tmp_path: Path) -> tuple[str, configuration.RunConfig]:
    """The TOML text and what fsdpkit.config.load reads from it."""
    text = render(migration)
    validate(text, origin=migration.origin)
    path = tmp_path / "run.toml"
    path.write_text(text)
    return text, configuration.load(path)


def line(text: str, key: str) -> str:
    return next(ln for ln in text.splitlines() if ln.startswith(f"{key} = "))


@pytest.mark.parametrize(
    ("name", "values", "comments", "warnings"),
    [
        (
            "fsdp1_hybrid_two_nodes.yaml",
            {"parallel.strategy": "hybrid", "parallel.block_classes": ["LlamaDecoderLayer"],
             "precision.mode": "bf16", "activations.mode": "full", "model.meta_init": True,
             "offload.params": False},
            ["Launch: fsdpkit train run.toml --nproc 8 --nnodes 2 --rdzv-endpoint "
             "10.0.0.1:29500 --node-rank 0",
             "mixed_precision: bf16 -- meaning changed: Accelerate autocasts",
             "fsdp_backward_prefetch: BACKWARD_PRE -- FSDP2 always prefetches",
             "fsdp_use_orig_params: true -- FSDP2 always exposes the original parameters",
             "fsdp_sync_module_states: true -- not needed",
             "fsdp_version: 1 -- meaning changed: fsdpkit always runs FSDP2"],
            [],
        ),
        (
            "fsdp2_hsdp.yaml",
            {"parallel.strategy": "hybrid_grad_op", "parallel.shard_degree": 4,
             "precision.mode": "fp16", "activations.mode": "none"},
            ["with fsdp_reshard_after_forward: false -- 2 replicas of a shard group (HSDP)",
             "fsdp_state_dict_type: FULL_STATE_DICT -- meaning changed",
             "TRANSFORMER_BASED_WRAP -- without a class list"],
            [],
        ),
        (
            "contradictory.yaml",
            {"parallel.strategy": "full", "parallel.block_classes": [], "offload.params": True,
             "precision.mode": "fp32"},
            ['# block_classes = ["GPT2Block", "GPT2MLP"]  # fsdp_transformer_layer_cls_to_wrap: '
             "GPT2Block,GPT2MLP -- ignored by Accelerate (SIZE_BASED_WRAP)",
             "fsdp_min_num_params: 100000000 -- no equivalent",
             "Launch: CUDA_VISIBLE_DEVICES=0,1,2,3 fsdpkit train run.toml --nproc 4"],
            ["fsdp_sharding_strategy (full) and fsdp_reshard_after_forward (grad_op) disagree",
             "fsdp_cpu_ram_efficient_loading needs fsdp_sync_module_states",
             "distributed_type is MULTI_GPU"],
        ),
        (
            "unknown_fsdp_keys.yaml",
            {"parallel.strategy": "grad_op", "parallel.block_classes": ["LlamaDecoderLayer"],
             "activations.mode": "full", "offload.params": False},
            ["fsdp_backward_prefetch_policy: BACKWARD_POST -- no equivalent"],
            ["fsdp_offload_param (did you mean fsdp_offload_params?)", "fsdp_magic_speedup"],
        ),
        (
            "legacy.json",
            {"parallel.strategy": "hybrid", "precision.mode": "fp16", "offload.params": True,
             "train.compile": True},
            ["fsdp_state_dict_type: LOCAL_STATE_DICT -- no equivalent",
             "--nnodes 2 --rdzv-endpoint node0.cluster:29400\n",
             "fsdp_limit_all_gathers: true -- FSDP2 always bounds in-flight all-gathers",
             "torch.compile per block before sharding"],
            [],
        ),
        (
            "fsdp2_tp_cp.yaml",
            {"parallel.tp": 4, "parallel.cp": 2, "parallel.strategy": "full",
             "parallel.shard_degree": None},
            ["tp = 4  # parallelism_config_tp_size: 4", "Ulysses all-to-all",
             "cp_backend torch runs ring attention instead",
             "parallelism_config_cp_comm_strategy: alltoall -- fsdpkit's context parallelism",
             "--nproc 8 --nnodes 2"],
            [],
        ),
        (
            "fsdp2_hsdp_sp.yaml",
            {"parallel.cp": 2, "parallel.tp": 1, "parallel.strategy": "hybrid",
             "parallel.shard_degree": 2},
            ["parallelism_config_sp_size: 2 -- the same all-to-all sequence parallelism",
             "parallelism_config_sp_seq_length_is_variable: True"],
            [],
        ),
    ],
)  # fmt: skip
def test_accelerate_configs_convert(
    name: str, values: dict[str, Any], comments: list[str], warnings: list[str], tmp_path: Path
) -> None:
    migration = convert_accelerate(CONFIGS / name)
    text, cfg = converted(migration, tmp_path)
    for key, value in values.items():
        section, field = key.split(".")
        assert getattr(getattr(cfg, section), field) == value, key
    for comment in comments:
        assert comment in text, comment
    for warning in warnings:
        assert any(warning in w for w in migration.warnings), (warning, migration.warnings)
        assert warning in text  # warnings are also written into the file's header
    assert len(migration.warnings) == len(warnings)
    strategy = line(text, "strategy")
    assert "  # " in strategy, "every setting says where it came from"


@pytest.mark.parametrize(
    ("name", "words"),
    [
        (
            "typo_top_level.yaml",
            "unknown Accelerate keys: mixed_precison (did you mean mixed_precision?)",
        ),
        ("bad_strategy.yaml", "fsdp_sharding_strategy = 'FULL_SHRAD' is not one of FULL_SHARD"),
        ("offload_zero2.yaml", "fsdp_offload_params: true with the sharding strategy = grad_op"),
        ("ddp_only.yaml", "no fsdp_config section (distributed_type: MULTI_GPU)"),
        ("missing.yaml", "does not exist"),
    ],
)
def test_accelerate_errors_name_the_key(name: str, words: str) -> None:
    with pytest.raises(MigrateError, match=None) as info:
        convert_accelerate(CONFIGS / name)
    assert words in str(info.value)


def test_yaml_syntax_error_names_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "broken.yaml"
    bad.write_text("distributed_type: FSDP\nfsdp_config: [unclosed\n")
    with pytest.raises(MigrateError, match=r"broken\.yaml is not valid YAML"):
        convert_accelerate(bad)


FSDP1_CALL = """
FSDP(
    model,
    sharding_strategy=ShardingStrategy.HYBRID_SHARD,
    mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                   buffer_dtype=torch.float32),
    cpu_offload=CPUOffload(offload_params=False),
    auto_wrap_policy=functools.partial(transformer_auto_wrap_policy,
                                       transformer_layer_cls={LlamaDecoderLayer}),
    backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
    forward_prefetch=True,
    limit_all_gathers=True,
    use_orig_params=True,
    sync_module_states=True,
    device_id=torch.cuda.current_device(),
    param_init_fn=lambda m: m.to_empty(device="cuda"),
)
"""


def test_fsdp1_constructor_call_converts(tmp_path: Path) -> None:
    with pytest.raises(MigrateError, match="use literals, names and calls only"):
        parse_spec(FSDP1_CALL)  # a lambda is code: refused, never evaluated
    spec = FSDP1_CALL.replace('param_init_fn=lambda m: m.to_empty(device="cuda"),', "")
    migration = convert_fsdp1(spec)
    text, cfg = converted(migration, tmp_path)
    assert cfg.parallel.strategy == "hybrid"
    assert cfg.precision.mode == "bf16" and cfg.offload.params is False
    assert cfg.parallel.block_classes == ["LlamaDecoderLayer"]
    for comment in (
        "forward_prefetch: true -- FSDP2 issues the next unit's all-gather early",
        "device_id: torch.cuda.current_device() -- fsdpkit puts each rank on cuda:LOCAL_RANK",
        "mixed_precision.buffer_dtype: torch.float32 -- FSDP2 leaves buffers",
    ):
        assert comment in text, comment


@pytest.mark.parametrize(
    ("spec", "expected", "error"),
    [
        ('{"sharding_strategy": "NO_SHARD"}', {"parallel.strategy": "replicate"}, None),
        ("{'sharding_strategy': 5, 'mixed_precision': None}",
         {"parallel.strategy": "hybrid_grad_op", "precision.mode": "fp32"}, None),
        ('{"mixed_precision": {"param_dtype": "bfloat16"}}', {"precision.mode": "bf16-pure"}, None),
        ('{"mixed_precision": {"param_dtype": "float16", "reduce_dtype": "float32"}, '
         '"cpu_offload": true, "activation_checkpointing": true}',
         {"precision.mode": "fp16", "offload.params": True, "activations.mode": "full"}, None),
        ('{"auto_wrap_policy": {"min_num_params": 1e8}}', {"parallel.strategy": "full"}, None),
        ('{"sharding_strategy": "SHARD_GRAD_OP", "cpu_offload": {"offload_params": true}}', None,
         "cpu_offload with sharding_strategy = grad_op"),
        ('{"mixed_precision": {"param_dtype": "float32", "reduce_dtype": "bfloat16"}}', None,
         "has no fsdpkit preset"),
        ('{"sharding_strategy": "ZERO3"}', None, "is not one of FULL_SHARD"),
        ("[1, 2]", None, "must be a mapping"),
        ("sharding_strategy=", None, "neither JSON nor a Python expression"),
    ],
)  # fmt: skip
def test_fsdp1_specs(
    spec: str, expected: dict[str, Any] | None, error: str | None, tmp_path: Path
) -> None:
    if error is not None:
        with pytest.raises(MigrateError) as info:
            convert_fsdp1(spec)
        assert error in str(info.value)
        return
    assert expected is not None
    _, cfg = converted(convert_fsdp1(spec), tmp_path)
    for key, value in expected.items():
        section, field = key.split(".")
        assert getattr(getattr(cfg, section), field) == value


def test_unknown_fsdp1_argument_is_a_warning() -> None:
    migration = convert_fsdp1('{"sharding_strategy": "FULL_SHARD", "use_orig_param": true}')
    assert migration.warnings == [
        "unknown FSDP1 argument use_orig_param (did you mean use_orig_params?): not converted"
    ]


def test_cli_refuses_to_overwrite_and_reports_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from fsdpkit.cli import main

    out = tmp_path / "run.toml"
    out.write_text("# mine\n")
    assert main(["migrate", str(CONFIGS / "fsdp2_hsdp.yaml"), "-o", str(out)]) == 2
    assert "exists; pass --force" in capsys.readouterr().err
    assert out.read_text() == "# mine\n"  # the user's file is untouched
    assert main(["migrate", str(CONFIGS / "fsdp2_hsdp.yaml"), "-o", str(out), "--force"]) == 0
    assert configuration.load(out).parallel.shard_degree == 4
    assert main(["migrate", str(CONFIGS / "bad_strategy.yaml")]) == 2
    assert "Did you mean FULL_SHARD?" in capsys.readouterr().err
    assert main(["migrate"]) == 2
    assert "exactly one" in capsys.readouterr().err
    spec = '{"sharding_strategy": "HYBRID_SHARD", "cpu_offload": {"offload_params": true}}'
    assert main(["migrate", "--fsdp1", spec]) == 0
    (tmp_path / "spec.toml").write_text(capsys.readouterr().out)
    cfg = configuration.load(tmp_path / "spec.toml")
    assert (cfg.parallel.strategy, cfg.offload.params) == ("hybrid", True)


def test_accelerate_parallelism_sizes_are_kept() -> None:
    # Accelerate's (dp_replicate, dp_shard, cp, tp) mesh is fsdpkit's, size for size:
    # nothing of it is dropped (the cases are in test_accelerate_configs_convert)
    for name in ("fsdp2_tp_cp.yaml", "fsdp2_hsdp_sp.yaml"):
        dropped = convert_accelerate(CONFIGS / name).dropped
        assert not any("_size" in d.source for d in dropped), dropped


def test_accelerate_parallelism_errors_and_warnings(tmp_path: Path) -> None:
    with pytest.raises(MigrateError) as info:
        convert_accelerate(CONFIGS / "tp_wrong_total.yaml")
    assert "dp_shard 2 x tp 4 = 8 ranks, but num_processes is 4" in str(info.value)
    both = tmp_path / "both.yaml"
    both.write_text(
        "distributed_type: FSDP\nfsdp_config: {fsdp_version: 2}\nnum_processes: 4\n"
        "parallelism_config: {cp_size: 2, sp_size: 2}\n"
    )
    with pytest.raises(MigrateError, match="parallelism_config_cp_size = 2 and"):
        convert_accelerate(both)
    across = tmp_path / "across.yaml"
    across.write_text(
        "distributed_type: FSDP\nfsdp_config: {fsdp_version: 2}\nnum_processes: 12\n"
        "num_machines: 2\nparallelism_config: {tp_size: 4, dp_shard_size: 3}\n"
    )
    warned = convert_accelerate(across).warnings
    assert any("does not divide the 6 processes per node" in w for w in warned)
