"""The decoder families this project trains, each as a tiny random configuration of its own
transformers class: what the tests (and the GPU bench) run one packed step of, to check that a
family loads, trains and computes the loss a per-sample forward computes.

Each tiny configuration keeps what makes its family differ from Llama: sliding windows
(Mistral, Phi-3, Gemma 2 and 3, in windows shorter than the samples so the window bites),
soft-capped attention and logits (Gemma 2), q/k norms (Qwen3, OLMo 2, Gemma 3), scaled
embeddings, residuals, attention and logits (Granite), tied heads (Qwen2, Gemma).
"""

from __future__ import annotations

#: Window for the families with sliding-window layers: shorter than the test samples.
TINY_WINDOW = 8


def _common(vocab_size: int) -> dict:
    return {"vocab_size": vocab_size, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
            "bos_token_id": None, "eos_token_id": None, "pad_token_id": None}


def _mistral(vocab_size: int):
    from transformers import MistralConfig

    return MistralConfig(**_common(vocab_size), sliding_window=TINY_WINDOW)


def _phi3(vocab_size: int):
    from transformers import Phi3Config

    return Phi3Config(**_common(vocab_size), sliding_window=TINY_WINDOW)


def _qwen2(vocab_size: int):
    from transformers import Qwen2Config

    return Qwen2Config(**_common(vocab_size), tie_word_embeddings=True)


def _gemma(vocab_size: int):
    from transformers import GemmaConfig

    return GemmaConfig(**_common(vocab_size), head_dim=16, tie_word_embeddings=True)


def _gemma2(vocab_size: int):
    from transformers import Gemma2Config

    return Gemma2Config(**_common(vocab_size), head_dim=16, sliding_window=TINY_WINDOW, query_pre_attn_scalar=16,
                        attn_logit_softcapping=50.0, final_logit_softcapping=30.0)


def _gemma3(vocab_size: int):
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(**_common(vocab_size), head_dim=16, sliding_window=TINY_WINDOW, query_pre_attn_scalar=16,
                            layer_types=["sliding_attention", "full_attention"])


def _granite(vocab_size: int):
    from transformers import GraniteConfig

    return GraniteConfig(**_common(vocab_size), embedding_multiplier=12.0, residual_multiplier=0.22,
                         attention_multiplier=0.0625, logits_scaling=8.0)


def _by_name(name: str):
    def build(vocab_size: int):
        import transformers

        return getattr(transformers, name)(**_common(vocab_size))
    return build


#: Family -> builder of its tiny config (``vocab_size`` -> config). The README's model table names these.
FAMILIES = {
    "llama": _by_name("LlamaConfig"),
    "mistral": _mistral,
    "qwen2": _qwen2,
    "qwen3": _by_name("Qwen3Config"),
    "gemma": _gemma,
    "gemma2": _gemma2,
    "gemma3_text": _gemma3,
    "phi3": _phi3,
    "olmo2": _by_name("Olmo2Config"),
    "granite": _granite,
}


def tiny_config(family: str, vocab_size: int):
    """The tiny configuration of ``family`` (a key of :data:`FAMILIES`)."""
    if family not in FAMILIES:
        raise ValueError(f"family {family!r} has no tiny configuration; use one of {', '.join(FAMILIES)}")
    return FAMILIES[family](vocab_size)


def write_tiny_family(directory, family: str, tokenizer, *, seed: int = 0):
    """A random tiny model of ``family`` with ``tokenizer``, saved with ``save_pretrained`` in
    ``directory`` (loaded back as a real model is)."""
    import torch
    from transformers import AutoModelForCausalLM

    from ..storage.tiny import quiet_save

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, len(tokenizer)), dtype=torch.float32)
    quiet_save(model, directory)
    tokenizer.save_pretrained(str(directory))
    return directory


def per_sample_loss(lm, batch):
    """The summed next-token loss of a flattened micro-batch computed the plain way: transformers'
    own forward (the family's logit scaling and capping included), one sample at a time, no
    packing, the full logits. What a packed step's loss is checked against."""
    import torch
    import torch.nn.functional as F

    from .loss import IGNORE_INDEX, next_token_targets

    ids, labels = batch.inputs["input_ids"][0], batch.labels[0]
    bounds = batch.inputs["cu_seq_lens_q"].tolist()
    total = torch.zeros((), device=ids.device)
    for start, end in zip(bounds[:-1], bounds[1:]):
        logits = lm(input_ids=ids[start:end].unsqueeze(0), use_cache=False).logits[0].float()
        total = total + F.cross_entropy(logits, next_token_targets(labels[start:end]), ignore_index=IGNORE_INDEX,
                                        reduction="sum")
    return total
