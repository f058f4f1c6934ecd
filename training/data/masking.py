"""Tokenization with loss on response tokens only: the chat template's text, the assistant
spans in it, and labels that train exactly those tokens."""

from __future__ import annotations

import functools
import re

from .messages import for_template, trainable
from .records import BadRow, IGNORE_INDEX


def assistant_spans(tokenizer, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """The conversation rendered once by the chat template, and the character span of each
    trained assistant turn in it (:func:`trainable`): its content and the template's end of turn.

    A turn's span starts where the prompt rendered with the generation prompt ends and stops
    where the conversation up to that turn ends, when the template renders prefixes as text
    prefixes (ChatML, Llama 3, Mistral do). Otherwise the content is looked up in the text,
    after the previous turn, and the EOS text right after it joins the span. A template that
    raises on the row (roles that do not alternate, for Mistral's or Gemma's) raises here.
    """
    chat = for_template(messages)
    render = functools.partial(tokenizer.apply_chat_template, tokenize=False)
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
    """The tokenizer's special (control) tokens: a pattern matching any, and their ids."""
    names = set(tokenizer.all_special_tokens)
    names |= {token.content for token in tokenizer.added_tokens_decoder.values() if token.special}
    names = sorted((n for n in names if n), key=len, reverse=True)
    if not names:
        return None, {}
    return re.compile("|".join(map(re.escape, names))), {n: tokenizer.convert_tokens_to_ids(n) for n in names}


def _content_spans(text: str, messages: list[dict], pattern: re.Pattern | None) -> list[tuple[int, int]]:
    """Where each message's content is in the rendered text (in order). A content that holds a
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
        spans.append((start, start + len(content)))
        cursor = start + len(content)
    return spans


def encode_chat(tokenizer, text: str, messages: list[dict]) -> tuple[list[int], list[tuple[int, int]]]:
    """Token ids and character offsets of a rendered conversation, where the template's control
    tokens are control tokens and the messages' text is text: ``<|im_end|>`` typed by a user is
    split like any text (``split_special_tokens``), so no row can fake a turn boundary. Outside
    the messages the text is cut at control tokens and each piece tokenized, which is what the
    tokenizer does with a whole text, so a row without typed control tokens tokenizes alike."""
    pattern, ids_of = _control_tokens(tokenizer)
    if pattern is None or not any(pattern.search(m["content"]) for m in messages):  # the common row: one call
        encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        return list(encoded["input_ids"]), list(encoded["offset_mapping"])
    protected = _content_spans(text, messages, pattern)
    ids: list[int] = []
    offsets: list[tuple[int, int]] = []

    def piece(start: int, end: int) -> None:
        if start >= end:
            return
        encoded = tokenizer(text[start:end], add_special_tokens=False, return_offsets_mapping=True, split_special_tokens=True)
        ids.extend(encoded["input_ids"])
        offsets.extend((start + a, start + b) for a, b in encoded["offset_mapping"])

    position = 0
    for match in (pattern.finditer(text) if pattern is not None else ()):
        if any(a <= match.start() < b for a, b in protected):
            continue  # typed in a message: text
        piece(position, match.start())
        ids.append(ids_of[match.group()])
        offsets.append(match.span())
        position = match.end()
    piece(position, len(text))
    return ids, offsets


def tokenize_sample(tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    """Token ids of the whole conversation and labels that are ``IGNORE_INDEX`` except on
    trained assistant turns: the loss is on responses only.

    The text is tokenized once (:func:`encode_chat`), with offsets; a token is trained when it
    starts inside an assistant span (:func:`assistant_spans`). Nothing depends on how the
    tokenizer merges across the prompt/response boundary: with Qwen2's tokenizer ``assistant\\n``
    followed by a response starting with ``\\n`` gives one ``\\n\\n`` token, which starts in the
    prompt and is not trained; the response's tokens after it are.
    """
    text, spans = assistant_spans(tokenizer, messages)
    ids, offsets = encode_chat(tokenizer, text, messages)
    labels = [IGNORE_INDEX] * len(ids)
    span = 0
    for position, (start, _end) in enumerate(offsets):
        while span < len(spans) and start >= spans[span][1]:
            span += 1
        if span < len(spans) and spans[span][0] <= start:
            labels[position] = ids[position]
    return ids, labels
