"""Masking, packing and data order."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from training.data import IGNORE_INDEX, DataOrder, load_records, pack, tokenize_sample, to_messages
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


def test_packed_samples_do_not_attend_to_each_other(tokenizer, tiny_model):
    # use_cache=False as in training: with a KV cache, transformers does not derive the packed mask.
    samples = [tokenize_sample(tokenizer, m["messages"]) for m in synthetic_samples(3, seed=5)]
    packed = pack(samples, seq_len=256, pad_id=tokenizer.pad_token_id)
    assert len(packed) == 1
    lengths = [len(ids) for ids, _ in samples]
    with torch.no_grad():
        packed_logits = tiny_model(input_ids=torch.from_numpy(packed.input_ids), position_ids=torch.from_numpy(packed.position_ids), use_cache=False).logits[0]
        offset = 0
        for (ids, _), length in zip(samples, lengths):
            alone = tiny_model(input_ids=torch.tensor([ids])).logits[0]
            assert torch.allclose(packed_logits[offset:offset + length], alone, atol=1e-5), f"sample at {offset} saw another sample"
            offset += length
        # Control: with plain positions (no reset), the second sample does see the first.
        leaky = tiny_model(input_ids=torch.from_numpy(packed.input_ids)).logits[0]
        second = tiny_model(input_ids=torch.tensor([samples[1][0]])).logits[0]
        assert not torch.allclose(leaky[lengths[0]:lengths[0] + lengths[1]], second, atol=1e-3)
    assert packed.position_ids[0, lengths[0]] == 0  # positions restart at each sample
    assert packed.labels[0, lengths[0]] == IGNORE_INDEX  # nothing learns across the boundary
    assert packed.real[0].sum() == sum(lengths)


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
