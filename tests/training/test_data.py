"""Masking, packing and data order."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from training.data import (
    IGNORE_INDEX,
    DataError,
    DataOrder,
    build_training_data,
    check_records,
    collate,
    eval_micro_batches,
    for_template,
    load_records,
    pack,
    to_messages,
    tokenize_sample,
)
from training.storage.tiny import synthetic_samples

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


def _trained_text(tokenizer, messages) -> str:
    ids, labels = tokenize_sample(tokenizer, messages)
    return tokenizer.decode([token for token, label in zip(ids, labels) if label != IGNORE_INDEX])


def test_the_tiny_tokenizer_is_qwen2s_and_groups_newlines_as_it_does(tokenizer):
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX, Qwen2Tokenizer

    assert isinstance(tokenizer, Qwen2Tokenizer)
    pre_tokenizer = json.loads(tokenizer.backend_tokenizer.to_str())["pre_tokenizer"]
    assert pre_tokenizer["pretokenizers"][0]["pattern"]["Regex"] == PRETOKENIZE_REGEX
    # The prompt ends with "assistant\n"; a response starting with "\n" makes "\n\n" one token,
    # so the prompt's ids are not a prefix of the conversation's: token-prefix masking fails here.
    prompt = tokenizer("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    whole = tokenizer("<|im_start|>assistant\n\nParis<|im_end|>\n", add_special_tokens=False)["input_ids"]
    assert whole[: len(prompt)] != prompt
    assert tokenizer.decode([whole[len(prompt) - 1]]) == "\n\n"


@pytest.mark.parametrize("response, trained", [
    ("\nbanana apple", "banana apple<|im_end|>\n"),  # the "\n\n" token starts in the prompt: not trained
    (" \n\nbanana apple", " \n\nbanana apple<|im_end|>\n"),
    ("banana\n\napple\n", "banana\n\napple\n<|im_end|>\n"),
])
def test_a_response_that_starts_with_newlines_trains_what_follows_the_prompt(tokenizer, response, trained):
    messages = [*CONVERSATION[:2], {"role": "assistant", "content": response}]
    assert _trained_text(tokenizer, messages) == trained


def test_every_assistant_turn_of_a_multi_turn_chat_is_trained_and_nothing_else(tokenizer):
    messages = [{"role": "user", "content": "Reverse the words: apple pear"}, {"role": "assistant", "content": "pear apple"},
                {"role": "user", "content": "Again: fox"}, {"role": "assistant", "content": "\nfox"}]
    assert _trained_text(tokenizer, messages) == "pear apple<|im_end|>\nfox<|im_end|>\n"


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


def test_a_micro_batch_is_one_flattened_row_of_real_tokens_that_flash_attention_treats_as_packed(tokenizer):
    from transformers.modeling_flash_attention_utils import _is_packed_sequence

    samples, packed, batch = _micro_batch(tokenizer)
    inputs = batch.inputs
    real = int(packed.real[:2].sum())
    # The packing's padding is left out: only real tokens run through the model.
    assert real < 2 * 96 and inputs["input_ids"].shape == (1, real) and batch.labels.shape == (1, real)
    # transformers' flash-attention path: packed only at batch size 1 (the (2, 96) layout is not).
    assert _is_packed_sequence(inputs["position_ids"], batch_size=1)
    assert not _is_packed_sequence(torch.from_numpy(packed.position_ids[:2]), batch_size=2)
    # Varlen boundaries, computed on the CPU: every sample is a segment, no pad is one.
    lengths = [len(ids) for ids, _ in samples]
    cu = inputs["cu_seq_lens_q"].tolist()
    assert cu == [0, *np.cumsum(lengths[: len(cu) - 1]).tolist()] and cu[-1] == real
    assert inputs["cu_seq_lens_k"] is inputs["cu_seq_lens_q"] and inputs["cu_seq_lens_q"].dtype == torch.int32
    assert isinstance(inputs["max_length_q"], int) and inputs["max_length_q"] == max(np.diff(cu))
    assert batch.real_tokens == real == sum(batch.sample_lengths)
    assert "attention_mask" not in inputs
    # The labels are the real tokens' labels, in order: no target changed by leaving the pads out.
    kept = packed.labels[:2].reshape(-1)[packed.real[:2].reshape(-1).astype(bool)]
    assert batch.labels[0].tolist() == kept.tolist()
    # The bench's "before": the whole row, each row's padding a segment of its own.
    whole = collate(packed, np.arange(2), torch.device("cpu"), keep_padding=True)
    assert whole.inputs["input_ids"].shape == (1, 2 * 96) and whole.inputs["cu_seq_lens_q"].tolist()[-1] == 192
    assert whole.label_tokens == batch.label_tokens and whole.real_tokens == batch.real_tokens


def test_samples_on_the_flattened_row_do_not_attend_to_each_other(tokenizer, tiny_model):
    # use_cache=False as in training: with a KV cache, transformers does not derive the packed mask.
    samples, packed, batch = _micro_batch(tokenizer)
    with torch.no_grad():
        flat = tiny_model(**batch.inputs, use_cache=False).logits[0]
        checked = 0
        bounds = batch.inputs["cu_seq_lens_q"].tolist()
        for start, end in zip(bounds[:-1], bounds[1:]):  # every segment a sample: no padding runs
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


def test_the_formats_people_have_become_chats():
    chat = [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "Hi"}]
    as_chat = lambda row: for_template(to_messages(row))  # noqa: E731
    assert as_chat({"messages": chat}) == chat
    sharegpt = {"conversations": [{"from": "human", "value": "Say hi"}, {"from": "gpt", "value": "Hi"}]}
    assert as_chat(sharegpt) == chat
    assert as_chat({"prompt": "Say hi", "completion": "Hi"}) == chat
    assert as_chat({"prompt": [chat[0]], "completion": [chat[1]]}) == chat  # TRL's conversational form
    dolly = {"instruction": "Summarise", "context": "Text.", "response": "Short.", "category": "summarization"}
    assert as_chat(dolly) == [{"role": "user", "content": "Summarise\n\nText."}, {"role": "assistant", "content": "Short."}]
    alpaca = {"instruction": "Say hi", "input": "", "output": "Hi"}
    assert as_chat(alpaca) == chat
    assert [m["train"] for m in to_messages(alpaca)] == [False, True]


def _rows_with_every_problem() -> list[dict]:
    good = [{"messages": m["messages"]} for m in synthetic_samples(40, seed=9)]
    return [
        *good[:10],
        {"text": "a pretraining row"},                                               # 10: no known format
        {"messages": [{"role": "user", "content": "hello"}]},                        # 11: no assistant turn
        {"instruction": "Say nothing", "response": " "},                             # 12: empty response
        {"prompt": "x " * 300, "completion": "far away"},                             # 13: response beyond seq_len
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "y " * 300}]},  # 14: truncated
        *good[10:],
        {"messages": [{"role": "user", "content": "hi"}]},                          # 45: no assistant turn again
    ]


def test_no_single_row_stops_a_run_each_kind_is_counted_and_reported_once(tokenizer, tmp_path):
    path = tmp_path / "mixed.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in _rows_with_every_problem()))
    data = build_training_data(tokenizer, str(path), seq_len=128, seed=0)
    report = data.report
    assert (report.rows, report.used, report.truncated) == (46, 41, 2)
    assert report.lines(128) == [
        "skipped 1 rows of no known format (first: row 10 (mixed.jsonl line 11): keys ['text'])",
        "skipped 2 rows with no assistant turn to train (none, weight 0, or only before the first user turn) "
        "(first: row 11 (mixed.jsonl line 12))",
        "skipped 1 rows with an empty response (first: row 12 (mixed.jsonl line 13))",
        "skipped 1 rows whose response lies wholly beyond seq_len (first: row 13 (mixed.jsonl line 14))",
        "truncated 2 samples longer than seq_len(128) tokens (first: row 13 (mixed.jsonl line 14))",
    ]
    assert len(data.train) > 0 and data.train.real.sum() > 0


def test_a_data_set_with_no_usable_row_is_an_error_naming_why():
    rows = [{"messages": [{"role": "user", "content": "hi"}]}, {"instruction": "x", "response": ""}]
    with pytest.raises(DataError, match=r"dataset='d.jsonl': no usable row among 2 \(1 rows with no assistant turn to train "
                                        r".* \(first: row 0\); 1 rows with an empty response \(first: row 1\)\); each row "
                                        r"needs an assistant turn with a non-empty response"):
        check_records(rows, "d.jsonl")
    with pytest.raises(DataError, match=r"dataset='d.jsonl': none of its 2 rows is of a known format \(first row's keys: "
                                        r"\['text'\]\); use rows of one of: messages \(chat\); conversations with from/value"):
        check_records([{"text": "a"}, {"text": "b"}], "d.jsonl")


def test_a_local_data_set_with_no_usable_row_fails_before_ray_starts(tmp_path, capsys):
    import time

    from training.train import main

    path = tmp_path / "pretraining.jsonl"
    path.write_text('{"text": "just text"}\n' * 3)
    started = time.perf_counter()
    assert main(["--preset", "tiny-cpu", "--storage-path", str(tmp_path / "runs"), "--dataset", str(path)]) == 2
    assert time.perf_counter() - started < 10
    error = capsys.readouterr().err
    assert error.startswith("error: 1 problem(s) in the training configuration:")
    assert f"dataset={str(path)!r}: none of its 3 rows is of a known format" in error


def test_held_out_rows_never_train(tokenizer, tmp_path):
    from training.storage.tiny import WORDS

    rows = [{"messages": [{"role": "user", "content": f"Reverse the words: {WORDS[i % len(WORDS)]} pear"},
                          {"role": "assistant", "content": f"pear {WORDS[i % len(WORDS)]} row{i}"}]} for i in range(300)]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    data = build_training_data(tokenizer, str(path), seq_len=128, seed=3, eval_fraction=0.1, eval_max_sequences=1000)
    assert len(data.eval_rows) == 30 and not set(data.eval_rows) & set(data.train_rows)
    trained_text = tokenizer.decode(data.train.input_ids[data.train.real == 1].tolist())
    evaluated_text = tokenizer.decode(data.eval.input_ids[data.eval.real == 1].tolist())
    for row in data.eval_rows:
        marker = f" row{row}<|im_end|>"
        assert marker not in trained_text and marker in evaluated_text
    assert data.report.used == 270  # the held-out rows are not training rows


def test_every_worker_evaluates_the_same_number_of_micro_batches_padded_with_blanks(tokenizer):
    shares = [eval_micro_batches(11, num_workers=2, micro_batch=4, rank=rank) for rank in (0, 1)]
    assert [len(s) for s in shares] == [2, 2]
    assert sorted(i for s in shares for b in s for i in b.tolist() if i >= 0) == list(range(11))
    assert shares[0][1].tolist() == [8, 9, 10, -1] and shares[1][1].tolist() == [-1] * 4
    _, packed, _ = _micro_batch(tokenizer)
    blank = collate(packed, np.array([0, -1]), torch.device("cpu"))
    # A blank slot adds no token; row 0's real tokens are what runs, and what trains.
    assert blank.inputs["input_ids"].shape == (1, int(packed.real[0].sum()))
    assert blank.label_tokens == int((packed.labels[0] != IGNORE_INDEX).sum())
    assert blank.trained_positions.tolist() == np.flatnonzero(blank.labels[0, 1:].numpy() != IGNORE_INDEX).tolist()
    # A micro-batch of blanks only still runs one token (the same collectives on every rank), training nothing.
    empty = collate(packed, np.array([-1, -1]), torch.device("cpu"))
    assert empty.inputs["input_ids"].shape == (1, 1) and empty.label_tokens == 0 and empty.real_tokens == 0


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
    from training.storage.files import download

    source = tmp_path / "src"
    (source / "sub").mkdir(parents=True)
    (source / "config.json").write_text("{}")
    (source / "sub" / "x.txt").write_text("x")
    assert download(str(source / "config.json"), tmp_path / "one").read_text() == "{}"
    folder = download(str(source), tmp_path / "all")
    assert (folder / "config.json").exists() and (folder / "sub" / "x.txt").read_text() == "x"
    with pytest.raises(FileNotFoundError, match="does not exist"):
        download(str(tmp_path / "missing"), tmp_path / "none")


def test_without_a_varlen_kernel_each_packed_sequence_is_a_row_of_its_own_with_the_same_loss(tokenizer, tiny_dir):
    """sdpa: no flattened row (whose block-diagonal mask would be (B x seq_len)²); one row per
    packed sequence, each masked within itself from its restarting positions; the loss and its
    trained tokens are the flattened varlen row's."""
    from training.modeling.model import load_model

    _, packed, flat = _micro_batch(tokenizer)
    per_row = collate(packed, np.arange(2), torch.device("cpu"), flatten=False)
    assert per_row.inputs["input_ids"].shape == (2, 96) and "cu_seq_lens_q" not in per_row.inputs
    assert (per_row.label_tokens, per_row.real_tokens, per_row.sample_lengths) == (
        flat.label_tokens, flat.real_tokens, flat.sample_lengths)
    with torch.no_grad():
        sdpa = load_model(str(tiny_dir), attn_implementation="sdpa", activation_checkpointing=False)
        varlen = load_model(str(tiny_dir), attn_implementation="flash_attention_2", activation_checkpointing=False)
        rows_loss = sdpa(**per_row.inputs, labels=per_row.labels, trained_positions=per_row.trained_positions, normaliser=1.0)
        flat_loss = varlen(**flat.inputs, labels=flat.labels, trained_positions=flat.trained_positions, normaliser=1.0)
    assert rows_loss.item() == pytest.approx(flat_loss.item(), rel=1e-5)
    blank = collate(packed, np.array([0, -1]), torch.device("cpu"), flatten=False)
    assert blank.inputs["input_ids"].shape == (2, 96) and blank.label_tokens == int((packed.labels[0] != IGNORE_INDEX).sum())
