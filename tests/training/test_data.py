"""Masking, packing and data order."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from training.data import IGNORE_INDEX, DataOrder, collate, load_records, pack, tokenize_sample, to_messages
from training.tiny import synthetic_samples

CONVERSATION = [
    {"role": "system", "content": "You are a careful assistant."},
    {"role": "user", "content": "Reverse the words: apple banana"},
    {"role": "assistant", "content": "banana apple"},
]


def test_labels_cover_exactly_the_assistant_reply(tokenizer):
    ids, labels = tokenize_sample(tokenizer, CONVERSATION)
    trained = [token for token, label in zip(ids, labels) if label != IGNORE_INDEX]
    assert tokenizer.decode(trained) == "banana apple<|im_end|>\n"
    first_trained = next(i for i, label in enumerate(labels) if label != IGNORE_INDEX)
    assert tokenizer.decode(ids[:first_trained]).endswith("<|im_start|>assistant\n")


def test_prompt_tokens_add_nothing_to_the_loss(tokenizer, tiny_model):
    ids, labels = tokenize_sample(tokenizer, CONVERSATION)
    input_ids, label_tensor = torch.tensor([ids]), torch.tensor([labels])
    with torch.no_grad():
        logits = tiny_model(input_ids=input_ids).logits
        loss = tiny_model(input_ids=input_ids, labels=label_tensor).loss
    per_token = torch.nn.functional.cross_entropy(logits[0, :-1], input_ids[0, 1:], reduction="none")
    response = label_tensor[0, 1:] != IGNORE_INDEX
    assert torch.allclose(loss, per_token[response].mean(), atol=1e-6)
    # Changing the prompt's own next-token targets cannot move the loss: they are masked.
    scrambled = label_tensor.clone()
    scrambled[0, ~torch.cat([torch.tensor([False]), response])] = IGNORE_INDEX
    with torch.no_grad():
        assert torch.allclose(tiny_model(input_ids=input_ids, labels=scrambled).loss, loss)
    assert not torch.allclose(per_token.mean(), loss)  # the prompt would have counted otherwise


def _micro_batch(tokenizer, *, rows: int = 2, seq_len: int = 96, seed: int = 5):
    """Two packed rows of several samples each, with padding, and the samples themselves."""
    samples = [tokenize_sample(tokenizer, m["messages"]) for m in synthetic_samples(8, seed=seed)]
    packed = pack(samples, seq_len=seq_len, pad_id=tokenizer.pad_token_id)
    assert len(packed) >= rows and packed.real[:rows].sum() < rows * seq_len  # padding in there too
    return samples, packed, collate(packed, np.arange(rows), torch.device("cpu"))


def test_a_micro_batch_is_one_flattened_row_that_flash_attention_treats_as_packed(tokenizer):
    from transformers.modeling_flash_attention_utils import _is_packed_sequence

    samples, packed, batch = _micro_batch(tokenizer)
    inputs = batch.inputs
    assert inputs["input_ids"].shape == (1, 2 * 96) and batch.labels.shape == (1, 2 * 96)
    # transformers' flash-attention path: packed only at batch size 1 (the (2, 96) layout is not).
    assert _is_packed_sequence(inputs["position_ids"], batch_size=1)
    assert not _is_packed_sequence(torch.from_numpy(packed.position_ids[:2]), batch_size=2)
    # Varlen boundaries, computed on the CPU: every sample, and each row's padding, is a segment.
    lengths = [len(ids) for ids, _ in samples]
    row0 = [n for n in np.cumsum(lengths) if n <= packed.real[0].sum()]
    expected = [0, *row0, 96]
    cu = inputs["cu_seq_lens_q"].tolist()
    assert cu[: len(expected)] == expected and cu[-1] == 192 and inputs["cu_seq_lens_k"] is inputs["cu_seq_lens_q"]
    assert inputs["cu_seq_lens_q"].dtype == torch.int32
    assert isinstance(inputs["max_length_q"], int) and inputs["max_length_q"] == max(np.diff(cu))
    assert batch.real_tokens == int(packed.real[:2].sum()) == sum(batch.sample_lengths)
    assert "attention_mask" not in inputs


def test_samples_on_the_flattened_row_do_not_attend_to_each_other(tokenizer, tiny_model):
    # use_cache=False as in training: with a KV cache, transformers does not derive the packed mask.
    samples, packed, batch = _micro_batch(tokenizer)
    with torch.no_grad():
        flat = tiny_model(**batch.inputs, use_cache=False).logits[0]
        checked = 0
        bounds = batch.inputs["cu_seq_lens_q"].tolist()
        for start, end in zip(bounds[:-1], bounds[1:]):
            if not packed.real.reshape(-1)[start]:
                continue  # a row's padding
            ids = batch.inputs["input_ids"][0, start:end]
            alone = tiny_model(input_ids=ids[None]).logits[0]
            assert torch.allclose(flat[start:end], alone, atol=1e-5), f"sample at {start} saw another sample"
            checked += 1
        assert checked == len(batch.sample_lengths) >= 3
        # Control: with plain positions (no restart), the second sample does see the first.
        leaky = tiny_model(input_ids=batch.inputs["input_ids"]).logits[0]
        second = slice(bounds[1], bounds[2])
        alone = tiny_model(input_ids=batch.inputs["input_ids"][:, second]).logits[0]
        assert not torch.allclose(leaky[second], alone, atol=1e-3)
    lengths = [len(ids) for ids, _ in samples]
    assert packed.position_ids[0, lengths[0]] == 0  # positions restart at each sample
    assert packed.labels[0, lengths[0]] == IGNORE_INDEX  # nothing learns across the boundary


def test_packing_truncates_and_starts_new_sequences():
    samples = [([1] * 5, [2] * 5), ([3] * 4, [4] * 4), ([5] * 12, [6] * 12)]
    packed = pack(samples, seq_len=8, pad_id=0)
    assert packed.input_ids.tolist() == [[1, 1, 1, 1, 1, 0, 0, 0], [3, 3, 3, 3, 0, 0, 0, 0], [5] * 8]
    assert packed.labels[0].tolist() == [IGNORE_INDEX, 2, 2, 2, 2, IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX]


def test_data_order_is_deterministic_and_independent_of_worker_count():
    two = DataOrder(num_sequences=100, global_batch=16, micro_batch=4, num_workers=2, seed=7)
    four = DataOrder(num_sequences=100, global_batch=16, micro_batch=4, num_workers=4, seed=7)
    for step in (0, 5, 6, 13):
        by_two = np.sort(np.concatenate([b for r in range(2) for b in two.micro_batches(step, r)]))
        by_four = np.sort(np.concatenate([b for r in range(4) for b in four.micro_batches(step, r)]))
        assert by_two.tolist() == by_four.tolist()
        assert len(set(by_two.tolist())) == 16
    assert [b.tolist() for b in two.micro_batches(3, 1)] == [b.tolist() for b in two.micro_batches(3, 1)]
    # a new epoch reshuffles
    assert two.steps_per_epoch == 6
    assert two.micro_batches(0, 0)[0].tolist() != two.micro_batches(6, 0)[0].tolist()


def test_dolly_and_alpaca_rows_become_chats():
    dolly = {"instruction": "Summarise", "context": "Text.", "response": "Short.", "category": "summarization"}
    assert to_messages(dolly) == [{"role": "user", "content": "Summarise\n\nText."}, {"role": "assistant", "content": "Short."}]
    alpaca = {"instruction": "Say hi", "input": "", "output": "Hi"}
    assert to_messages(alpaca)[1] == {"role": "assistant", "content": "Hi"}


def test_local_jsonl_json_and_parquet_files_load(tmp_path):
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"instruction": "a", "response": "b"}, {"instruction": "c", "response": "d"}]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (tmp_path / "d.json").write_text(json.dumps(rows))
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    for name in ("d.jsonl", "d.json", "d.parquet"):
        assert load_records(str(tmp_path / name)) == rows


def test_download_copies_a_file_or_a_folder(tmp_path):
    from training.storage import download

    source = tmp_path / "src"
    (source / "sub").mkdir(parents=True)
    (source / "config.json").write_text("{}")
    (source / "sub" / "x.txt").write_text("x")
    assert download(str(source / "config.json"), tmp_path / "one").read_text() == "{}"
    folder = download(str(source), tmp_path / "all")
    assert (folder / "config.json").exists() and (folder / "sub" / "x.txt").read_text() == "x"
    with pytest.raises(FileNotFoundError, match="does not exist"):
        download(str(tmp_path / "missing"), tmp_path / "none")
