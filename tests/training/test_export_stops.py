"""The exported model stops where training taught it to: at the chat template's end of turn,
not only at the base model's end of text (Qwen2.5 base's ``generation_config`` stops at
``<|endoftext|>``; its chat turns end in ``<|im_end|>``)."""

from __future__ import annotations

import copy

import torch

from training.data.masking import end_of_turn_token
from training.modeling.export import export_final_model
from training.modeling.model import load_model


def _generate(folder, prompt_ids, forced):
    """Greedy generation from the exported folder, with the tokens at each step forced to
    ``forced`` (a stand-in for what a trained model says): where it stops is the point."""
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(folder)
    start = len(prompt_ids)
    out = lm.generate(torch.tensor([prompt_ids]), max_new_tokens=len(forced), do_sample=False,
                      prefix_allowed_tokens_fn=lambda _batch, ids: [forced[min(len(ids) - start, len(forced) - 1)]])
    return out[0, start:].tolist()


def test_the_export_adds_the_end_of_turn_token_and_generate_stops_there(tiny_dir, tokenizer, tmp_path):
    base_tokenizer = copy.deepcopy(tokenizer)
    base_tokenizer.eos_token = "<|endoftext|>"  # as Qwen2.5 base's tokenizer and generation_config say
    end_of_text, end_of_turn = (tokenizer.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_end|>"))
    assert end_of_turn_token(base_tokenizer) == "<|im_end|>"
    model = load_model(str(tiny_dir), attn_implementation="sdpa", activation_checkpointing=False)
    model.lm.generation_config.eos_token_id = end_of_text
    base = model.lm.generation_config

    export_final_model(model=model, tokenizer=base_tokenizer, rank=0, uri=str(tmp_path / "final"), dtype=torch.float32)

    from transformers import GenerationConfig

    assert GenerationConfig.from_pretrained(tmp_path / "final").eos_token_id == [end_of_text, end_of_turn]
    prompt = base_tokenizer.apply_chat_template([{"role": "user", "content": "Reverse the words: fox apple"}],
                                                add_generation_prompt=True, return_dict=False)
    words = base_tokenizer("apple fox", add_special_tokens=False)["input_ids"]
    forced = [*words, end_of_turn, *words, *words]
    assert _generate(str(tmp_path / "final"), prompt, forced) == [*words, end_of_turn]
    # Control: with the base's generation config it runs past the answer.
    base.save_pretrained(tmp_path / "final")
    assert _generate(str(tmp_path / "final"), prompt, forced) == forced
