"""Samples you can read: at each evaluation, greedy completions of the first ``--sample-prompts``
held-out prompts (training/data/dataset.py ``sample_prompts``), at most ``--sample-max-tokens``
new tokens each, stopping at the chat template's end of turn as the exported model does
(training/modeling/export.py ``stopping_generation_config``), into ``samples.jsonl`` beside the
metrics (rank 0; training/telemetry/runlog.py) and the tracker.

Generation runs on the sharded model, every rank alike: ``generate`` goes through the FSDP root
(registered as a forward method, training/modeling/parallel.py), so each decoder layer is
gathered for its forward and freed after it, as in training; no rank ever holds the whole
model. Every rank generates the same prompts with ``synced_gpus=True`` (transformers'
``generate``: a rank whose sequences ended keeps taking part in the forwards until every rank's
have, since each forward is a collective). The decoder runs sdpa with its KV cache meanwhile (the
packed varlen kernel training uses takes no cache and no padding mask), switched back after.

The model generates as it trains (:func:`sample_generation_config`, :func:`sample_attention`):
- no static cache and no compile: a Hub generation config may ask for one (Gemma's says
  ``cache_implementation: "hybrid"``), and transformers 5.13 then builds a static cache and
  ``torch.compile``s the forward on CUDA (``generation/utils.py`` ``_prepare_cache_for_generation``,
  ``_valid_auto_compile_criteria``): a compile around FSDP2's gather hooks, in the middle of a run;
- the family's attention as training runs it: transformers' sdpa takes no soft cap
  (``integrations/sdpa_attention.py``), so a family that caps its attention scores (Gemma 2's
  ``attn_logit_softcapping``, which the varlen kernel applies in training) generates with eager
  attention, which applies it."""

from __future__ import annotations

import time

import torch
from torch.distributed.fsdp import FSDPModule

from ..modeling.export import stopping_generation_config


def prompt_text(tokenizer, messages: list[dict]) -> str:
    """The conversation rendered by the chat template, up to the assistant's turn."""
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def generate(model, tokenizer, prompts: list[list[dict]], *, max_new_tokens: int, device: torch.device,
             max_prompt_tokens: int) -> list[dict]:
    """Greedy completions of ``prompts`` (chat messages) by ``model`` (a
    :class:`~training.modeling.model.CausalLMForSFT`; collective when sharded): ``{"completion",
    "tokens", "ended"}`` each, ``ended`` True where the model ended its turn itself."""
    lm = model.lm
    generation = sample_generation_config(lm.generation_config, tokenizer, max_new_tokens=max_new_tokens)
    batch = left_padded([tokenizer(prompt_text(tokenizer, messages), add_special_tokens=False)["input_ids"][-max_prompt_tokens:]
                         for messages in prompts], pad=generation.pad_token_id, device=device)
    attention = lm.config._attn_implementation
    was_training = model.training
    model.eval()
    lm.set_attn_implementation(sample_attention(lm.config))
    try:
        with torch.no_grad():
            output = model.generate(**batch, generation_config=generation, synced_gpus=torch.distributed.is_initialized())
    finally:
        lm.set_attn_implementation(attention)
        for module in model.modules():  # the root and the last layer stay gathered after a forward, as in training's
            if isinstance(module, FSDPModule):  # eval: free them before the next step
                module.reshard()
        model.train(was_training)
    stops = generation.eos_token_id if isinstance(generation.eos_token_id, list) else [generation.eos_token_id]
    found = []
    for row in output[:, batch["input_ids"].shape[1]:].tolist():
        ended = next((i for i, token in enumerate(row) if token in stops), None)
        kept = row[:ended] if ended is not None else row
        found.append({"completion": tokenizer.decode(kept, skip_special_tokens=True), "tokens": len(kept),
                      "ended": ended is not None})
    return found


def sample_generation_config(generation, tokenizer, *, max_new_tokens: int):
    """The model's generation config for greedy samples: stopping at the end of the turn (the export's),
    at most ``max_new_tokens``, a dynamic KV cache and no compile (whatever the Hub's config asks)."""
    generation = stopping_generation_config(generation, tokenizer)
    if generation.pad_token_id is None:  # Llama 3.1's and Mistral's tokenizers have no pad token
        generation.pad_token_id = tokenizer.eos_token_id
    generation.update(max_new_tokens=max_new_tokens, do_sample=False, use_cache=True, temperature=None, top_p=None,
                      top_k=None, disable_compile=True,
                      # Named, not None: generate() fills a None from the model's own config (a static one).
                      cache_implementation="dynamic")
    return generation


def sample_attention(config) -> str:
    """The attention samples run with: sdpa (with a KV cache, a padding mask), or eager where the family
    caps its attention scores (sdpa would drop the cap the model trained with)."""
    return "eager" if getattr(config, "attn_logit_softcapping", None) else "sdpa"


def left_padded(rows: list[list[int]], *, pad: int, device: torch.device) -> dict:
    """Token rows as one batch padded on the left (generation continues every row at the right), with its
    attention mask: by hand, since a tokenizer without a pad token refuses ``padding=True``."""
    width = max(len(row) for row in rows)
    ids = torch.tensor([[pad] * (width - len(row)) + row for row in rows], dtype=torch.long, device=device)
    mask = torch.tensor([[0] * (width - len(row)) + [1] * len(row) for row in rows], dtype=torch.long, device=device)
    return {"input_ids": ids, "attention_mask": mask}


def write_samples(worker, metrics: dict) -> None:
    """The evaluation's samples (every rank generates; rank 0 records them in samples.jsonl and
    the tracker), and the seconds they took into the step's metrics (``sample_seconds``)."""
    config, prompts = worker.config, worker.data.samples
    started = time.perf_counter()
    found = generate(worker.model, worker.tokenizer, [prompt["messages"] for prompt in prompts],
                     max_new_tokens=config.sample_max_tokens, device=worker.device,
                     max_prompt_tokens=max(1, config.seq_len - config.sample_max_tokens))
    metrics["sample_seconds"] = time.perf_counter() - started
    if worker.rank != 0:
        return
    entries = [{"row": prompt["row"], "prompt": prompt["messages"][-1]["content"], **sample,
                "reference": prompt["reference"]} for prompt, sample in zip(prompts, found)]
    if worker.run_log:
        worker.run_log.add_samples(metrics["step"], entries)
    if worker.tracker:
        worker.tracker.samples(metrics["step"], entries)
    first = entries[0]
    print(f"[sample] step {metrics['step']} ({metrics['sample_seconds']:.1f} s for {len(entries)}): "
          f"{first['prompt'][:80]!r} -> {first['completion'][:120]!r}", flush=True)
