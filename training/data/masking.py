"""Tokenization with loss on response tokens only: the chat template's text, the assistant
spans in it, and labels that train exactly those tokens."""

from __future__ import annotations

import functools
import re

from .messages import for_template, row_tools, supports_tools, trainable
from .records import BadRow, IGNORE_INDEX


def assistant_spans(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> tuple[str, list[tuple[int, int]]]:
    """The conversation rendered once by the chat template, and the character span of each
    trained assistant turn in it (:func:`trainable`): its content and the template's end of turn.

    A turn's span starts where the prompt rendered with the generation prompt ends and stops
    where the conversation up to that turn ends, when the template renders prefixes as text
    prefixes (ChatML, Llama 3, Mistral do). Otherwise the content is looked up in the text,
    after the previous turn, and the EOS text right after it joins the span. A template that
    raises on the row (roles that do not alternate, for Mistral's or Gemma's) raises here.
    """
    chat = for_template(messages)
    render = functools.partial(tokenizer.apply_chat_template, tokenize=False, tools=tools)
    text = render(chat)
    spans: list[tuple[int, int]] = []
    cursor = 0
    for index, message in enumerate(messages):
        if message["role"] != "assistant" or not trainable(message):
            if message["role"] == "assistant" and message["content"]:
                found = text.find(message["content"], cursor)  # an untrained turn: skip past it
                cursor = found + len(message["content"]) if found >= 0 else cursor
            continue
        prompt = render(chat[:index], add_generation_prompt=True)
        upto = render(chat[: index + 1])
        if text.startswith(upto) and upto.startswith(prompt) and len(prompt) >= cursor:
            spans.append((len(prompt), len(upto)))
        else:
            start = text.find(message["content"], cursor) if message["content"] else -1
            if start < 0:
                raise BadRow("template_error", "the chat template does not render an assistant turn's content verbatim; "
                                               "cannot find which tokens to train")
            end = start + len(message["content"])
            if tokenizer.eos_token and text.startswith(tokenizer.eos_token, end):
                end += len(tokenizer.eos_token)
            spans.append((start, end))
        cursor = spans[-1][1]
    return text, spans


@functools.lru_cache(maxsize=8)
def _control_tokens(tokenizer) -> tuple[re.Pattern | None, dict[str, int]]:
    """The tokenizer's added tokens, special (control) or not (Qwen2.5's ``<tool_call>``): a
    pattern matching any, and their ids."""
    names = set(tokenizer.all_special_tokens) | {token.content for token in tokenizer.added_tokens_decoder.values()}
    names = sorted((n for n in names if n), key=len, reverse=True)
    if not names:
        return None, {}
    return re.compile("|".join(map(re.escape, names))), {n: tokenizer.convert_tokens_to_ids(n) for n in names}


@functools.lru_cache(maxsize=8)
def _plain_tokens(tokenizer) -> frozenset[str]:
    """The added tokens that are not special: words of the model's output (Qwen2.5's
    ``<tool_call>``), not turn boundaries."""
    special = set(tokenizer.all_special_tokens)
    return frozenset(t.content for t in tokenizer.added_tokens_decoder.values() if not t.special and t.content not in special)


@functools.lru_cache(maxsize=8)
def _text_only(tokenizer):
    """The tokenizer's pipeline without its added tokens (the ``tokenizers`` backend rebuilt from
    its JSON with none): text that holds ``<tool_call>`` or ``<|im_end|>`` is split as any text is,
    into ids of the same vocabulary."""
    import json

    from tokenizers import Tokenizer

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:  # a Python tokenizer: its own splitting of special tokens
        return None
    data = json.loads(backend.to_str())
    data["added_tokens"] = []
    return Tokenizer.from_str(json.dumps(data))


def end_of_turn_token(tokenizer) -> str | None:
    """The control token the chat template ends an assistant turn with (``<|im_end|>`` for
    ChatML, ``<|eot_id|>`` for Llama 3, ``<end_of_turn>`` for Gemma, ``</s>`` for Mistral,
    ``<|end|>`` for Phi-3): the first control token after the turn's content; None when the
    template puts none there or the tokenizer has no template."""
    if not tokenizer.chat_template:
        return None
    marker = "Zq9 end of turn probe"
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}, {"role": "assistant", "content": marker}],
                                         tokenize=False)
    pattern, _ = _control_tokens(tokenizer)
    after = text.find(marker)
    if pattern is None or after < 0:
        return None
    plain = _plain_tokens(tokenizer)
    return next((m.group() for m in pattern.finditer(text, after + len(marker)) if m.group() not in plain), None)


def _content_spans(text: str, messages: list[dict], pattern: re.Pattern | None) -> list[tuple[int, int, str]]:
    """Where each message's content is in the rendered text (in order), with its role. A content that holds a
    control token and is not rendered verbatim cannot be kept text: a :class:`BadRow`."""
    spans, cursor = [], 0
    for message in messages:
        content = message["content"]
        if not content:
            continue
        start = text.find(content, cursor)
        if start < 0:
            if pattern is not None and pattern.search(content):
                raise BadRow("template_error", "the chat template does not render a message holding a control token "
                                               "verbatim; cannot keep the token as text")
            continue
        spans.append((start, start + len(content), message["role"]))
        cursor = start + len(content)
    return spans


def encode_chat(tokenizer, text: str, messages: list[dict]) -> tuple[list[int], list[tuple[int, int]]]:
    """Token ids and character offsets of a rendered conversation, where the template's added
    tokens are tokens and the messages' text is text: ``<|im_end|>`` or ``<tool_call>`` typed by
    a user is split like any text, so no row can fake a turn boundary or a tool call. In an
    assistant's content a non-special added token (``<tool_call>``, which Hermes-style rows write
    inline) stays the token: it is the model's own output, and inference servers' tool parsers
    look for its id; a special token there is text too. Outside the messages the text is cut at
    added tokens and each piece tokenized, which is what the tokenizer does with a whole text, so
    a row without typed added tokens tokenizes alike."""
    pattern, ids_of = _control_tokens(tokenizer)
    if pattern is None or not any(pattern.search(m["content"]) for m in messages):  # the common row: one call
        encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        return list(encoded["input_ids"]), list(encoded["offset_mapping"])
    protected = _content_spans(text, messages, pattern)
    plain, text_only = _plain_tokens(tokenizer), _text_only(tokenizer)
    ids: list[int] = []
    offsets: list[tuple[int, int]] = []

    def piece(start: int, end: int) -> None:
        if start >= end:
            return
        if text_only is None:
            encoded = tokenizer(text[start:end], add_special_tokens=False, return_offsets_mapping=True,
                                split_special_tokens=True)
            found, spans = encoded["input_ids"], encoded["offset_mapping"]
        else:
            encoded = text_only.encode(text[start:end], add_special_tokens=False)
            found, spans = encoded.ids, encoded.offsets
        ids.extend(found)
        offsets.extend((start + a, start + b) for a, b in spans)

    def typed(match: re.Match) -> bool:
        for a, b, role in protected:
            if a <= match.start() < b:
                return not (role == "assistant" and match.group() in plain)
        return False

    position = 0
    for match in (pattern.finditer(text) if pattern is not None else ()):
        if typed(match):
            continue  # typed in a message: text
        piece(position, match.start())
        ids.append(ids_of[match.group()])
        offsets.append(match.span())
        position = match.end()
    piece(position, len(text))
    return ids, offsets


def tokenize_sample(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> tuple[list[int], list[int]]:
    """Token ids of the whole conversation and labels that are ``IGNORE_INDEX`` except on
    trained assistant turns: the loss is on responses only.

    The text is tokenized once (:func:`encode_chat`), with offsets; a token is trained when it
    starts inside an assistant span (:func:`assistant_spans`). Nothing depends on how the
    tokenizer merges across the prompt/response boundary: with Qwen2's tokenizer ``assistant\\n``
    followed by a response starting with ``\\n`` gives one ``\\n\\n`` token, which starts in the
    prompt and is not trained; the response's tokens after it are.
    """
    text, spans = assistant_spans(tokenizer, messages, tools)
    ids, offsets = encode_chat(tokenizer, text, messages)
    labels = [IGNORE_INDEX] * len(ids)
    span = 0
    for position, (start, _end) in enumerate(offsets):
        while span < len(spans) and start >= spans[span][1]:
            span += 1
        if span < len(spans) and spans[span][0] <= start:
            labels[position] = ids[position]
    return ids, labels


def encode_chats(tokenizer, record, index: int, chats: list[list[dict]], report) -> list[tuple[list[int], list[int]]] | None:
    """Each of a row's chats (one for a supervised row, two for a preference pair) tokenized with
    response-only labels (:func:`tokenize_sample`) and the row's tools, or None for a row the
    model's chat template cannot train (counted in ``report`` by cause: tool calls or tools it does
    not render, a row it refuses)."""
    if any(m.get("tool_calls") for chat in chats for m in chat) and not supports_tools(tokenizer):
        report.note("tool_calls_unsupported", index, "an assistant turn with tool_calls; the model's chat template renders none")
        return None
    try:
        tools = row_tools(record)
        if tools and not supports_tools(tokenizer, "tools"):
            report.note("tools_unsupported", index, f"{len(tools)} tool schema(s); the model's chat template renders none")
            return None
        return [tokenize_sample(tokenizer, chat, tools) for chat in chats]
    except BadRow as bad:
        report.note(bad.reason, index, bad.detail)
    except Exception as error:  # noqa: BLE001 - a template may raise anything on a row (jinja2's raise_exception)
        report.note("template_error", index, f"{type(error).__name__}: {str(error)[:200]}")
    return None
