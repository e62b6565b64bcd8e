"""FSDP1 constructor arguments -> fsdpkit settings.

The description is read, never executed: JSON, a Python literal dict, or a pasted
``FullyShardedDataParallel(model, ...)`` call. Names and attribute chains
(``ShardingStrategy.HYBRID_SHARD``, ``torch.bfloat16``, ``LlamaDecoderLayer``) become
strings, calls (``MixedPrecision(...)``, ``CPUOffload(...)``,
``functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={...})``)
become ``{"__call__": name, "args": [...], **keywords}``.

    {"sharding_strategy": "HYBRID_SHARD",
     "mixed_precision": {"param_dtype": "bfloat16", "reduce_dtype": "float32"},
     "cpu_offload": {"offload_params": false},
     "auto_wrap_policy": {"transformer_layer_cls": ["LlamaDecoderLayer"]},
     "backward_prefetch": "BACKWARD_PRE", "use_orig_params": true}
"""

from __future__ import annotations

import ast
import difflib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fsdpkit.migrate import fsdp1_args as fsdp1
from fsdpkit.migrate.outcome import MigrateError, Migration

CALL = "__call__"


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    if isinstance(node, ast.Call):
        return f"{_dotted(node.func)}()"
    raise MigrateError(f"cannot read {ast.unparse(node)!r}: expected a name")


def _data(node: ast.AST) -> Any:
    """A literal view of an expression (nothing is evaluated)."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.List | ast.Tuple | ast.Set):
        return [_data(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        return {_data(k): _data(v) for k, v in zip(node.keys, node.values) if k is not None}
    if isinstance(node, ast.Name | ast.Attribute):
        return _dotted(node)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_data(node.operand)
    if isinstance(node, ast.Call):
        out: dict[str, Any] = {CALL: _dotted(node.func), "args": [_data(a) for a in node.args]}
        out.update({kw.arg: _data(kw.value) for kw in node.keywords if kw.arg})
        return out
    raise MigrateError(
        f"cannot read {ast.unparse(node)!r} in the FSDP1 description: use literals, names "
        "and calls only"
    )


def parse_spec(text: str) -> dict[str, Any]:
    """The keyword arguments described by ``text`` (JSON, dict literal or FSDP call)."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        try:
            tree = ast.parse(text.strip(), mode="eval")
        except SyntaxError as exc:
            raise MigrateError(
                f"the FSDP1 description is neither JSON nor a Python expression: {exc.msg} "
                f'(line {exc.lineno}). Write e.g. \'{{"sharding_strategy": "FULL_SHARD"}}\'.'
            ) from None
        data = _data(tree.body)
    if isinstance(data, dict) and CALL in data:
        data = {k: v for k, v in data.items() if k not in (CALL, "args")}
    if not isinstance(data, dict):
        raise MigrateError("the FSDP1 description must be a mapping of constructor arguments.")
    return data


def _call_kwargs(value: Any) -> dict[str, Any]:
    return (
        {k: v for k, v in value.items() if k not in (CALL, "args")}
        if isinstance(value, dict)
        else {}
    )


def _mixed_precision(m: Migration, value: Any) -> None:
    key = "mixed_precision"
    if value is None:
        m.set("precision.mode", "fp32", f"{key}: None")
        return
    kwargs = _call_kwargs(value)
    param = kwargs.get("param_dtype") or "float32"
    reduce = kwargs.get("reduce_dtype") or param  # FSDP1: reduce in param_dtype when unset
    fsdp1.mixed_precision_dtypes(m, str(param), str(reduce), source=key)
    if kwargs.get("buffer_dtype") not in (None, param):
        m.drop(
            f"{key}.buffer_dtype: {kwargs['buffer_dtype']}",
            "FSDP2 leaves buffers in their own dtype",
        )
    for extra in ("keep_low_precision_grads", "cast_forward_inputs", "cast_root_forward_inputs"):
        if extra in kwargs:
            m.drop(
                f"{key}.{extra}: {kwargs[extra]}",
                "no setting: FSDP2 casts inputs itself; gradients are reduced in reduce_dtype",
            )


def _cpu_offload(m: Migration, value: Any) -> None:
    kwargs = _call_kwargs(value)
    enabled = kwargs.get("offload_params", False) if isinstance(value, dict) else value
    fsdp1.offload(m, bool(enabled) if enabled is not None else False, key="cpu_offload")


def _auto_wrap_policy(m: Migration, value: Any) -> None:
    key = "auto_wrap_policy"
    kwargs = _call_kwargs(value)
    args = value.get("args", []) if isinstance(value, dict) else []
    func = " ".join(
        str(a) for a in [value.get(CALL, "") if isinstance(value, dict) else value, *args]
    )
    classes = kwargs.get("transformer_layer_cls") or kwargs.get("module_classes")
    if classes is None and "ModuleWrapPolicy" in func and args:
        classes = args[0]
    if classes is not None:
        fsdp1.block_classes(m, classes if isinstance(classes, list) else [classes], key=key)
    elif "min_num_params" in kwargs or "size_based" in func:
        fsdp1.wrap_policy(m, "SIZE_BASED_WRAP", key=key)
    elif value is None:
        fsdp1.wrap_policy(m, "NO_WRAP", key=key)
    else:
        m.drop(
            f"{key}: {show(value)}",
            "custom policy: fsdpkit detects repeated blocks; "
            "name their classes in parallel.block_classes",
        )


def show(value: Any) -> str:
    """A parsed value as the user wrote it (calls as ``name(args, key=value)``)."""
    if isinstance(value, dict) and CALL in value:
        args = [show(a) for a in value.get("args", [])]
        args += [f"{k}={show(v)}" for k, v in value.items() if k not in (CALL, "args")]
        return f"{value[CALL]}({', '.join(args)})"
    if isinstance(value, list):
        return "[" + ", ".join(show(v) for v in value) + "]"
    return str(value)


def _dropped(note: str) -> Callable[[Migration, Any, str], None]:
    return lambda m, v, key: m.drop(f"{key}: {show(v)}", note)


def _keyed(fn: Callable[..., object]) -> Callable[[Migration, Any, str], None]:
    def call(m: Migration, value: Any, key: str) -> None:
        fn(m, value, key=key)

    return call


def _handlers() -> dict[str, Callable[[Migration, Any, str], None]]:
    simple = {
        "sharding_strategy": fsdp1.sharding,
        "backward_prefetch": fsdp1.backward_prefetch,
        "forward_prefetch": fsdp1.forward_prefetch,
        "limit_all_gathers": fsdp1.limit_all_gathers,
        "use_orig_params": fsdp1.use_orig_params,
        "sync_module_states": fsdp1.sync_module_states,
        "state_dict_type": fsdp1.state_dict_type,
        "activation_checkpointing": fsdp1.activation_checkpointing,
    }
    out = {k: _keyed(fn) for k, fn in simple.items()}
    out.update(
        mixed_precision=lambda m, v, key: _mixed_precision(m, v),
        cpu_offload=lambda m, v, key: _cpu_offload(m, v),
        auto_wrap_policy=lambda m, v, key: _auto_wrap_policy(m, v),
        device_id=_dropped("fsdpkit puts each rank on cuda:LOCAL_RANK itself"),
        process_group=_dropped("fsdpkit builds the mesh from parallel.strategy / shard_degree"),
        device_mesh=_dropped("fsdpkit builds the mesh from parallel.strategy / shard_degree"),
        param_init_fn=_dropped(
            "fsdpkit materializes meta models itself (seeded per-parameter "
            "init; the model's init_buffers() for buffers)"
        ),
        ignored_modules=_dropped("no equivalent: every parameter is sharded"),
        ignored_states=_dropped("no equivalent: every parameter is sharded"),
        module=lambda m, v, key: None,
    )
    return out


def _is_file(text: str) -> bool:
    """Whether SPEC names a file (inline JSON or code never does)."""
    if "\n" in text or text.lstrip().startswith(("{", "[", "(")):
        return False
    try:
        return Path(text).is_file()
    except OSError:  # e.g. a name too long to be a path
        return False


def convert_fsdp1(text: str) -> Migration:
    """FSDP1 constructor arguments (text or a path to a file holding them)."""
    origin = "an FSDP1 constructor description"
    if _is_file(text):
        path = Path(text)
        text, origin = path.read_text(), f"{path.name} (FSDP1 constructor arguments)"
    spec = parse_spec(text)
    m = Migration(origin=origin)
    handlers = _handlers()
    if "sharding_strategy" not in spec:
        m.set("parallel.strategy", "full", "(FSDP1 default: FULL_SHARD)")
    for key, value in spec.items():
        handler = handlers.get(key)
        if handler is None:
            close = difflib.get_close_matches(key, sorted(handlers), n=1, cutoff=0.6)
            hint = f" (did you mean {close[0]}?)" if close else ""
            m.warnings.append(f"unknown FSDP1 argument {key}{hint}: not converted")
            continue
        handler(m, value, key)
    fsdp1.check_offload(m, offload_key="cpu_offload", strategy_key="sharding_strategy")
    m.launch = "fsdpkit train run.toml --nproc N"
    return m
