"""The parts of evaluation that decide what ships, one at a time and without Ray Train (the whole
path runs in test_best_export.py): the best so far and early stopping, Ray Train's own checkpoint
manager keeping the best beside the latest under our score, the export's choice, samples that stop
at the end of turn on the training model, the benchmark's checks before Ray starts and its scores,
and the options' errors."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from training.config import ConfigError, parse_config
from training.evaluation.best import RANK_METRIC, UNRANKED, Best, checkpoint_config, choose_export, rank_of


def config(*argv: str):
    return parse_config(["--preset", "tiny-cpu", "--storage-path", "/tmp/unused", *argv])


def test_the_best_is_the_strictly_lowest_finite_eval_loss_and_patience_counts_evaluations_since():
    best = Best()
    assert best.update(2, 5.0) and best.update(4, 4.0)
    assert not best.update(6, 4.0)  # equal is not better
    assert not best.update(8, float("nan")) and not best.update(10, 4.5)
    assert (best.step, best.eval_loss, best.since) == (4, 4.0, 3)
    assert best.stop_reason(4) is None and best.stop_reason(0) is None
    assert best.stop_reason(3) == ("early stopping: 3 evaluation(s) without a lower eval loss than 4.0000 at step 4 "
                                   "(--early-stopping-patience 3)")
    assert Best.from_state(json.loads(json.dumps(best.to_state()))) == best  # through a checkpoint's train_state.json
    assert Best.from_state(None) == Best()  # a checkpoint of an older version: nothing known


def test_ray_trains_checkpoint_manager_keeps_the_best_by_our_score_and_always_the_latest(tmp_path):
    """Ray Train 2.58's own manager with our CheckpointConfig: the K lowest ranked and the latest stay, a
    step never evaluated (UNRANKED) goes first; a checkpoint without the score attribute would have
    been the best (Ray scores a missing key -inf before the order's sign), which is why every one has it."""
    from ray.train import Checkpoint
    from ray.train._internal.checkpoint_manager import _CheckpointManager
    from ray.train._internal.session import _TrainingResult

    manager = _CheckpointManager(checkpoint_config(config("--keep-checkpoints", "2")))
    results = {}
    for step, loss in [(2, 5.0), (4, 4.0), (6, None), (8, 4.5), (10, 6.0), (12, None)]:
        folder = tmp_path / f"step{step}"
        folder.mkdir()
        results[step] = _TrainingResult(checkpoint=Checkpoint.from_directory(str(folder)),
                                        metrics={"step": step, RANK_METRIC: rank_of(loss, step)})
        manager.register_checkpoint(results[step])
    kept = sorted(result.metrics["step"] for result in manager._checkpoint_results)
    assert kept == [4, 8, 12]  # the two lowest (4.0, 4.5) and the latest (never evaluated)
    assert sorted(int(path.name[4:]) for path in tmp_path.iterdir()) == [4, 8, 12]  # the others' files deleted
    assert manager.best_checkpoint_result.metrics["step"] == 4
    # Among steps never evaluated the later ranks first, whatever the report index (Ray restarts it with each
    # worker group: a tie would keep the older after a restart).
    assert rank_of(None, 12) < rank_of(None, 6) and rank_of(None, 10**6) > 100.0
    missing = _TrainingResult(checkpoint=Checkpoint.from_directory(str(tmp_path)), metrics={"step": 14})
    assert manager._get_checkpoint_score(missing) > manager._get_checkpoint_score(results[4])


def test_the_rank_survives_rays_state_file_where_infinity_would_not():
    """Ray's checkpoint manager stores metrics through pydantic, which writes inf and nan as null (a
    restarted controller could not score them): the rank of a step never evaluated is finite."""
    from ray.train.v2._internal.execution.checkpoint.checkpoint_manager import _TrainingResultState

    state = _TrainingResultState(checkpoint_dir_name="c", metrics={RANK_METRIC: rank_of(None, 8), "inf": float("inf")})
    again = _TrainingResultState.model_validate(json.loads(state.model_dump_json()))
    assert again.metrics == {RANK_METRIC: UNRANKED - 0.008, "inf": None}
    assert rank_of(float("nan"), 8) == rank_of(None, 8) and rank_of(3.5, 8) == 3.5


def test_the_export_is_the_best_step_unless_asked_or_unable():
    reported = [SimpleNamespace(metrics={"step": 4}, checkpoint="ckpt-4"), SimpleNamespace(metrics={"step": 10}, checkpoint="ckpt-10")]
    best = Best(step=4, eval_loss=4.0, since=3)
    chosen = choose_export(config(), best, last_step=10, last_eval_loss=6.5, evaluated=True, reported=reported)
    assert (chosen.which, chosen.step, chosen.checkpoint) == ("best", 4, "ckpt-4")
    assert chosen.reason == "step 4 has the lowest eval loss (4.0000), against 6.5000 at the last step 10"
    last = choose_export(config("--export", "last"), best, last_step=10, last_eval_loss=6.5, evaluated=True, reported=reported)
    assert (last.which, last.step, last.checkpoint) == ("last", 10, None) and "the lowest was 4.0000 at step 4" in last.reason
    none = choose_export(config("--eval-fraction", "0"), Best(), last_step=10, last_eval_loss=None, evaluated=False, reported=None)
    assert none.which == "last" and none.reason.startswith("no eval data")
    gone = choose_export(config(), best, last_step=10, last_eval_loss=6.5, evaluated=True, reported=reported[1:])
    assert gone.which == "last" and "is no longer kept" in gone.reason
    at_end = choose_export(config(), Best(step=10, eval_loss=3.0), last_step=10, last_eval_loss=3.0, evaluated=True, reported=None)
    assert (at_end.which, at_end.step, at_end.checkpoint) == ("best", 10, None)


def test_checkpoints_rank_by_eval_loss_only_where_the_best_is_exported():
    assert checkpoint_config(config()).checkpoint_score_attribute == RANK_METRIC
    assert checkpoint_config(config()).checkpoint_score_order == "min"
    assert checkpoint_config(config("--export", "last")).checkpoint_score_attribute is None
    assert checkpoint_config(config("--eval-fraction", "0")).checkpoint_score_attribute is None


@pytest.mark.parametrize("argv, message", [
    (["--export", "first"], "export='first'; use best (the step with the lowest eval loss, the default) or last"),
    (["--early-stopping-patience", "-1"], "early_stopping_patience=-1 must be 0 (off) or more"),
    (["--early-stopping-patience", "3", "--eval-fraction", "0"], "early_stopping_patience=3 needs an eval loss"),
    (["--sample-prompts", "-2"], "sample_prompts=-2 must be 0 (none) or more"),
    (["--sample-max-tokens", "0"], "sample_max_tokens=0 must be at least 1"),
    (["--eval-tasks", " , "], "eval_tasks=' , ' names no task"),
    (["--eval-tasks", "gsm8k,rm -rf"], "'rm -rf' is not a task name"),
    (["--eval-tasks-path", "/no/such/folder", "--eval-tasks", "x"], "eval_tasks_path='/no/such/folder': no such folder"),
    (["--eval-limit", "5"], "eval_limit=5 is set but eval_tasks is not"),
])
def test_evaluation_options_are_refused_naming_the_field_and_the_fix(argv, message):
    with pytest.raises(ConfigError, match=None) as raised:
        config(*argv)
    assert message in str(raised.value)


def test_samples_stop_at_the_chat_templates_end_of_turn_and_leave_the_model_as_training_left_it(tiny_dir, tokenizer):
    """The tiny base's generation config ends at <|endoftext|> only; a model whose head always says
    <|im_end|> ends its turn at once (the export's stopping config), and one that never does is cut at
    the limit. The model trains with the packed varlen kernel, in train mode, without a cache: as before."""
    import torch

    from training.evaluation.samples import generate
    from training.modeling.model import load_model

    model = load_model(str(tiny_dir), attn_implementation="flash_attention_2", activation_checkpointing=True)
    attention = model.lm.config._attn_implementation
    prompts = [[{"role": "user", "content": "Reverse the words: apple pear"}], [{"role": "user", "content": "Reverse: a"}]]
    end, other = tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.convert_tokens_to_ids("apple")
    assert end not in ([model.lm.generation_config.eos_token_id] if isinstance(model.lm.generation_config.eos_token_id, int)
                       else model.lm.generation_config.eos_token_id or [])
    head = model.lm.get_output_embeddings()
    for token, expected in ((end, {"completion": "", "tokens": 0, "ended": True}), (other, {"tokens": 5, "ended": False})):
        def say(module, inputs, logits, token=token):  # the head's logits: this token first, whatever the input
            logits = logits.clone()
            logits[..., token] = logits.max() + 100.0
            return logits

        hook = head.register_forward_hook(say)
        try:
            found = generate(model, tokenizer, prompts, max_new_tokens=5, device=torch.device("cpu"), max_prompt_tokens=64)
        finally:
            hook.remove()
        assert [{key: sample[key] for key in expected} for sample in found] == [expected, expected], found
    assert model.training and model.lm.config._attn_implementation == attention and model.lm.config.use_cache is False
    # A tokenizer without a pad token (Llama 3.1's, Mistral's): the prompts are padded with its end token.
    saved = tokenizer.pad_token
    tokenizer.pad_token = None
    try:
        assert len(generate(model, tokenizer, prompts, max_new_tokens=2, device=torch.device("cpu"), max_prompt_tokens=64)) == 2
    finally:
        tokenizer.pad_token = saved


def test_samples_of_a_gemma_2_model_keep_its_soft_capped_attention_with_no_static_cache(tokenizer, tmp_path):
    """A Gemma-2-shaped tiny model (training/modeling/families.py) whose attention scores are capped hard,
    and whose generation config asks for a static cache (a Hub config may: transformers 5.13 then builds
    one and compiles the forward on CUDA): the samples are the tokens eager attention, which applies the
    cap as the training's kernel does, generates greedily; the cache is a dynamic one."""
    import torch
    from transformers import AutoModelForCausalLM

    from training.evaluation.samples import generate, prompt_text
    from training.modeling.families import tiny_config
    from training.modeling.model import load_model
    from training.storage.tiny import quiet_save

    config = tiny_config("gemma2", len(tokenizer))
    config.attn_logit_softcapping = 1.0
    torch.manual_seed(3)
    lm = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # scores 64 times a random init's, so the cap bites: sdpa, which drops it, says other tokens
        for name, parameter in lm.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                parameter.mul_(8.0)
    lm.generation_config.cache_implementation = "static"
    quiet_save(lm, tmp_path)
    tokenizer.save_pretrained(str(tmp_path))
    prompt = [{"role": "user", "content": "Reverse the words: apple pear plum"}]
    model = load_model(str(tmp_path), attn_implementation="flash_attention_2", activation_checkpointing=True)
    caches = []
    hook = model.lm.register_forward_pre_hook(
        lambda module, args, kwargs: caches.append(type(kwargs.get("past_key_values")).__name__), with_kwargs=True)
    try:
        (found,) = generate(model, tokenizer, [prompt], max_new_tokens=8, device=torch.device("cpu"), max_prompt_tokens=64)
    finally:
        hook.remove()
    eager = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32, attn_implementation="eager").eval()
    ids = tokenizer(prompt_text(tokenizer, prompt), add_special_tokens=False, return_tensors="pt")
    with torch.no_grad():
        expected = eager.generate(**ids, max_new_tokens=found["tokens"], min_new_tokens=found["tokens"], do_sample=False,
                                  cache_implementation="dynamic", eos_token_id=None, pad_token_id=tokenizer.pad_token_id)
    assert found["completion"] == tokenizer.decode(expected[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
    assert found["tokens"] > 0 and set(caches) == {"DynamicCache"}, caches


def test_benchmark_tasks_are_checked_before_ray_starts(tmp_path, capsys):
    """An unknown task name and a task whose data is not there stop the run with exit 2 and a line that
    names the task, before Ray starts (no node is paid for)."""
    import ray

    from training.train import main

    (tmp_path / "mine.yaml").write_text("task: mine\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: "
                                        f"{tmp_path / 'absent.jsonl'}\ntest_split: test\noutput_type: generate_until\n"
                                        "doc_to_text: '{{q}}'\ndoc_to_target: '{{a}}'\nmetric_list:\n  - metric: exact_match\n")
    base = ["--preset", "tiny-cpu", "--storage-path", str(tmp_path / "runs"), "--eval-tasks-path", str(tmp_path)]
    assert main([*base, "--eval-tasks", "no_such_task_anywhere"]) == 2
    err = capsys.readouterr().err
    assert "eval_tasks: 'no_such_task_anywhere' is not a task lm-evaluation-harness 0.4.13 knows" in err
    assert main([*base, "--eval-tasks", "mine"]) == 2
    assert "eval_tasks: task 'mine' cannot load (" in capsys.readouterr().err
    assert not ray.is_initialized() and not (tmp_path / "runs").exists()


def test_benchmark_scores_are_read_by_metric_and_compared_with_the_base():
    from training.evaluation.harness import difference, scores_of

    results = {"results": {"gsm8k": {"alias": "gsm8k", "exact_match,strict-match": 0.5, "exact_match_stderr,strict-match": "N/A",
                                     "exact_match,flexible-extract": 0.6},
                           "mine": {"acc,none": 0.25, "acc_stderr,none": 0.01, "sample_len": 8}}}
    scores = scores_of(results)
    assert scores == {"gsm8k": {"exact_match/strict-match": 0.5, "exact_match/flexible-extract": 0.6}, "mine": {"acc": 0.25}}
    assert difference(scores, {"mine": {"acc": 0.2}}) == {"mine": {"acc": pytest.approx(0.05)}}


def test_samples_of_steps_trained_again_are_replaced_and_a_resume_keeps_the_earlier_ones(tmp_path):
    from training.telemetry.runlog import SAMPLES_FILE, RunLog, parse_lines

    log = RunLog(str(tmp_path), resume_step=0, about={})
    for step in (2, 4, 6):
        log.add_samples(step, [{"completion": f"at {step}"}])
    log.add_samples(4, [{"completion": "again at 4"}])  # a restart from step 2's checkpoint trains 3 and 4 again
    log.flush()
    log.close()
    assert [(r["step"], r["completion"]) for r in parse_lines((tmp_path / SAMPLES_FILE).read_text())] == [(2, "at 2"), (4, "again at 4")]
    resumed = RunLog(str(tmp_path), resume_step=2, about={})
    assert [r["step"] for r in resumed.samples] == [2]
    resumed.close()


def test_sample_prompts_are_the_first_usable_held_out_rows_without_their_answer(tokenizer, tmp_path):
    from training.data import build_training_data

    rows = [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]} for i in range(40)]
    rows[0] = {"messages": [{"role": "user", "content": "no answer"}]}
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    data = build_training_data(tokenizer, str(path), seq_len=64, seed=1, eval_fraction=0.25, samples=3)
    held_out = [int(i) for i in data.eval_rows if int(i) != 0][:3]
    assert [sample["row"] for sample in data.samples] == held_out
    for sample in data.samples:
        assert sample["messages"] == [{"role": "user", "content": f"q{sample['row']}"}]
        assert sample["reference"] == f"a{sample['row']}"
    assert build_training_data(tokenizer, str(path), seq_len=64, seed=1, eval_fraction=0.0, samples=3).samples == []


def test_checkpoints_of_an_earlier_version_are_ranked_before_ray_reads_its_snapshot(tmp_path):
    """A run folder whose checkpoints were reported without the rank (an earlier version, or --export last)
    resumed with --export best: Ray would score them -inf, the best under min, and keep them over every new
    best. Their rank is written into Ray's own snapshot first, in Ray's order, and Ray still reads it."""
    from ray.train.v2._internal.execution.checkpoint.checkpoint_manager import _CheckpointManagerState

    from training.evaluation.best import rank_earlier_checkpoints

    def result(step, eval_loss=None):
        return {"version": 0, "checkpoint_dir_name": f"checkpoint_{step}", "metrics": {"step": step, "eval_loss": eval_loss}}

    snapshot = _CheckpointManagerState(
        checkpoint_results=[result(4, 2.0), result(6), result(8, 1.5)], checkpoint_report_indices=[3, 5, 7],
        latest_checkpoint_result=result(8, 1.5), pending_training_results=[], pending_validation_specs=[],
        current_report_index=8, validated_checkpoint_dir_names=[], timed_out_validation_checkpoint_dir_names=[],
        failed_validation_checkpoint_dir_names=[])
    (tmp_path / "checkpoint_manager_snapshot.json").write_text(snapshot.model_dump_json())
    assert rank_earlier_checkpoints(config("--export", "last"), str(tmp_path)) == 0
    assert rank_earlier_checkpoints(config(), str(tmp_path)) == 4  # three, and the latest's copy
    again = _CheckpointManagerState.model_validate_json((tmp_path / "checkpoint_manager_snapshot.json").read_text())
    assert [r.metrics["step"] for r in again.checkpoint_results] == [6, 4, 8]  # worst first, as Ray keeps them
    assert again.checkpoint_report_indices == [5, 3, 7]
    assert [r.metrics[RANK_METRIC] for r in again.checkpoint_results] == [rank_of(None, 6), 2.0, 1.5]
    assert again.latest_checkpoint_result.metrics[RANK_METRIC] == 1.5
    assert rank_earlier_checkpoints(config(), str(tmp_path)) == 0  # once


def _fake_ray(monkeypatch):
    """What ``ray.remote(...)(fn)`` gives, run here: ``.remote()`` calls it, ``ray.get`` returns its values."""
    import sys

    class Task:
        def __init__(self, fn):
            self.fn = fn

        def remote(self, *args, **kwargs):
            try:
                return ("ok", self.fn(*args, **kwargs))
            except Exception as error:  # noqa: BLE001
                return ("error", error)

    def get(refs, timeout=None):
        for ref in [refs] if isinstance(refs, tuple) else refs:
            if ref[0] == "error":
                raise ref[1]
        return refs[1] if isinstance(refs, tuple) else [ref[1] for ref in refs]

    monkeypatch.setitem(sys.modules, "ray", SimpleNamespace(remote=lambda **_: Task, get=get, cancel=lambda *a, **k: None,
                                                            exceptions=SimpleNamespace(GetTimeoutError=TimeoutError)))


def test_the_base_is_scored_once_under_the_exported_tokenizer_and_stop_rules_keyed_where_the_harness_runs(
        tmp_path, monkeypatch, tiny_dir):
    """run_benchmarks as the driver runs it, its Ray tasks run here and the harness's own run stood in for:
    the base is scored on its own weights with the exported model's tokenizer and generation config (not
    its Hub ones), once per task and scoring files (an export that stops elsewhere is another base
    computation), keyed by the harness version of the process that runs it, not the driver's (which has no
    harness: its version read there was 'unknown'); a benchmark that fails is a line in the summary."""
    import shutil

    import os

    from training.evaluation import harness
    from training.storage.sources import resolve_model

    scored = []

    def fake_harness(config, model_args, include_path, names=None, *, parallelize=False):
        names = names or ["mine"]
        folder = model_args["pretrained"]
        weights = os.path.realpath(f"{folder}/model.safetensors")
        scored.append({"base": weights == base_weights, "adapter": folder.endswith("/merged"),
                       "generation": json.loads(open(f"{folder}/generation_config.json").read()), "weights": weights})
        if os.path.exists(f"{folder}/BROKEN"):
            raise RuntimeError("CUDA out of memory")
        return {"results": {names[0]: {"acc,none": 0.5 if folder.endswith("/base") else 0.75}}, "n-samples": {names[0]: {}}}

    base_weights = os.path.realpath(f"{resolve_model('tiny:qwen2')}/model.safetensors")
    _fake_ray(monkeypatch)
    monkeypatch.setattr(harness, "harness", fake_harness)
    monkeypatch.setattr(harness, "_version", lambda: "unknown", raising=False)  # the driver's view, without the harness
    run = config("--storage-path", str(tmp_path), "--eval-tasks", "mine")
    final = tmp_path / "final"
    shutil.copytree(tiny_dir, final)
    (final / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 2], "pad_token_id": 0}))
    first = harness.run_benchmarks(run, {"final_model": str(final)}, log=lambda _: None)
    second = harness.run_benchmarks(run, {"final_model": str(final)}, log=lambda _: None)
    (base,) = [entry for entry in scored if entry["base"]]  # the base once, on its own weights
    assert len(scored) == 3 and base["generation"] == {"eos_token_id": [1, 2], "pad_token_id": 0}  # the exported stop rules
    assert first["scores"] == second["scores"] == {"mine": {"acc": 0.75}} and second["base"] == {"mine": {"acc": 0.5}}
    assert second["difference"] == {"mine": {"acc": 0.25}}
    results = json.loads((final / "eval_results.json").read_text())
    assert results["model"]["results"]["mine"]["acc,none"] == 0.75 and results["settings"]["lm_eval"] == "0.4.13"
    (kept,) = second["base_scores"]
    assert kept.startswith(f"{tmp_path}/.benchmarks/") and json.loads(open(kept).read())["settings"]["lm_eval"] == "0.4.13"
    (final / "generation_config.json").write_text(json.dumps({"eos_token_id": 1}))  # an export that stops elsewhere
    harness.run_benchmarks(run, {"final_model": str(final)}, log=lambda _: None)
    assert sorted(entry["base"] for entry in scored[3:]) == [False, True]
    # A LoRA adapter (final/ holds its tokenizer and generation config): merged onto the base's weights and
    # scored under the adapter's stop rules, not the base's.
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    adapter = tmp_path / "adapter" / "final"
    get_peft_model(AutoModelForCausalLM.from_pretrained(resolve_model("tiny:qwen2")),
                   LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"])).save_pretrained(adapter)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copyfile(tiny_dir / name, adapter / name)
    (adapter / "generation_config.json").write_text(json.dumps({"eos_token_id": [7]}))
    harness.run_benchmarks(config("--storage-path", str(tmp_path / "adapter"), "--eval-tasks", "mine", "--peft", "lora"),
                           {"final_model": str(adapter)}, log=lambda _: None)
    tuned = [entry for entry in scored if entry["adapter"]]
    assert len(tuned) == 1 and tuned[0]["generation"] == {"eos_token_id": [7]}
    assert not tuned[0]["base"]  # its own merged weights
    broken = tmp_path / "broken"
    shutil.copytree(tiny_dir, broken)
    (broken / "BROKEN").write_text("")
    assert harness.run_benchmarks(run, {"final_model": str(broken)}, log=lambda _: None) == {
        "error": "RuntimeError: CUDA out of memory"}


@pytest.mark.parametrize("model, gpu, expected", [
    ("Qwen/Qwen2.5-1.5B", "L4", (1, False)), ("Qwen/Qwen2.5-7B", "L4", (4, True)), ("Qwen/Qwen2.5-7B", "H100", (1, False)),
    ("Qwen/Qwen2.5-32B", "L4", (4, True)), ("Qwen/Qwen2.5-32B", "H100", (4, True)), ("Qwen/Qwen2.5-32B", "H200", (1, False)),
])
def test_a_model_that_fits_one_gpu_is_evaluated_one_gpu_a_task_not_spread_across_the_node(model, gpu, expected):
    """lm-eval's ``parallelize`` loads with accelerate's ``device_map="auto"`` across every GPU it sees: a
    pipeline with one GPU busy at a time. A model whose bf16 weights and a log-likelihood batch's logits fit
    a GPU gets one per Ray task, and the tasks are dealt out over the node's GPUs; only one that does not
    fit is spread. (Qwen2.5-7B on an L4: 15.2 GB of weights and 10 GB of logits and log-softmax for 16 rows
    of 1,024 tokens over 151,936 ids, past the 24 GB.)"""
    from training.evaluation.harness import BATCH_SIZE
    from training.evaluation.scoring import placement, task_groups
    from training.modeling.shapes import TABLE_MODELS

    shape = TABLE_MODELS[model]
    run = parse_config(["--storage-path", "s3://bucket/runs", "--gpu-type", gpu, "--workers-per-node", "4"])
    assert placement(run, shape.parameters, shape.vocab, batch_size=BATCH_SIZE) == expected
    assert task_groups(["gsm8k", "ifeval", "mmlu", "arc_easy", "hellaswag"], 1, 4) == [
        ["gsm8k", "hellaswag"], ["ifeval"], ["mmlu"], ["arc_easy"]]
    assert task_groups(["gsm8k", "ifeval"], 4, 4) == [["gsm8k", "ifeval"]]


def test_an_adapter_is_scored_merged_so_a_base_whose_vocabulary_is_padded_keeps_every_row(tmp_path):
    """Qwen2.5 pads its vocabulary past its tokenizer's (151,936 rows, 151,665 tokens): lm-eval 0.4.13 shrinks
    a base's embeddings to the tokenizer before it puts an adapter on (its ``peft`` argument), never a whole
    model's. A tiny model padded by 64 rows stands in for it; the harness's model as lm-eval loads it is the
    adapter model PEFT makes, every row and logit."""
    import torch
    from lm_eval.models.huggingface import HFLM
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from training.evaluation.harness import model_arguments
    from training.storage.tiny import write_model, write_tokenizer

    base_dir, adapter_dir = tmp_path / "base", tmp_path / "adapter"
    base_dir.mkdir()
    tokenizer = write_tokenizer(base_dir)
    write_model(base_dir, vocab_size=len(tokenizer) + 64)
    torch.manual_seed(0)
    adapted = get_peft_model(AutoModelForCausalLM.from_pretrained(base_dir),
                             LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)).eval()
    adapted.save_pretrained(adapter_dir)
    tokenizer.save_pretrained(adapter_dir)
    tuned, base = model_arguments(parse_config(["--preset", "tiny-cpu", "--model", str(base_dir), "--storage-path", str(tmp_path)]),
                                  str(adapter_dir),
                                  str(tmp_path / "scoring"))
    harness_model = HFLM(**tuned, dtype="float32", device="cpu", batch_size=1).model
    ids = torch.tensor([tokenizer("Reverse the words: apple banana")["input_ids"]])
    with torch.no_grad():
        expected, scored = adapted(ids).logits, harness_model(ids).logits
    assert scored.shape[-1] == len(tokenizer) + 64
    torch.testing.assert_close(scored, expected, atol=1e-5, rtol=1e-5)
    assert base == {"pretrained": str(tmp_path / "scoring" / "base")}
