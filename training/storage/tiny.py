"""A tiny Qwen2, a tokenizer trained on the spot and a synthetic instruction task, for
CPU runs and tests: nothing is downloaded. Each is written to a folder and then loaded
through the same code paths as the real model and data set (``AutoTokenizer``,
``AutoModelForCausalLM.from_pretrained``, a JSONL file).

The tokenizer is a real ``Qwen2Tokenizer`` (transformers' class, the one Qwen2.5 loads)
with a small vocabulary trained here: the same NFC normaliser, the same pre-tokenizer
(``PRETOKENIZE_REGEX`` then byte-level) and the same ChatML template layout, so it splits
text the way the real model's does. In particular the regex's ``\\s*[\\r\\n]+`` groups
newlines: ``assistant\\n`` followed by a response that starts with ``\\n`` becomes one
``\\n\\n`` token, which is why labels are found by character spans (training/data/masking.py).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

WORDS = (
    "apple banana cherry delta echo fox grape hotel india juliet kilo lima mango nectar olive pear quince "
    "river stone tiger umbrella violet walnut xenon yellow zebra amber blue coral dune ember frost glade"
).split()
SYSTEM_PROMPT = "You are a careful assistant."
# ChatML, as Qwen2.5 uses.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
#: Bumped whenever what this module builds changes, so caches of an older build are not reused.
BUILD = 3
#: Share of the synthetic responses that start with a newline, as real responses often do
#: (a list, a code block): the case that broke token-prefix masking with Qwen2's tokenizer.
NEWLINE_FIRST_SHARE = 0.2


def synthetic_samples(n: int, seed: int = 0) -> list[dict]:
    """``n`` instruction samples: reverse a list of 2-8 words (varied lengths, learnable);
    some responses start with a newline."""
    rng = random.Random(seed)
    samples = []
    for _ in range(n):
        words = [rng.choice(WORDS) for _ in range(rng.randint(2, 8))]
        answer = " ".join(reversed(words))
        if rng.random() < NEWLINE_FIRST_SHARE:
            answer = "\n" + answer
        samples.append({
            "messages": [
                {"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": "Reverse the words: " + " ".join(words)},
                {"role": "assistant", "content": answer},
            ]
        })
    return samples


#: The rejected side of every other synthetic pair: an answer that refuses the task.
REFUSAL = "Sorry, I cannot do that."


def synthetic_pairs(n: int, seed: int = 0) -> list[dict]:
    """``n`` preference pairs of the same task in TRL's explicit-prompt conversational format: the
    words reversed (chosen) over a refusal (:data:`REFUSAL`, every other row) or over the words left
    in their order (the rest; a row whose words read the same both ways is dropped)."""
    rows = []
    for number, sample in enumerate(synthetic_samples(n, seed)):
        system, user, answer = sample["messages"]
        words = user["content"].removeprefix("Reverse the words: ")
        rejected = REFUSAL if number % 2 == 0 else words
        rows.append({"prompt": [system, user], "chosen": [answer],
                     "rejected": [{"role": "assistant", "content": rejected}]})
    return [row for row in rows if row["chosen"][0]["content"].strip() != row["rejected"][0]["content"]]


def write_dataset(path: Path, n: int = 2000, seed: int = 0, *, pairs: bool = False) -> Path:
    """Write the synthetic task as chat-format JSONL (``pairs``: as preference pairs)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as out:
        for sample in (synthetic_pairs if pairs else synthetic_samples)(n, seed):
            out.write(json.dumps(sample) + "\n")
    return path


def _render(messages: list[dict]) -> str:
    """ChatML text of a conversation, as the chat template renders it."""
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)


def write_tokenizer(directory: Path, vocab_size: int = 384):
    """Train a byte-level BPE with Qwen2's normaliser and pre-tokenizer on the synthetic
    conversations (rendered as ChatML, with blank lines, so ``\\n\\n`` is a merge as in the
    real vocabulary), and save it as a ``Qwen2Tokenizer`` with the chat template in ``directory``."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX, Qwen2Tokenizer

    corpus = [_render(sample["messages"]) for sample in synthetic_samples(3000, seed=1)]
    corpus += ["Reverse the words:\n\n" + " ".join(WORDS[i:i + 4]) + "\n\n\n" for i in range(0, len(WORDS), 2)] * 20
    trainer_model = Tokenizer(models.BPE())
    # Qwen2Tokenizer's own pipeline (transformers/models/qwen2/tokenization_qwen2.py).
    trainer_model.normalizer = normalizers.NFC()
    trainer_model.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    trainer_model.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    trainer_model.train_from_iterator(corpus, trainer=trainer)
    learned = json.loads(trainer_model.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in learned["merges"]]
    tokenizer = Qwen2Tokenizer(
        vocab=learned["vocab"], merges=merges, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(str(directory))
    return tokenizer


def write_model(directory: Path, *, vocab_size: int, seed: int = 0, hidden_size: int = 64, num_layers: int = 2):
    """A randomly initialised tiny Qwen2 saved with ``save_pretrained`` in ``directory``."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=None,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    quiet_save(model, directory)
    return model


def quiet_save(model, directory) -> None:
    """``save_pretrained`` without its "Writing model shards" progress bar on stderr: this is a
    build step of our own, not a download, and on a new machine the bar would come before
    whatever the run says next (an error about the data set, say)."""
    from transformers.utils import logging as hf_logging

    bars_were_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(str(directory))
    finally:
        if bars_were_on:
            hf_logging.enable_progress_bar()


def materialize_model(directory: Path) -> Path:
    """Tokenizer and tiny model in ``directory`` (idempotent)."""
    if (directory / "config.json").exists() and (directory / "tokenizer.json").exists():
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = write_tokenizer(directory)
    write_model(directory, vocab_size=len(tokenizer))
    return directory
