"""Fixtures of the training tests: the tiny tokenizer and model are built once, locally."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """A folder holding the tiny tokenizer and Qwen2 (built, not downloaded)."""
    from training.tiny import materialize_model

    return materialize_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def tokenizer(tiny_dir):
    """The tiny tokenizer, loaded through ``AutoTokenizer`` as a real one is."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_dir))


@pytest.fixture(scope="session")
def tiny_model(tiny_dir):
    """The tiny Qwen2, loaded through ``AutoModelForCausalLM`` with sdpa attention."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_dir), dtype=torch.float32, attn_implementation="sdpa")
    model.eval()
    return model
