"""The training entrypoint end to end under Ray Train, 2 CPU workers, on a local Ray head
bound to 127.0.0.1 with token authentication as the pods run it (a job without the token is
refused): loss falls, a killed worker recovers from the last checkpoint to the
same final loss, a LoRA DPO run raises its margin and recovers alike, a second run resumes, the final
model loads and generates, the run's
metrics.jsonl has one line per step across both, and ``ray job submit`` runs the same
entrypoint. That run stores on ``s3://``, as the RayJob's does, through the same storage code
against moto's S3 server on 127.0.0.1, where after an asynchronous checkpoint's report the next
steps' metric reports do not wait for its upload. A worker killed as NCCL's watchdog kills one leaves NCCL's
last warnings in the job log."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from local_s3 import S3_BUCKET, free_port
from pod_node import PodNode

pytestmark = pytest.mark.distributed
ROOT = Path(__file__).resolve().parents[2]
RAY = str(Path(sys.executable).parent / "ray")
STEPS = ["--preset", "tiny-cpu", "--max-steps", "8", "--checkpoint-every", "4", "--max-samples", "400"]
#: Big enough that moto takes seconds to store it.
CHECKPOINT_MB = 64
#: What the stack tells the Ray pods of the platform (ray_train_eks/charts/pods.py): two g6.12xlarge, On-Demand.
PLATFORM = json.dumps({"instance_type": "g6.12xlarge", "node_count": 2, "gpu_usd_per_hour": 9.2032})


@pytest.fixture(scope="module")
def ray_head(tmp_path_factory, s3_server):
    """A Ray head (with the job server) on 127.0.0.1, for the whole module, with token
    authentication as the pods run it; its workers see the S3 server. This process (the driver
    of the in-process runs, the parent of ``ray job submit``) holds the token as the submitter does."""
    port, dashboard = free_port(), free_port()
    # What KubeRay gives every pod of a cluster with authOptions.mode token (its head, workers and
    # submitter: common/pod.go SetContainerTokenAuthEnvVars); set for the session in tests/conftest.py.
    auth = {key: os.environ[key] for key in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN")}
    env = {**s3_server, "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.2"}
    # As the head pod runs it: `ray start --head --block` as the first process of a PID namespace,
    # so that ending it ends this head alone (`ray stop` would stop every Ray on the machine).
    head = PodNode(None, num_cpus=3, log=tmp_path_factory.mktemp("head") / "head.log", env=env, head_args=[
        "--node-ip-address=127.0.0.1", f"--port={port}", "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard}",
        "--disable-usage-stats"])
    os.environ["RAY_ADDRESS"] = f"127.0.0.1:{port}"
    yield {"address": f"127.0.0.1:{port}", "dashboard": f"http://127.0.0.1:{dashboard}", "auth": auth}
    import ray

    ray.shutdown()
    os.environ.pop("RAY_ADDRESS", None)
    head.kill()


def metrics_lines(run_folder) -> list[dict]:
    """The run's metrics.jsonl, local or on S3, through the production reader."""
    from training.telemetry.runlog import parse_lines
    from training.storage.files import read_text

    return parse_lines(read_text(f"{run_folder}/metrics.jsonl"))


def train(capsys, *argv: str) -> dict:
    """Run ``python -m training.train`` in this process; return its JSON summary."""
    from training.train import main

    assert main(list(argv)) == 0
    last_line = capsys.readouterr().out.strip().splitlines()[-1]
    return json.loads(last_line)


@pytest.fixture(scope="module")
def submitted(ray_head, mlflow_server, tmp_path_factory):
    """The uninterrupted run, submitted as a Ray job, as the RayJob submits it: the
    training package shipped by the runtime env (``py_modules``), the same entrypoint, its run
    folder and summary on S3 (the RayJob's storage: the platform's bucket). It logs to the MLflow
    server (as the pods do, by ``MLFLOW_TRACKING_URI``) and registers its model."""
    workdir = tmp_path_factory.mktemp("submitted")
    storage = f"s3://{S3_BUCKET}/runs"
    runtime_env = json.dumps({"py_modules": [str(ROOT / "training")], "env_vars": {"MLFLOW_TRACKING_URI": mlflow_server.url,
                                                                                  "RAY_TRAIN_EKS_PLATFORM": PLATFORM}})
    for _attempt in range(20):
        result = subprocess.run(
            [RAY, "job", "submit", "--address", ray_head["dashboard"], "--runtime-env-json", runtime_env, "--",
             sys.executable, "-m", "training.train", *STEPS, "--storage-path", storage,
             "--summary-file", f"{storage}/summary.json", "--register-model", "tiny-reverse"],
            capture_output=True, text=True, timeout=300, cwd=workdir,
        )
        # Right after `ray start` the head's dashboard agent may not have registered yet; the
        # server then refuses the job (nothing was created) and says so: ask again.
        if "No available agent to submit job" not in result.stdout + result.stderr:
            break
        time.sleep(3)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summaries = [json.loads(line) for line in result.stdout.splitlines() if line.startswith('{"first_loss"')]
    return {"storage": storage, "stdout": result.stdout, "summary": summaries[-1] if summaries else None}


def test_without_the_token_no_job_is_submitted_and_the_cluster_answers_nothing(ray_head, submitted, tmp_path):
    """What a pod of another namespace that reaches the head gets: the job API refuses it (401
    without a token, 403 with a wrong one), nothing runs, and GCS refuses ``ray status``."""
    import urllib.error
    import urllib.request

    marker = tmp_path / "ran"
    without = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH") and k != "RAY_ADDRESS"}
    for env, refusal in ((without, "Unauthorized: Missing authentication token"),
                         ({**without, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "guessed"}, "Invalid authentication token")):
        result = subprocess.run([RAY, "job", "submit", "--address", ray_head["dashboard"], "--", sys.executable, "-c",
                                 f"open({str(marker)!r}, 'w')"], env=env, capture_output=True, text=True, timeout=120)
        assert result.returncode != 0 and refusal in result.stdout + result.stderr, result.stdout[-2000:] + result.stderr[-2000:]
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(f"{ray_head['dashboard']}/api/jobs/", timeout=10)
    assert refused.value.code == 401
    status = subprocess.run([RAY, "status", "--address", ray_head["address"]], env=without, capture_output=True, text=True,
                            timeout=120)
    assert status.returncode != 0 and "InvalidAuthToken" in status.stdout + status.stderr
    # With the token: the job list holds the submitted run only, and the refused job never ran.
    from ray.job_submission import JobSubmissionClient

    jobs = JobSubmissionClient(ray_head["dashboard"]).list_jobs()
    assert [job.entrypoint.split()[1:3] for job in jobs] == [["-m", "training.train"]]
    assert not marker.exists()


def test_ray_job_submit_runs_the_entrypoint_to_completion(submitted):
    assert "succeeded" in submitted["stdout"]
    assert submitted["summary"]["steps"] == 8 and submitted["summary"]["resumed_from_step"] is None
    # --summary-file holds the same summary, for scripts.
    from training.storage.files import read_text

    assert json.loads(read_text(f"{submitted['storage']}/summary.json")) == submitted["summary"]


def test_the_run_folder_has_one_metrics_line_per_step_and_the_curves(submitted):
    folder = f"{submitted['storage']}/tiny-cpu-sft"
    lines = metrics_lines(folder)
    assert [line["step"] for line in lines] == list(range(1, 9))
    assert {"loss", "learning_rate", "grad_norm", "tokens_per_s", "step_seconds", "peak_memory_gib", "time"} <= set(lines[0])
    assert [line["step"] for line in lines if "eval_loss" in line] == [8]  # the tiny preset evaluates every 10 and at the end
    assert lines[-1]["eval_loss"] == pytest.approx(submitted["summary"]["eval_loss"])
    assert submitted["summary"]["metrics"] == f"{folder}/metrics.jsonl"
    assert submitted["summary"]["curves"] == f"{folder}/curves.png"


def test_the_runs_cost_so_far_at_its_pace_and_in_the_end_is_in_its_records_and_the_tracker(submitted, mlflow_server):
    """The platform's price reaches the pods as the stack sets it (RAY_TRAIN_EKS_PLATFORM): the two workers
    share one host here, one node at 4.6016 USD/h On-Demand. Each step's record has the cost so far and at
    the measured pace (what `ray-train-eks status` and `list` read), run.json the rate, the summary and
    the MLflow run the whole."""
    from training.storage.files import read_text

    folder, summary = f"{submitted['storage']}/tiny-cpu-sft", submitted["summary"]
    lines = metrics_lines(folder)
    costs = [line["cost_usd"] for line in lines]
    assert 0 < costs[0] and costs == sorted(costs)
    assert all(line["cost_usd_projected"] >= line["cost_usd"] for line in lines)
    assert lines[-1]["cost_usd_projected"] == pytest.approx(lines[-1]["cost_usd"])  # no step left
    about = json.loads(read_text(f"{folder}/run.json"))["cost"]
    assert (about["usd_per_hour"], about["basis"], about["nodes"]) == (4.6016, "On-Demand", 1)
    assert summary["cost"]["usd"] >= costs[-1] and summary["cost"]["usd_per_hour"] == 4.6016
    run = mlflow_server.client().get_run(summary["tracking"]["mlflow_run_id"])
    assert run.data.metrics["cost_usd_final"] == pytest.approx(summary["cost"]["usd"])
    assert run.data.tags["cost.basis"] == "On-Demand"
    assert len(mlflow_server.client().get_metric_history(run.info.run_id, "cost_usd")) == 8


def test_the_run_on_s3_keeps_checkpoints_metrics_curves_and_model_in_the_bucket(submitted):
    """The storage path production uses (s3://), through Ray Train's upload and our storage layer:
    the submitted run's, before ``--resume`` adds steps to it (the module's tests run in order)."""
    import io

    import boto3
    from PIL import Image

    from training.telemetry.curves import DPI, FIGURE_INCHES

    uri, summary = submitted["storage"], submitted["summary"]
    assert summary["checkpoint"].startswith(f"{uri}/tiny-cpu-sft/checkpoint_")
    assert summary["final_model"] == f"{uri}/tiny-cpu-sft/final"
    s3 = boto3.client("s3")
    keys = {o["Key"] for o in s3.list_objects_v2(Bucket=S3_BUCKET, Prefix="runs/")["Contents"]}
    checkpoint = summary["checkpoint"].removeprefix(f"s3://{S3_BUCKET}/") + "/"
    assert any(key.startswith(checkpoint) for key in keys), sorted(keys)
    assert {"runs/tiny-cpu-sft/final/model.safetensors", "runs/tiny-cpu-sft/run.json", "runs/summary.json"} <= keys
    png = s3.get_object(Bucket=S3_BUCKET, Key="runs/tiny-cpu-sft/curves.png")["Body"].read()
    image = Image.open(io.BytesIO(png))
    assert image.format == "PNG" and image.size == (FIGURE_INCHES[0] * DPI, FIGURE_INCHES[1] * DPI)
    # run.json's parameter count is the weights a server loads (serving sizes a replica's GPUs from it).
    from safetensors.torch import load

    weights = load(s3.get_object(Bucket=S3_BUCKET, Key="runs/tiny-cpu-sft/final/model.safetensors")["Body"].read())
    about = json.loads(s3.get_object(Bucket=S3_BUCKET, Key="runs/tiny-cpu-sft/run.json")["Body"].read())
    assert about["parameters"] == sum(t.numel() for t in weights.values())


def test_the_operations_page_logs_insights_query_finds_every_step_in_the_submitters_output(submitted):
    """`ray job submit`'s output is what the RayJob's submitter pod prints, so what Fluent Bit
    sends to CloudWatch Logs: docs/operations.md's Logs Insights pattern must find each step there."""
    import re

    readme = (ROOT / "docs" / "operations.md").read_text()
    (pattern,) = re.findall(r'log like /(.+)/\n', readme)
    steps = [line for line in submitted["stdout"].splitlines() if re.search(pattern, line)]
    assert [int(re.search(r"step (\d+)/", line).group(1)) for line in steps] == list(range(1, 9))
    assert all("loss" in line for line in steps)


def test_loss_falls_and_the_final_model_loads_and_generates(submitted, tmp_path):
    summary = submitted["summary"]
    assert summary["final_loss"] < summary["first_loss"] - 0.5
    assert summary["tokens_per_s"] > 0
    # What happened to the rows, from the workers that read them.
    assert summary["data"]["used"] > 0 and summary["data"]["rows"] >= summary["data"]["used"]

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from training.storage.files import download

    assert summary["final_model"] == f"{submitted['storage']}/tiny-cpu-sft/final"
    final = download(summary["final_model"], tmp_path / "final")  # as a user copies it from the bucket
    tokenizer = AutoTokenizer.from_pretrained(final)
    model = AutoModelForCausalLM.from_pretrained(final)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Reverse the words: apple pear"}],
                                           add_generation_prompt=True, return_tensors="pt", return_dict=True)
    output = model.generate(**prompt, max_new_tokens=6, do_sample=False)
    assert output.shape[1] == prompt["input_ids"].shape[1] + 6


def test_the_run_is_tracked_once_with_its_options_platform_steps_artifacts_and_model(submitted, mlflow_server):
    """One MLflow run for the submitted run, from rank 0 only (two workers, each step once): every
    option and the plan's choices as parameters, the platform as tags, each step's metrics with its
    number, the curves, run.json and the summary as artifacts; FINISHED; the final model registered
    as a version whose source is its folder in the bucket (nothing uploaded again)."""
    client = mlflow_server.client()
    storage = submitted["storage"]
    (run,) = [r for r in mlflow_server.runs() if r.data.tags.get("ray-train-eks.run_folder") == f"{storage}/tiny-cpu-sft"]
    assert run.info.status == "FINISHED" and run.info.run_name == "tiny-cpu-sft"
    assert submitted["summary"]["tracking"]["mlflow_run_id"] == run.info.run_id
    params = run.data.params
    assert (params["model"], params["max_steps"], params["num_workers"], params["peft"]) == ("tiny:qwen2", "8", "2", "none")
    assert {"micro_batch_size", "activation_checkpointing", "lora_rank", "dataset", "learning_rate"} <= set(params)
    assert run.data.tags["platform.ray"] == "2.58.0" and run.data.tags["platform.torch"].startswith("2.13.0")
    losses = client.get_metric_history(run.info.run_id, "loss")
    assert sorted(m.step for m in losses) == list(range(1, 9))  # once each: rank 0 alone logs
    by_step = {line["step"]: line for line in metrics_lines(f"{storage}/tiny-cpu-sft")}
    assert all(m.value == pytest.approx(by_step[m.step]["loss"]) for m in losses)
    assert {"learning_rate", "grad_norm", "tokens_per_s", "step_seconds", "eval_loss"} <= set(run.data.metrics)
    assert {a.path for a in client.list_artifacts(run.info.run_id)} == {"curves.png", "run.json", "summary.json", "samples"}
    # The samples of its one evaluation (the last step), as rank 0 wrote them into samples.jsonl.
    assert [a.path for a in client.list_artifacts(run.info.run_id, "samples")] == ["samples/step-000008.jsonl"]
    (version,) = client.search_model_versions("name='tiny-reverse'")
    assert version.source == submitted["summary"]["final_model"] and version.source.startswith("s3://")
    assert version.run_id == run.info.run_id
    assert submitted["summary"]["tracking"]["registered_model"] == "tiny-reverse version 1"


def test_worker_failure_recovers_to_the_same_final_loss(submitted, mlflow_server, tmp_path, capsys):
    """Worker 1 dies after step 6: the step-4 checkpoint, written in the background and reported
    (its upload done before step 6's report returns: Ray keeps reports in order), is resumed from.
    The run is tracked, and the MLflow server is stopped after step 2 and started again: the run
    goes on at its pace, rank 0 says the tracker failed, the driver logs what rank 0 could not,
    and the MLflow run has each step once (steps 5 and 6, trained twice, too) and ends FINISHED."""
    import threading

    def restart_the_tracker_after_step_2():
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if any(line["step"] >= 2 for line in metrics_lines(tmp_path / "tiny-cpu-sft") or []):
                mlflow_server.stop()
                time.sleep(2)
                mlflow_server.start()
                return
            time.sleep(0.1)

    outage = threading.Thread(target=restart_the_tracker_after_step_2, daemon=True)
    outage.start()
    summary = train(capsys, *STEPS, "--storage-path", str(tmp_path), "--inject-failure-at-step", "6",
                    "--step-pause-s", "0.5", "--tracking-uri", mlflow_server.url, "--experiment-name", "outage")
    outage.join(timeout=120)
    run = mlflow_server.client().get_run(summary["tracking"]["mlflow_run_id"])
    assert run.info.status == "FINISHED"
    steps = sorted(m.step for m in mlflow_server.client().get_metric_history(run.info.run_id, "loss"))
    assert steps == list(range(1, 9))
    assert summary["tracking"]["steps_logged_late"] >= 1 and "tracking_errors" not in summary["tracking"]
    # The tracker being away cost no step its wait (MLflow's HTTP timeout is 10 s).
    assert max(line["step_seconds"] for line in metrics_lines(tmp_path / "tiny-cpu-sft")) < 10
    assert (tmp_path / "tiny-cpu-sft" / ".injected-failure").exists()  # the worker did die
    assert summary["steps"] == 8
    assert summary["final_loss"] == pytest.approx(submitted["summary"]["final_loss"], abs=1e-5)
    assert summary["first_loss"] == pytest.approx(submitted["summary"]["first_loss"], abs=1e-6)
    assert summary["eval_loss"] == pytest.approx(submitted["summary"]["eval_loss"], abs=1e-5)
    # Steps 5 and 6 ran twice (before the failure, and again from the step-4 checkpoint): one line each.
    lines = metrics_lines(tmp_path / "tiny-cpu-sft")
    assert [line["step"] for line in lines] == list(range(1, 9))
    assert [(line["step"], line.get("resume_cause"), line.get("resumed_from_step")) for line in lines if "resume_cause" in line] == [
        (5, "failure", 4)]


@pytest.fixture(scope="module")
def lora_dpo_run(submitted, tmp_path_factory):
    """``--objective dpo --peft lora --merge-lora`` through the entrypoint, worker 1 killed after step 6: its
    summary and folder."""
    import contextlib
    import io

    from training.train import main

    folder = tmp_path_factory.mktemp("lora-dpo")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main([*STEPS, "--preset", "tiny-cpu-dpo", "--storage-path", str(folder), "--inject-failure-at-step", "6",
                     "--peft", "lora", "--lora-rank", "2", "--lora-alpha", "4", "--learning-rate", "2e-2", "--merge-lora"]) == 0
    return {"summary": json.loads(out.getvalue().strip().splitlines()[-1]), "folder": folder / "tiny-cpu-dpo"}


def test_a_lora_dpo_run_raises_the_margin_recovers_from_a_worker_failure_and_exports_an_adapter_and_a_merged_model(
        lora_dpo_run):
    """``--objective dpo --peft lora --merge-lora`` through the entrypoint, on the tiny task's preference
    pairs (the words reversed over a refusal or over the words left in order): the reference is the
    base with the adapters off, so the first step's loss is log 2 and its margin 0; the margin then
    rises, on the held-out pairs too. Worker 1 dies after step 6 and the run resumes from the step-4
    checkpoint, which holds the adapters and their optimizer state only; step 6 trained again gives
    the loss it gave before the failure (so the final loss is the uninterrupted run's). ``final/`` is a
    PEFT adapter and ``final-merged/`` a plain model, which give the same logits and generate. (The
    resume is bit-identical at the step level: tests/training/test_lora.py.)"""
    import math
    import re

    from torch.distributed.checkpoint import FileSystemReader

    summary, folder = lora_dpo_run["summary"], lora_dpo_run["folder"]
    died = (folder / ".injected-failure").read_text()
    assert summary["steps"] == 8
    lines = metrics_lines(folder)
    assert [line["step"] for line in lines] == list(range(1, 9))
    assert [(line["step"], line.get("resume_cause"), line.get("resumed_from_step")) for line in lines if "resume_cause" in line] == [
        (5, "failure", 4)]
    assert float(re.search(r"after step 6 \(loss (.+)\)", died).group(1)) == lines[5]["loss"]
    assert lines[0]["loss"] == pytest.approx(math.log(2), abs=1e-6) and lines[0]["rewards/margins"] == 0
    assert min(line["rewards/margins"] for line in lines[3:]) > 0.2 and lines[-1]["eval_rewards/margins"] > 0.2
    assert summary["final_loss"] < summary["first_loss"] - 0.1
    stored = FileSystemReader(summary["checkpoint"]).read_metadata().state_dict_metadata
    assert [key for key in stored if key.startswith("model.") and ".lora_" not in key] == []
    assert len([key for key in stored if key.startswith("model.") and ".lora_" in key]) == 2 * 7 * 2  # every layer's A and B

    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    final, merged = Path(summary["final_model"]), Path(summary["merged_model"])
    assert merged == folder / "final-merged"
    base = json.loads((final / "adapter_config.json").read_text())["base_model_name_or_path"]
    adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), str(final)).eval()
    plain = AutoModelForCausalLM.from_pretrained(str(merged)).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(merged))
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Reverse the words: apple pear"}],
                                           add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        assert torch.allclose(adapter(**prompt).logits, plain(**prompt).logits, atol=1e-4)
    output = plain.generate(**prompt, max_new_tokens=6, do_sample=False)
    assert output.shape[1] == prompt["input_ids"].shape[1] + 6


#: A generation task as ifeval's (no stop string, a long answer): how an adapter and its merged model stop
#: is all that can tell them apart.
UNSTOPPED_TASK = """task: reverse_unstopped
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: []
  max_gen_toks: 24
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
  - metric: chrf
    aggregation: chrf
    higher_is_better: true
metadata:
  version: 1.0
"""


def test_an_adapter_and_its_merged_model_score_the_same_on_the_benchmark(lora_dpo_run, tmp_path):
    """The same weights as a LoRA adapter (merged onto its base in the benchmark's task) and merged at export (``final-merged/``),
    scored by the harness as the benchmark's Ray task scores them (training/evaluation/harness.py
    ``model_arguments``), on a task with no stop string: the adapter stops where the merged model does (the
    exported generation config, not the base's), so every number is the same."""
    import random

    from training.config import parse_config
    from training.evaluation.harness import harness, model_arguments
    from training.storage.tiny import WORDS

    rng = random.Random(11)
    with open(tmp_path / "reverse.jsonl", "w") as out:
        for _ in range(12):
            words = [rng.choice(WORDS) for _ in range(3)]
            out.write(json.dumps({"question": "Reverse the words: " + " ".join(words), "answer": " ".join(reversed(words))}) + "\n")
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "reverse_unstopped.yaml").write_text(UNSTOPPED_TASK.format(data=tmp_path / "reverse.jsonl"))
    config = parse_config([*STEPS, "--preset", "tiny-cpu-dpo", "--storage-path", str(tmp_path), "--peft", "lora",
                           "--eval-tasks", "reverse_unstopped", "--eval-tasks-path", str(tmp_path / "tasks")])
    summary, scores = lora_dpo_run["summary"], {}
    for kind, exported in (("adapter", summary["final_model"]), ("merged", summary["merged_model"])):
        tuned, _ = model_arguments(config, exported, str(tmp_path / kind))
        scores[kind] = harness(config, tuned, str(tmp_path / "tasks"), ["reverse_unstopped"])["results"]["reverse_unstopped"]
    print(f"adapter {scores['adapter']}; merged {scores['merged']}")
    assert model_arguments(config, summary["final_model"], str(tmp_path / "again"))[0] == {"pretrained": str(tmp_path / "again" / "merged")}
    assert scores["adapter"]["chrf,none"] == pytest.approx(scores["merged"]["chrf,none"], abs=1e-6)
    assert scores["adapter"]["exact_match,none"] == scores["merged"]["exact_match,none"]


def test_second_run_resumes_at_the_right_step(submitted, mlflow_server, tmp_path, capsys, monkeypatch):
    """``ray-train-eks submit --resume`` after ``stop``: the RayJob it builds runs the training
    entrypoint here, which resumes at the first run's last step. The CLI talks to a stand-in API
    server (tests/fake_apiserver.py) with the stack's settings and to moto's S3. The first run went
    through ``ray job submit`` (``submitted``), so ray-train-eks takes it up with ``--resume`` and its
    options (``submit --name`` of a run that exists is refused), then stops it and resumes it again."""
    import shlex

    import yaml
    from fake_apiserver import FakeApiServer

    from ray_train_eks.charts import spec_settings
    from ray_train_eks.workload.code import CODE_DIGEST_ANNOTATION, SETTINGS_CONFIGMAP, TRAINING_CODE_CONFIGMAP, files_digest
    from ray_train_eks.cli import installed_training_code, main as cli
    from ray_train_eks.config import PlatformConfig

    api = FakeApiServer()
    spec = PlatformConfig.from_context({}, environ={}).workload_spec()
    api.put({"kind": "ConfigMap", "apiVersion": "v1", "metadata": {"name": SETTINGS_CONFIGMAP, "namespace": spec.namespace},
             "data": {"bucket": S3_BUCKET, "workload": spec_settings(spec)}})
    api.put({"kind": "ConfigMap", "apiVersion": "v1", "metadata": {
        "name": TRAINING_CODE_CONFIGMAP, "namespace": spec.namespace,
        "annotations": {CODE_DIGEST_ANNOTATION: files_digest(installed_training_code())}}})
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({"current-context": "c", "clusters": [{"name": "c", "cluster": {"server": api.url}}],
                                          "users": [{"name": "u", "user": {"token": "admin-token"}}],
                                          "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}]}))
    on_cpu = ["--num-workers", "2", "--workers-per-node", "2", "--no-use-gpu", "--no-expect-efa"]  # the platform's are GPU's
    try:
        k = ["--kubeconfig", str(kubeconfig)]
        assert cli(["submit", *k, "--name", "tiny-cpu-sft", "--", *STEPS, *on_cpu]) == 1  # it exists: --resume
        assert cli(["submit", *k, "--resume", "tiny-cpu-sft", "--", *STEPS, *on_cpu, "--storage-path", str(submitted["storage"])]) == 0
        assert cli(["stop", *k, "tiny-cpu-sft"]) == 0
        assert cli(["submit", *k, "--resume", "tiny-cpu-sft", "--", "--max-steps", "12"]) == 0
        (job,) = [obj for key, obj in api.objects.items() if key[0] == "rayjobs"]
    finally:
        api.close()
    capsys.readouterr()
    command = shlex.split(job["spec"]["entrypoint"])
    assert command[:3] == ["python", "-m", "training.train"]
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server.url)  # as the stack sets it in the Ray pods
    summary = train(capsys, *command[3:])
    assert summary["resumed_from_step"] == 8
    assert summary["steps"] == 12
    lines = metrics_lines(f"{submitted['storage']}/tiny-cpu-sft")
    assert [line["step"] for line in lines] == list(range(1, 13))
    assert [(line["step"], line["resume_cause"]) for line in lines if "resume_cause" in line] == [(9, "new run")]
    # The same MLflow run goes on: steps 9 to 12 after 1 to 8, none twice, FINISHED again.
    assert summary["tracking"]["mlflow_run_id"] == submitted["summary"]["tracking"]["mlflow_run_id"]
    client = mlflow_server.client()
    steps = sorted(m.step for m in client.get_metric_history(summary["tracking"]["mlflow_run_id"], "loss"))
    assert steps == list(range(1, 13))
    assert client.get_run(summary["tracking"]["mlflow_run_id"]).info.status == "FINISHED"
    assert client.get_run(summary["tracking"]["mlflow_run_id"]).data.tags["resumed_with.max_steps"] == "12"


def _reports_loop(config: dict) -> None:
    import ray.train

    from training.reporting import report_metrics

    folder = os.path.join(config["scratch"], "checkpoint")
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "weights.bin"), "wb") as handle:
        handle.write(os.urandom(CHECKPOINT_MB * 2**20))
    worker = SimpleNamespace(checkpoints=SimpleNamespace(asynchronous=True))
    started = time.perf_counter()
    ray.train.report({"step": 1}, checkpoint=ray.train.Checkpoint.from_directory(folder),
                     checkpoint_upload_mode=ray.train.CheckpointUploadMode.ASYNC, delete_local_checkpoint_after_upload=True)
    reports = []
    for step in (2, 3, 4):  # the next steps' metrics, while the upload runs
        before = time.perf_counter()
        report_metrics(worker, {"step": step})
        reports.append(time.perf_counter() - before)
    ray.train.report({"step": 5})  # synchronous: waits for the upload and every report before it
    with open(config["out"], "w") as handle:
        json.dump({"reports_s": reports, "upload_s": time.perf_counter() - started}, handle)


def test_metric_reports_after_an_asynchronous_checkpoint_do_not_wait_for_its_upload(ray_head, tmp_path):
    """Checkpoints off the critical path: a 64 MB checkpoint reported with an asynchronous upload to
    the S3 server, then three steps' metrics (``training.reporting.report_metrics``) while it uploads."""
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the workers cannot import a test module
    try:
        TorchTrainer(_reports_loop, train_loop_config={"scratch": str(tmp_path / "scratch"), "out": str(tmp_path / "t.json")},
                     torch_config=TorchConfig(backend="gloo"), scaling_config=ScalingConfig(num_workers=1),
                     run_config=RunConfig(name="reports", storage_path=f"s3://{S3_BUCKET}/reports")).fit()
    finally:
        ray.shutdown()
    timings = json.loads((tmp_path / "t.json").read_text())
    print(f"upload and reports: {timings['upload_s']:.2f} s; the loop waited {max(timings['reports_s']) * 1000:.0f} ms "
          "at most per metric report")
    assert timings["upload_s"] > 1.0  # an upload that takes a while, as a real one does
    assert max(timings["reports_s"]) < 0.2 * timings["upload_s"]


_RAY_DRIVER = r"""
import sys, time
import ray


@ray.remote(num_cpus=1, max_restarts=0)
class GpuWorker:
    # A Ray worker process, as a Ray Train worker is one: it starts the follower the GPU workers
    # start, logs as NCCL does, and dies as torch's NCCL watchdog kills it.

    def run(self, pattern):
        import os, time
        from training.resilience.nccl_log import NcclStyleLog, start_follower

        start_follower(pattern)
        log = NcclStyleLog(pattern)
        log.write("host:1:1 [0] NCCL WARN NET/OFI Request completed with error")
        time.sleep(1)
        log.write("host:1:1 [0] NCCL WARN last words before the watchdog")
        os.abort()


# The module's Ray head (RAY_ADDRESS), with the training package shipped as the RayJob ships it.
ray.init(log_to_driver=True, runtime_env={"py_modules": [sys.argv[2]]})
try:
    ray.get(GpuWorker.remote().run.remote(sys.argv[1]))
    print("driver: the worker did not die")
except Exception as error:
    print("driver: the worker died:", type(error).__name__, flush=True)
time.sleep(1.0)  # as training/train.py's stop_ray on a failure: the workers' last lines first
ray.shutdown()
"""


def test_a_worker_that_dies_after_nccl_warnings_has_them_in_the_job_log(ray_head, tmp_path):
    """A Ray worker process logs NCCL warnings to its NCCL file as NCCL does, with the follower
    the GPU workers start (training/resilience/nccl_log.py), then dies by SIGABRT as torch's NCCL watchdog
    kills it; the driver's output (the job log) carries both warnings, the last one written
    just before the death. (A Ray Train worker is such a process; the path of its output to the
    driver, through its .out file and Ray's log monitor, is the same.)"""
    pattern = str(tmp_path / "nccl.%h.%p.log")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_TRAIN_ENABLE_PRINT_PATCH": "0", "RAY_ADDRESS": ray_head["address"]}
    done = subprocess.run([sys.executable, "-c", _RAY_DRIVER, pattern, str(ROOT / "training")], capture_output=True,
                          text=True, env=env, cwd=tmp_path, timeout=300)
    log = done.stdout + done.stderr
    assert "driver: the worker died: ActorDiedError" in log, log[-3000:]
    assert "[nccl] host:1:1 [0] NCCL WARN NET/OFI Request completed with error" in done.stdout, log[-3000:]
    assert "[nccl] host:1:1 [0] NCCL WARN last words before the watchdog" in done.stdout, log[-3000:]
