"""A tiny Qwen2, a tokenizer trained on the spot and a synthetic instruction task, for
CPU runs and tests: nothing is downloaded. Each is written to a folder and then loaded
through the same code paths as the real model and data set (``AutoTokenizer``,
``AutoModelForCausalLM.from_pretrained``, a JSONL file).
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
# ChatML, as Qwen2.5 uses; prefix-stable, so the prompt of a turn is a prefix of the whole.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def synthetic_samples(n: int, seed: int = 0) -> list[dict]:
    """``n`` instruction samples: reverse a list of 2-8 words (varied lengths, learnable)."""
    rng = random.Random(seed)
    samples = []
    for _ in range(n):
        words = [rng.choice(WORDS) for _ in range(rng.randint(2, 8))]
        samples.append({
            "messages": [
                {"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": "Reverse the words: " + " ".join(words)},
                {"role": "assistant", "content": " ".join(reversed(words))},
            ]
        })
    return samples


def write_dataset(path: Path, n: int = 2000, seed: int = 0) -> Path:
    """Write the synthetic task as chat-format JSONL."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as out:
        for sample in synthetic_samples(n, seed):
            out.write(json.dumps(sample) + "\n")
    return path


def write_tokenizer(directory: Path, vocab_size: int = 384):
    """Train a byte-level BPE tokenizer on the synthetic text and save it as a Hugging
    Face tokenizer (with the chat template) in ``directory``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = []
    for sample in synthetic_samples(3000, seed=1):
        for message in sample["messages"]:
            corpus.append(f"{message['role']}\n{message['content']}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
    )
    wrapped.chat_template = CHAT_TEMPLATE
    wrapped.save_pretrained(str(directory))
    return wrapped


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
    model.save_pretrained(str(directory))
    return model


def materialize_model(directory: Path) -> Path:
    """Tokenizer and tiny model in ``directory`` (idempotent)."""
    if (directory / "config.json").exists() and (directory / "tokenizer.json").exists():
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = write_tokenizer(directory)
    write_model(directory, vocab_size=len(tokenizer))
    return directory
