"""A row of any known format as chat messages: roles mapped, content parts joined, per-turn
weights and tool calls kept (OpenAI's messages, ShareGPT, prompt/completion, Dolly, Alpaca)."""

from __future__ import annotations

import json
import math

from .records import BadRow, UnknownFormat


def _text(value) -> str:
    """A scalar as text: None and a float NaN (pandas' and Parquet's missing value) are empty."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    return str(value)


#: Chat roles as the formats name them (OpenAI's ``developer`` is a system message for older
#: models; ``function`` is OpenAI's tool role before ``tool``).
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool",
          "function": "tool"}
#: ShareGPT speakers, as chat roles (``function_call``/``observation``: the tool-calling variants).
_SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
                   "bing": "assistant", "bard": "assistant", "model": "assistant", "system": "system",
                   "function_call": "assistant", "observation": "tool", "tool": "tool", "function": "tool"}


def _content(value, where: str) -> str:
    """A message's content as text: a string, or OpenAI's content parts (``[{"type": "text",
    "text": ...}]``) joined; a part of another type (an image) is a :class:`BadRow`."""
    if isinstance(value, list):
        texts = []
        for number, part in enumerate(value):
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, dict) and part.get("type", "text") == "text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise BadRow("non_text_content", f"{where}: content part {number} is {kind!r}, not text")
        return "".join(texts)
    if isinstance(value, dict):
        return _content([value], where)
    return _text(value)


def _tool_calls(calls, where: str) -> list[dict]:
    """OpenAI's tool calls with their ``arguments`` parsed: the format sends them as a JSON
    string, while chat templates (Qwen2.5's, Llama 3.1's: ``arguments | tojson``) and inference
    servers render the object; a string would train a doubly encoded ``"{\\"city\\": ...}"``."""
    if not isinstance(calls, list):
        raise BadRow("malformed_tool_call", f"{where}.tool_calls is a {type(calls).__name__}, not a list")
    parsed = []
    for number, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise BadRow("malformed_tool_call", f"{where}.tool_calls[{number}] has no function with a name")
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except ValueError as error:
                raise BadRow("malformed_tool_call", f"{where}.tool_calls[{number}].function.arguments is not JSON "
                                                    f"({error})") from None
        parsed.append({**call, "type": call.get("type", "function"), "function": {**function, "arguments": arguments}})
    return parsed


def row_tools(record) -> list[dict] | None:
    """The row's ``tools`` (OpenAI's tool schemas; a JSON string in some data sets), passed to
    every render of the chat template as TRL does, so the model learns calls to tools whose
    schemas it saw, under the system prompt it meets at inference. None when the row has none."""
    tools = record.get("tools") if isinstance(record, dict) else None
    if isinstance(tools, str):
        try:
            tools = json.loads(tools) if tools.strip() else None
        except ValueError as error:
            raise BadRow("malformed_tools", f"tools is not JSON ({error})") from None
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list) or not all(isinstance(tool, dict) for tool in tools):
        raise BadRow("malformed_tools", f"tools is a {type(tools).__name__}, not a list of tool schemas")
    return tools


def _message(turn, where: str, roles: dict[str, str], role_keys: tuple[str, ...], content_keys: tuple[str, ...]) -> dict:
    """One turn as ``{"role", "content"[, "tool_calls"], "train"}``: ``train`` is False for an
    assistant turn with ``weight: 0`` (OpenAI's fine-tuning format, ShareGPT variants)."""
    if not isinstance(turn, dict):
        raise BadRow("malformed_message", f"{where} is a {type(turn).__name__}, not an object with a role and a content")
    key = next((k for k in role_keys if k in turn), None)
    if key is None:
        raise BadRow("malformed_message", f"{where} has no {role_keys[0]!r}")
    speaker = turn[key]
    if not isinstance(speaker, str) or speaker.lower() not in roles:
        raise BadRow("unknown_role", f"{where}: {key} {speaker!r}; use one of {', '.join(sorted(roles))}")
    content_key = next((k for k in content_keys if k in turn), content_keys[0])
    message = {"role": roles[speaker.lower()], "content": _content(turn.get(content_key), f"{where}.{content_key}")}
    calls = turn.get("tool_calls") or ([{"type": "function", "function": turn["function_call"]}]
                                       if isinstance(turn.get("function_call"), dict) else None)
    if calls:
        message["tool_calls"] = _tool_calls(calls, where)
    weight = turn.get("weight", 1)
    message["train"] = message["role"] == "assistant" and weight not in (0, 0.0, False, "0")
    return message


def to_messages(record) -> list[dict]:
    """A row as a chat: ``messages`` (role/content, OpenAI's fine-tuning format with content
    parts, ``tool_calls`` and per-turn ``weight``), ShareGPT ``conversations`` (from/value,
    with its top-level ``system``), ``prompt``/``completion``, Dolly (instruction, context,
    response) or Alpaca (instruction, input, output). Each message has ``train``: whether its
    tokens are trained (an assistant turn, not weighted 0, after the first user turn: one that
    opens the conversation is context). Raises :class:`UnknownFormat` for a row of no known
    format and :class:`BadRow` for one that is broken."""
    if not isinstance(record, dict):
        raise BadRow("not_an_object", f"a JSON {type(record).__name__} where a row (an object) belongs")
    if isinstance(record.get("messages"), list):
        messages = [_message(m, f"messages[{i}]", _ROLES, ("role",), ("content",)) for i, m in enumerate(record["messages"])]
    elif isinstance(record.get("conversations"), list):
        messages = [_message(t, f"conversations[{i}]", _SHAREGPT_ROLES, ("from", "role"), ("value", "content"))
                    for i, t in enumerate(record["conversations"])]
        if _text(record.get("system")).strip() and not (messages and messages[0]["role"] == "system"):
            messages.insert(0, {"role": "system", "content": _text(record["system"]), "train": False})
    elif "prompt" in record and "completion" in record:
        prompt, completion = record["prompt"], record["completion"]
        # TRL's conversational prompt-completion rows hold message lists.
        prompt_messages = ([_message(m, f"prompt[{i}]", _ROLES, ("role",), ("content",)) for i, m in enumerate(prompt)]
                           if isinstance(prompt, list) else [{"role": "user", "content": _text(prompt), "train": False}])
        completion_messages = ([_message(m, f"completion[{i}]", _ROLES, ("role",), ("content",)) for i, m in enumerate(completion)]
                               if isinstance(completion, list) else [{"role": "assistant", "content": _text(completion), "train": True}])
        messages = [*prompt_messages, *completion_messages]
    else:
        instruction = record.get("instruction")
        answer = record.get("response", record.get("output"))
        if instruction is None or answer is None:
            raise UnknownFormat(f"a row with keys {sorted(record)}")
        context = _text(record.get("context") or record.get("input"))
        prompt = f"{_text(instruction)}\n\n{context}" if context else _text(instruction)
        messages = [{"role": "user", "content": prompt, "train": False}, {"role": "assistant", "content": _text(answer), "train": True}]
    for message in messages:  # a greeting before the first user turn is context, not an answer
        if message["role"] == "user":
            break
        message["train"] = False
    return messages


def trainable(message: dict) -> bool:
    """Whether a message has tokens to train: a ``train`` turn (without the key: an assistant
    turn) with text or tool calls."""
    return message.get("train", message["role"] == "assistant") and bool(message["content"].strip() or message.get("tool_calls"))


def for_template(messages: list[dict]) -> list[dict]:
    """The messages as a chat template takes them (without ``train``)."""
    return [{k: v for k, v in m.items() if k != "train"} for m in messages]


def supports_tools(tokenizer, what: str = "tool_calls") -> bool:
    """Whether the tokenizer's chat template renders ``what``: ``tool_calls`` (Qwen2.5's, Llama
    3.1's do) or the schemas in ``tools``."""
    template = tokenizer.chat_template
    texts = template.values() if isinstance(template, dict) else [template or ""]
    return any(what in text for text in texts)
