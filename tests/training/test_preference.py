"""Preference tuning (``--objective dpo``): TRL's preference formats read through the supervised
rows' rules, each pair packed as two segments of one sequence, the per-segment log-probabilities the
losses take, the reference (the base with the adapters off under LoRA, no second model; a full
fine-tune's table computed once before the first step and read again on a resume), and the losses
and metrics against TRL's own functions (tests/training/test_preference_oracle.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from training.data import IGNORE_INDEX, collate
from training.data.preference import pack_pairs, pair_messages, tokenize_pairs
from training.data.records import BadRow, UnknownFormat
from training.data.report import DataReport

SYSTEM = {"role": "system", "content": "Be brief."}
USER = {"role": "user", "content": "Reverse the words: apple pear"}
GOOD = {"role": "assistant", "content": "pear apple"}
BAD = {"role": "assistant", "content": "apple pear"}


def _plain(messages):
    return [(m["role"], m["content"], m["train"]) for m in messages]


@pytest.mark.parametrize("row", [
    {"prompt": [SYSTEM, USER], "chosen": [GOOD], "rejected": [BAD]},  # explicit prompt, conversational
    {"chosen": [SYSTEM, USER, GOOD], "rejected": [SYSTEM, USER, BAD]},  # implicit prompt, conversational
], ids=["explicit", "implicit"])
def test_conversational_rows_share_their_prompt_and_train_only_the_completions(row):
    chosen, rejected = pair_messages(row)
    prompt = [("system", "Be brief.", False), ("user", USER["content"], False)]
    assert _plain(chosen) == prompt + [("assistant", "pear apple", True)]
    assert _plain(rejected) == prompt + [("assistant", "apple pear", True)]


def test_string_rows_are_a_user_turn_and_an_assistant_turn_and_an_implicit_prompt_is_the_shared_text():
    """As TRL's ``extract_prompt`` cuts strings: where they part, a space before it staying with the completions."""
    chosen, rejected = pair_messages({"prompt": "Name a fruit.", "chosen": "A pear.", "rejected": "A car."})
    assert _plain(chosen) == [("user", "Name a fruit.", False), ("assistant", "A pear.", True)]
    assert _plain(rejected)[1] == ("assistant", "A car.", True)
    chosen, rejected = pair_messages({"chosen": "Q: fruit? A: a pear", "rejected": "Q: fruit? A: a car"})
    assert _plain(chosen) == [("user", "Q: fruit? A: a", False), ("assistant", " pear", True)]
    assert _plain(rejected) == [("user", "Q: fruit? A: a", False), ("assistant", " car", True)]


def test_rows_that_cannot_say_what_is_preferred_are_refused_by_cause():
    with pytest.raises(BadRow) as same:
        pair_messages({"prompt": "x", "chosen": "y", "rejected": "y"})
    assert same.value.reason == "identical_pair"
    with pytest.raises(BadRow) as mixed:
        pair_messages({"chosen": [USER, GOOD], "rejected": "apple pear"})
    assert mixed.value.reason == "malformed_pair" and "both as strings or both as lists" in mixed.value.detail
    with pytest.raises(UnknownFormat):
        pair_messages({"messages": [USER, GOOD]})


def test_a_supervised_data_set_under_dpo_is_refused_naming_the_formats_and_the_objective(tokenizer, tmp_path):
    from training.data import DataError, build_training_data

    path = tmp_path / "sft.jsonl"
    path.write_text("".join(json.dumps({"messages": [USER, GOOD]}) + "\n" for _ in range(5)))
    with pytest.raises(DataError) as error:
        build_training_data(tokenizer, str(path), seq_len=128, seed=0, objective="dpo")
    assert "prompt/chosen/rejected" in str(error.value) and "--objective sft" in str(error.value)


def test_pairs_are_tokenized_as_supervised_rows_and_packed_as_two_segments_that_never_part(tokenizer):
    from training.data import tokenize_sample
    from training.data.preference import CHOSEN, REJECTED

    rows = [{"prompt": [USER], "chosen": [GOOD], "rejected": [BAD]},
            {"prompt": "Count to three.", "chosen": "one two three", "rejected": "three"},
            {"prompt": "x", "chosen": "same", "rejected": "same"}]
    report = DataReport(rows=len(rows))
    pairs = tokenize_pairs(tokenizer, rows, range(3), seq_len=64, report=report)
    assert report.used == 2 and report.skipped["identical_pair"] == 1
    assert pairs[0][0] == tokenize_sample(tokenizer, pair_messages(rows[0])[0])  # the supervised row's ids and labels
    packed = pack_pairs(pairs, seq_len=64, pad_id=0)
    assert len(packed) == 2 and list(packed.pairs) == [1, 1] and list(packed.loss_units) == [1, 1]
    lengths = [len(side[0]) for pair in pairs for side in pair]
    first = packed.slots[0]
    assert list(first[: lengths[0] + lengths[1]]) == [CHOSEN] * lengths[0] + [REJECTED] * lengths[1]
    assert (first[lengths[0] + lengths[1]:] == -1).all() and packed.position_ids[0][lengths[0]] == 0

    for flatten in (True, False):
        batch = collate(packed, np.array([0, 1, -1]), torch.device("cpu"), flatten=flatten)
        assert batch.pairs.count == 2 and list(batch.pairs.pair_ids) == [0, 1]
        trained = [sum(label != IGNORE_INDEX for label in side[1][1:]) for pair in pairs for side in pair]
        assert batch.pairs.segment_tokens.tolist() == trained
        assert torch.bincount(batch.pairs.segments).tolist() == trained
        assert batch.pairs.bounds.tolist() == np.concatenate([[0], np.cumsum(trained)]).tolist()
    # Sequences in any order: the pairs numbered as they appear, each segment one run of trained positions.
    batch = collate(packed, np.array([1, 0]), torch.device("cpu"))
    assert list(batch.pairs.pair_ids) == [1, 0] and (torch.diff(batch.pairs.segments) >= 0).all()


def test_a_long_pair_is_cut_so_both_sides_fit_one_sequence_the_longer_side_first():
    from training.data.preference import _fit

    assert _fit(30, 200, 128) == (30, 98)
    assert _fit(200, 30, 128) == (98, 30)
    assert _fit(100, 100, 128) == (64, 64)
    assert _fit(10, 20, 128) == (10, 20)


def _segment_logps_by_hand(lm, batch) -> list[float]:
    """Each segment's summed log-probability of its trained tokens from the full logits, segment by segment."""
    ids = batch.inputs["input_ids"][0]
    labels = batch.labels[0]
    starts = [int(s) for s in batch.inputs["cu_seq_lens_q"]]
    out = []
    for start, end in zip(starts[:-1], starts[1:]):
        with torch.no_grad():
            logits = lm(input_ids=ids[start:end][None]).logits[0].float()
        logps = torch.log_softmax(logits[:-1], dim=-1)
        targets = labels[start + 1:end]
        keep = targets != IGNORE_INDEX
        if keep.any():
            out.append(float(logps[keep].gather(1, targets[keep][:, None]).sum()))
    return out


@pytest.fixture(scope="module")
def packed_pairs(tokenizer):
    from training.storage.tiny import synthetic_pairs

    rows = synthetic_pairs(12, seed=3)
    return pack_pairs(tokenize_pairs(tokenizer, rows, range(len(rows)), seq_len=128, report=DataReport()), seq_len=128,
                      pad_id=tokenizer.pad_token_id or 0)


def test_each_segments_log_probability_is_its_completions_under_the_model(tiny_dir, tiny_model, packed_pairs):
    """The chunked per-segment sums (chunks of 7 tokens, so several per segment) are the full logits'."""
    from training.modeling.model import load_model
    from training.modeling.preference import pair_logps

    model = load_model(str(tiny_dir), attn_implementation="sdpa", activation_checkpointing=False, loss_chunk_tokens=7).eval()
    batch = collate(packed_pairs, np.arange(3), torch.device("cpu"))
    with torch.no_grad():
        found = pair_logps(model, batch)
    assert found.shape == (2 * batch.pairs.count,) and found.dtype == torch.float32
    assert found.tolist() == pytest.approx(_segment_logps_by_hand(tiny_model, batch), abs=1e-4)


def test_lora_dpo_takes_the_base_with_the_adapters_off_as_reference_and_builds_no_second_model(tiny_dir, tiny_model,
                                                                                                packed_pairs, monkeypatch):
    """The reference pass is the base model's own log-probabilities, whatever the adapters have
    learnt, and the whole preference step (reference, policy, backward) constructs no module at all."""
    from training.modeling.lora import LoraSettings
    from training.modeling.model import load_model
    from training.modeling.preference import PreferenceSettings, pair_logps
    from training.modeling.step import train_step

    model = load_model(str(tiny_dir), attn_implementation="sdpa", activation_checkpointing=False,
                       lora=LoraSettings(rank=2, alpha=4, dropout=0.0))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.5)  # adapters that have learnt something
    batches = [collate(packed_pairs, np.arange(start, start + 2), torch.device("cpu")) for start in (0, 2)]
    base = _segment_logps_by_hand(tiny_model, batches[0])
    with torch.no_grad():
        assert pair_logps(model, batches[0], reference=True).tolist() == pytest.approx(base, abs=1e-4)
        assert pair_logps(model, batches[0]).tolist() != pytest.approx(base, abs=1e-2)

    built = []
    original_init = torch.nn.Module.__init__
    monkeypatch.setattr(torch.nn.Module, "__init__", lambda self, *a, **k: (built.append(self),
                                                                             original_init(self, *a, **k))[1])
    parameters_before = sum(p.numel() for p in model.parameters())
    loss, stats = train_step(model, batches, normaliser=4.0, cross_node_sync=False,
                             preference=PreferenceSettings(loss="sigmoid"))
    assert stats.shape == (6,)
    monkeypatch.undo()
    # Containers of the model's own modules at most (transformers and PEFT make ModuleLists of them): no weight of their own.
    own = {id(p) for p in model.parameters()}
    assert [name for module in built for name, p in module.named_parameters() if id(p) not in own] == []
    assert not [module for module in built if hasattr(module, "config")]
    assert sum(p.numel() for p in model.parameters()) == parameters_before
    assert torch.isfinite(loss)
    assert all(p.grad is not None for name, p in model.named_parameters() if p.requires_grad)


def test_a_full_fine_tune_computes_the_reference_once_before_its_first_step_and_a_resume_reads_it(
        tiny_loop, tmp_path, monkeypatch):
    """The run's table is written before the first step from the untrained model; a resume reads it
    (computing nothing), and a resume without it, or with another data set's, stops before any step,
    saying why (the trained model can no longer be the reference)."""
    from training.modeling import reference

    reports = []
    tiny_loop(lambda metrics, checkpoint=None, **_: reports.append(metrics), max_steps=2, checkpoint_every=2,
              objective="dpo", dataset="tiny:reverse-words-pairs", max_samples=24, eval_fraction=0.1)
    folder = tmp_path / "runs" / "tiny-cpu-sft"
    stored = (folder / reference.REFERENCE_FILE).read_bytes()
    tables, print_ = reference.decode(stored)
    assert tables.train.shape == (24, 2) and tables.eval is not None and (tables.train < 0).all()
    assert [r["step"] for r in reports if "rewards/margins" in r] == [1, 2]
    assert reports[0]["rewards/margins"] == 0.0 and reports[0]["loss"] == pytest.approx(np.log(2), abs=1e-6)

    class Worker:  # what load_or_compute reads of a resumed worker
        def __init__(self, worker_data, step):
            self.config, self.data, self.rank, self.world, self.start_step = worker_data.config, worker_data.data, 0, 1, step

    captured = {}
    real = reference.load_or_compute

    def remember(worker):
        captured["worker"] = worker
        return real(worker)

    monkeypatch.setattr(reference, "load_or_compute", remember)
    monkeypatch.setattr(reference, "compute_table", lambda *a, **k: pytest.fail("recomputed"))
    tiny_loop(lambda metrics, checkpoint=None, **_: None, max_steps=2, checkpoint_every=2, objective="dpo",
              dataset="tiny:reverse-words-pairs", max_samples=24, eval_fraction=0.1)  # the same run again: read
    resumed = Worker(captured["worker"], step=2)
    assert np.array_equal(real(resumed).train, tables.train)
    (folder / reference.REFERENCE_FILE).unlink()
    with pytest.raises(reference.ReferenceMissing, match="is not there.*resumes at step 2"):
        real(resumed)
    (folder / reference.REFERENCE_FILE).write_bytes(reference.encode(tables, "another data set"))
    with pytest.raises(reference.ReferenceMissing, match="belongs to other data"):
        real(resumed)
    assert print_ == reference.fingerprint(captured["worker"].data, captured["worker"].config.model)


def test_a_preference_run_samples_its_held_out_prompts_against_the_chosen_answer(tokenizer, tmp_path):
    from training.data import build_training_data
    from training.storage.tiny import write_dataset

    path = write_dataset(tmp_path / "pairs.jsonl", n=40, pairs=True)
    data = build_training_data(tokenizer, str(path), seq_len=128, seed=0, eval_fraction=0.2, samples=2, objective="dpo")
    assert data.train.is_pairs and data.eval.is_pairs and len(data.samples) == 2
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    for sample in data.samples:
        row = rows[sample["row"]]
        assert sample["row"] in set(data.eval_rows.tolist())
        assert sample["messages"] == row["prompt"] and sample["reference"] == row["chosen"][0]["content"]


def test_the_preference_metrics_go_to_metrics_jsonl_and_the_tracker_under_trls_names():
    """What rank 0 records of a step (training/reporting.py) and what the tracker logs of a record
    (training/telemetry/tracking.py): every preference metric, TRL's name."""
    from training.modeling.preference import STATS
    from training.reporting import PREFERENCE_KEYS
    from training.telemetry.tracking import STEP_KEYS, metrics_of

    assert set(STATS) <= set(PREFERENCE_KEYS) <= set(STEP_KEYS)
    record = {"step": 3, "loss": 0.6, "time": 1.0, **{name: 0.25 for name in PREFERENCE_KEYS}}
    logged = {metric.key: metric.value for metric in metrics_of(record)}
    assert {name: logged[name] for name in PREFERENCE_KEYS} == {name: 0.25 for name in PREFERENCE_KEYS}
