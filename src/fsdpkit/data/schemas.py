"""SFT schemas: what a record looks like, detected per record and normalized.

[Note: SFT schemas]
Each record is one of (``data.schema = auto`` tells them apart by their keys, in
this order; ``data.columns`` renames columns first, e.g. ``["prompt=question",
"completion=answer"]``):

- ``messages`` (TRL conversational, OpenAI chat): ``{"messages": [{"role", "content"}...]}``,
  roles system/user/assistant/tool (assistant ``tool_calls`` and top-level ``tools``
  are passed to the chat template);
- ``sharegpt``: ``{"conversations": [{"from": "human", "value": ...}, {"from": "gpt", ...}]}``
  with an optional top-level ``system`` and ``tools`` (LLaMA-Factory, Axolotl); roles
  are mapped by ``ROLES`` (human -> user, gpt -> assistant, function_call -> assistant,
  observation / function -> tool...), an unknown role is refused by name;
- ``prompt_completion`` (TRL): ``{"prompt", "completion"}`` as strings (standard) or as
  message lists (conversational: the loss is on the completion's messages only);
- ``alpaca``: ``{"instruction", "input", "output"}`` (+ optional ``system``, ``history``
  of [question, answer] pairs): a user turn (instruction, a blank line, input) and the
  reply, through the chat template when the tokenizer has one, else ``ALPACA_PROMPT``;
- ``text``: ``data.text_field`` (plain text, every token trained).

A conversation must have an assistant reply to train on; an empty reply among others
(a ShareGPT turn with ``"value": ""``, as in axolotl's ``conversation.missingturns``
fixture) stays in the text as the data has it but is not trained, and the run's first
lines count such replies.

Preference rows (``chosen``/``rejected``: ``train.objective = dpo``, see
fsdpkit.data.preference) and records that match nothing are refused here with the keys
they have: a record is never trained as its JSON text.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any

from fsdpkit.data.errors import DataError

SCHEMAS = ("messages", "sharegpt", "prompt_completion", "alpaca", "text")
LABELS = {
    "messages": "chat messages",
    "sharegpt": "ShareGPT conversations",
    "prompt_completion": "prompt/completion",
    "alpaca": "alpaca instruction/input/output",
    "text": "plain text",
}
"""How the run's first lines name each schema."""
REQUIRED = {
    "messages": ("messages",),
    "sharegpt": ("conversations",),
    "prompt_completion": ("prompt", "completion"),
    "alpaca": ("instruction", "output"),
}
"""The keys each SFT schema needs (data.schema forces one)."""
ROLES = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bot": "assistant",
    "model": "assistant",
    "function_call": "assistant",
    "tool": "tool",
    "function": "tool",
    "observation": "tool",
    "ipython": "tool",
}
"""Role names of the schemas above -> chat-template roles (``function_call`` is the
assistant calling a tool; ``observation``/``function``/``ipython`` carry its result)."""
ALPACA_PROMPT = (
    "Below is an instruction that describes a task{paired}. Write a response that "
    "appropriately completes the request.\n\n### Instruction:\n{instruction}\n\n"
    "{input_block}### Response:\n"
)
"""Stanford Alpaca's prompt, used when the tokenizer has no chat template (the loss is
on the output and EOS)."""
_PAIRED = ", paired with an input that provides further context"


@dataclass(frozen=True)
class Conversation:
    """One SFT example, normalized (``messages`` empty for string prompt/completion)."""

    schema: str
    messages: list[dict[str, Any]] = field(default_factory=list)
    train_from: int = 0
    """Assistant messages before this index are prompt (TRL conversational prompts)."""
    tools: list[Any] | None = None
    plain: tuple[str, str] | None = None
    """(prompt, completion) strings: the example without a chat template."""
    untrained: tuple[int, ...] = ()
    """Indices of empty assistant replies: rendered as the data has them, not trained
    (an empty reply would teach the model to stop at once; [Note: SFT schemas])."""


def parse_columns(columns: list[str]) -> dict[str, str]:
    """``["prompt=question"]`` -> {"question": "prompt"} (source column -> schema key)."""
    out = {}
    for item in columns:
        key, sep, column = item.partition("=")
        if not sep or not key.strip() or not column.strip():
            raise DataError(
                f"data.columns entry {item!r} must be 'KEY=COLUMN', e.g. 'prompt=question' "
                "(KEY is the schema's name, COLUMN the name in your data)."
            )
        out[column.strip()] = key.strip()
    return out


def rename(record: Any, columns: dict[str, str]) -> Any:
    if not columns or not isinstance(record, dict):
        return record
    return {columns.get(k, k): v for k, v in record.items()}


def detect(record: Any, *, text_field: str) -> str | None:
    """The schema of one (renamed) record, or None when it matches none."""
    if not isinstance(record, dict):
        return None
    if isinstance(record.get("messages"), list):
        return "messages"
    if isinstance(record.get("conversations"), list):
        return "sharegpt"
    if "prompt" in record and "completion" in record:
        return "prompt_completion"
    if "instruction" in record and "output" in record:
        return "alpaca"
    if isinstance(record.get(text_field), str):
        return "text"
    return None


def no_schema(record: Any, where: object, *, text_field: str) -> DataError:
    """Why a record matches no schema, with the keys it has and what to set."""
    if not isinstance(record, dict):
        return DataError(
            f"{where}: the record is a JSON {type(record).__name__}, not an object; records "
            f"are objects with the text under data.text_field ({text_field!r}) or an SFT "
            "schema's keys (docs/data.md)."
        )
    keys = ", ".join(map(repr, record)) or "none"
    if "chosen" in record and "rejected" in record:
        return DataError(
            f"{where}: a preference row (chosen/rejected), which SFT does not train on. "
            "Train it with train.objective = 'dpo' (docs/preference.md), or use "
            "prompt/completion or messages rows for SFT."
        )
    return DataError(
        f"{where}: the record matches no data schema (keys: {keys}). fsdpkit reads "
        "'messages', ShareGPT 'conversations', 'prompt'+'completion', alpaca "
        f"'instruction'+'output', or text under data.text_field ({text_field!r}); it never "
        "trains a record's JSON as text. Map your columns, e.g. data.columns=["
        '"prompt=question","completion=answer"], or set data.text_field.'
    )


def conversation(record: dict[str, Any], *, schema: str, where: object) -> Conversation:
    """The normalized example of a record of ``schema`` (checked; errors name ``where``)."""
    if schema == "messages":
        messages = normalize(record["messages"], where, key="messages")
        return _checked(Conversation(schema, messages, tools=_tools(record, where)), where)
    if schema == "sharegpt":
        messages = normalize(record["conversations"], where, key="conversations")
        system = record.get("system")
        if isinstance(system, str) and system.strip():
            messages.insert(0, {"role": "system", "content": system})
        return _checked(Conversation(schema, messages, tools=_tools(record, where)), where)
    if schema == "prompt_completion":
        return _prompt_completion(record, where)
    if schema == "alpaca":
        return _alpaca(record, where)
    raise DataError(f"{where}: schema {schema!r} is not an SFT schema.")


def _tools(record: dict[str, Any], where: object) -> list[Any] | None:
    tools = record.get("tools")
    if isinstance(tools, str):  # LLaMA-Factory keeps them as a JSON string
        if not tools.strip():
            return None
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as exc:
            raise DataError(f"{where}: 'tools' is a string but not JSON ({exc.msg}).") from exc
    if tools is None or tools == []:
        return None
    return tools if isinstance(tools, list) else [tools]


def _content(message: dict[str, Any], *, i: int, role: str, where: object) -> str:
    content = message.get("content", message.get("value"))
    if content is None and (message.get("tool_calls") or role == "assistant"):
        return ""
    if isinstance(content, list):  # OpenAI content parts
        texts = [p.get("text") for p in content if isinstance(p, dict)]
        if len(texts) == len(content) and all(isinstance(t, str) for t in texts):
            return "".join(str(t) for t in texts)
    if not isinstance(content, str):
        raise DataError(
            f"{where}: message {i} ({role}) has no string 'content' (or 'value'), got "
            f"{type(content).__name__}."
        )
    return content


def normalize(messages: Any, where: object, *, key: str) -> list[dict[str, Any]]:
    """Messages of any schema as ``{"role", "content", ...}`` with chat-template roles."""
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: {key!r} must be a non-empty list of messages.")
    out = []
    for i, m in enumerate(messages):
        name = (m.get("role", m.get("from")) if isinstance(m, dict) else None) or None
        role = ROLES.get(str(name).lower()) if name is not None else None
        if role is None:
            raise DataError(
                f"{where}: message {i} has role {name!r}, which fsdpkit does not know. Known "
                f"roles: {', '.join(ROLES)}. Rename it (data.columns cannot rename roles) "
                "or drop the message."
            )
        assert isinstance(m, dict)
        extra = {k: v for k, v in m.items() if k not in ("role", "from", "content", "value")}
        out.append({**extra, "role": role, "content": _content(m, i=i, role=role, where=where)})
    return out


def _checked(conv: Conversation, where: object) -> Conversation:
    """Refuse conversations with nothing to learn or tool results answering nothing."""
    seen_assistant = False
    for i, m in enumerate(conv.messages):
        if m["role"] == "tool" and not seen_assistant:
            raise DataError(
                f"{where}: message {i} has role 'tool' (a tool's result) but no assistant "
                "message before it makes the call it answers. Put the assistant's call "
                "first, or drop the message."
            )
        seen_assistant |= m["role"] == "assistant"
    replies = [
        i for i, m in enumerate(conv.messages) if i >= conv.train_from and m["role"] == "assistant"
    ]
    empty = tuple(i for i in replies if _empty(conv.messages[i]))
    if len(empty) == len(replies):
        raise DataError(
            f"{where}: the conversation has no assistant message to train on (none, or "
            "only empty ones), so it has nothing to learn (the loss is taken on assistant "
            "replies only). Add the reply or remove the row."
        )
    return replace(conv, untrained=empty) if empty else conv


def _empty(message: dict[str, Any]) -> bool:
    """An assistant message with no text and no tool call."""
    return not (message["content"].strip() or message.get("tool_calls"))


def _prompt_completion(record: dict[str, Any], where: object) -> Conversation:
    prompt, completion = record["prompt"], record["completion"]
    if isinstance(prompt, str) and isinstance(completion, str):
        if not completion.strip():
            raise DataError(
                f"{where}: the completion is empty, so this example has nothing to learn "
                "(the loss is taken on the completion only). Fill it in or remove the row."
            )
        return Conversation("prompt_completion", plain=(prompt, completion))
    if isinstance(prompt, list) and isinstance(completion, list):
        head = normalize(prompt, where, key="prompt")
        tail = normalize(completion, where, key="completion")
        conv = Conversation(
            "prompt_completion", head + tail, train_from=len(head), tools=_tools(record, where)
        )
        return _checked(conv, where)
    raise DataError(
        f"{where}: 'prompt' and 'completion' must both be strings (standard) or both be "
        f"message lists (conversational); got {type(prompt).__name__} and "
        f"{type(completion).__name__}."
    )


def _alpaca(record: dict[str, Any], where: object) -> Conversation:
    raw = {k: record.get(k) for k in ("instruction", "input", "output", "system")}
    raw["input"] = raw["input"] or ""
    raw["system"] = raw["system"] or ""
    bad = [k for k, v in raw.items() if not isinstance(v, str)]
    if bad:
        raise DataError(f"{where}: alpaca field(s) {', '.join(bad)} must be strings.")
    fields: dict[str, str] = {k: str(v) for k, v in raw.items()}
    instruction, extra, output = fields["instruction"], fields["input"], fields["output"]
    if not output.strip():
        raise DataError(f"{where}: the alpaca 'output' is empty, so the row has nothing to learn.")
    messages = [{"role": "system", "content": fields["system"]}] if fields["system"] else []
    for pair in record.get("history") or []:
        if not (
            isinstance(pair, list) and len(pair) == 2 and all(isinstance(x, str) for x in pair)
        ):
            raise DataError(f"{where}: alpaca 'history' must be a list of [question, answer].")
        messages += [
            {"role": "user", "content": pair[0]},
            {"role": "assistant", "content": pair[1]},
        ]
    user = f"{instruction}\n\n{extra}" if extra else instruction
    messages += [{"role": "user", "content": user}, {"role": "assistant", "content": output}]
    plain: tuple[str, str] | None = None
    if not record.get("history"):
        block = f"### Input:\n{extra}\n\n" if extra else ""
        prompt = ALPACA_PROMPT.format(
            paired=_PAIRED if extra else "", instruction=instruction, input_block=block
        )
        plain = ((fields["system"] + "\n\n" if fields["system"] else "") + prompt, output)
    return Conversation("alpaca", messages, plain=plain)
