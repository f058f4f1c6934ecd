"""The checks of a training configuration that are not its fields: model, data set and storage
references, LoRA's and the preference options, and the learning rate each kind of run defaults to.
``training.config`` exports every name here (its public import path)."""

from __future__ import annotations

import math
import os
import re

from .presets import TINY_DATASET, TINY_MODEL, TINY_PREFERENCE_DATASET

_S3_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_DATA_SUFFIXES = (".jsonl", ".json", ".parquet")


#: The peak learning rate of a full fine-tune when none is given.
FULL_LEARNING_RATE = 2e-5
#: LoRA's peak learning rate when none is given (a LoRA preset's or ``--learning-rate``): torchtune's
#: Qwen2.5 LoRA recipes (pytorch/torchtune recipes/configs/qwen2_5/7B_lora.yaml and 32B_lora.yaml, ``lr: 3e-4``,
#: rank 8, alpha 16); SageMaker HyperPod's LoRA recipes use 1e-4 to 4e-4.
LORA_LEARNING_RATE = 3e-4
LORA_LEARNING_RATE_SOURCE = "torchtune's Qwen2.5 LoRA recipes, recipes/configs/qwen2_5/7B_lora.yaml"
#: Preference tuning's peak rates when none is given, by ``peft``: TRL 1.16's ``trl/scripts/dpo.py``,
#: whose example commands train at 5e-7 in full and at 5e-6 with LoRA (``--use_peft``); DPO moves the
#: policy a little from the reference, at a rate one to two orders below supervised fine-tuning's.
DPO_LEARNING_RATES = {"none": 5e-7, "lora": 5e-6}
DPO_LEARNING_RATE_SOURCE = "TRL's scripts/dpo.py example commands"
#: The adapter scale (alpha / rank) TRL's LoRA rate goes with: its command's ``--lora_r 32 --lora_alpha 16``.
#: An adapter's update is about the rate times its scale (the product BA is multiplied by alpha / rank), so
#: LoRA DPO's default rate is TRL's times 0.5 over the run's scale: 1.25e-6 at our rank 8, alpha 16 (scale 2).
TRL_DPO_LORA_SCALE = 16 / 32


def default_learning_rate(peft: str, objective: str = "sft", lora_scale: float | None = None) -> float:
    """The peak rate a run of this kind takes when none is given (``lora_scale``: the run's alpha / rank,
    which LoRA DPO's rate is scaled to: :data:`TRL_DPO_LORA_SCALE`)."""
    if objective == "dpo":
        rate = DPO_LEARNING_RATES.get(peft, DPO_LEARNING_RATES["none"])
        return rate * TRL_DPO_LORA_SCALE / lora_scale if peft == "lora" and lora_scale else rate
    return LORA_LEARNING_RATE if peft == "lora" else FULL_LEARNING_RATE


def learning_rate_notes(config: "TrainConfig") -> list[str]:
    """The driver's lines about a LoRA run's learning rate: its default and source, or a warning
    when it is far (under a tenth) below the default of its kind (LoRA, or LoRA DPO)."""
    if config.peft != "lora":
        return []
    objective = getattr(config, "objective", "sft")
    scale = config.lora_alpha / config.lora_rank
    default = default_learning_rate("lora", objective, scale)
    kind, source = ("LoRA DPO's", DPO_LEARNING_RATE_SOURCE) if objective == "dpo" else ("LoRA's", LORA_LEARNING_RATE_SOURCE)
    if objective == "dpo":
        source += (f": {_rate(DPO_LEARNING_RATES['lora'])} at its adapter scale {TRL_DPO_LORA_SCALE:g} (rank 32, alpha 16), "
                   f"scaled to this run's {scale:g} (alpha {config.lora_alpha:g} / rank {config.lora_rank})")
    if math.isclose(config.learning_rate, default):
        return [f"[train] learning rate {_rate(default)}: {kind} default ({source})"]
    if config.learning_rate < default / 10:
        return [f"[train] warning: learning_rate={config.learning_rate:g} is under a tenth of {kind} default "
                f"{_rate(default)} ({source}): a full fine-tune's rate trains adapters slowly; "
                "drop --learning-rate for the default"]
    return []



def _rate(value: float) -> str:
    """A learning rate as people write one: 3e-04, 1.25e-06."""
    mantissa, exponent = f"{value:.2e}".split("e")
    return f"{mantissa.rstrip('0').rstrip('.')}e{exponent}"


def _s3_problem(option: str, uri: str, *, key_needed: bool) -> str | None:
    bucket, _, key = uri[len("s3://"):].partition("/")
    if not _S3_BUCKET.match(bucket):
        return (f"{option}={uri!r} names no valid S3 bucket (3-63 lower-case letters, digits, '.', '-'); "
                f"use s3://<bucket>/{'<key>' if key_needed else 'runs'}")
    if key_needed and not key.strip("/"):
        return f"{option}={uri!r} names a bucket but no object; use s3://{bucket}/<path>"
    return None


def _source_problem(option: str, value: str, *, builtin: str | tuple[str, ...], local_kind: str) -> str | None:
    """What is wrong with a model or data set reference, checked on the driver in
    milliseconds (a worker would find out after Ray started, once per retry)."""
    flag = "--" + option
    if value.startswith("tiny:"):
        builtins = (builtin,) if isinstance(builtin, str) else builtin
        if value in builtins:
            return None
        if len(builtins) == 1:
            return f"{option}={value!r}: the only built-in {option} is {builtin}"
        return f"{option}={value!r}: the built-in {option}s are {' and '.join(builtins)}"
    if value.startswith("s3://"):
        return _s3_problem(option, value, key_needed=True)
    path = os.path.expanduser(value)
    if os.path.exists(path):
        if local_kind == "directory" and not os.path.isfile(os.path.join(path, "config.json")):
            return f"{option}={value!r} is a local path without config.json; give a folder saved with save_pretrained"
        if local_kind == "file" and not os.path.isfile(path):
            return f"{option}={value!r} is a folder; give a .jsonl, .json or .parquet file"
        return None
    if value.startswith(("/", "./", "../", "~")) or value.endswith(_DATA_SUFFIXES):
        return f"{option}={value!r}: no such {local_kind} on this machine; fix the path, or give a Hub id or an s3:// URI with {flag}"
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(value)
    except HFValidationError:
        return (f"{option}={value!r} is neither a local path nor a valid Hugging Face Hub id ('namespace/name', letters, "
                f"digits, '-', '_', '.'); fix {flag}")
    return None


def source_problems(config: "TrainConfig") -> list[str]:
    """Model, data set and storage references that cannot work, before Ray starts."""
    found = [
        _source_problem("model", config.model, builtin=TINY_MODEL, local_kind="directory"),
        _source_problem("dataset", config.dataset, builtin=(TINY_DATASET, TINY_PREFERENCE_DATASET), local_kind="file"),
    ]
    if config.storage_path.startswith("s3://"):
        found.append(_s3_problem("storage_path", config.storage_path, key_needed=False))
    return [problem for problem in found if problem]


#: What ``--peft lora`` imports beyond the Ray Train image, pinned as requirements-dev.txt pins them:
#: the RayJob's runtime env installs them for a LoRA job (ray_train_eks/workload/objects.py).
LORA_PACKAGES = ("peft==0.21.2", "accelerate==1.16.0")
#: What tracking imports beyond the Ray Train image (training/telemetry/tracking.py): MLflow's light client and
#: the plugin for SageMaker's managed MLflow, pinned as requirements-dev.txt pins them.
TRACKING_PACKAGES = ("mlflow-skinny==3.17.2", "sagemaker-mlflow==0.5.0")
#: PEFT's shorthand for every linear layer of the decoder but the output head
#: (``peft/tuners/tuners_utils.py`` ``_maybe_include_all_linear_layers``).
ALL_LINEAR = "all-linear"


#: The output head's module name (every family here): never a LoRA target (see :func:`lora_problems`).
OUTPUT_HEAD = "lm_head"


def lora_target_list(targets: str) -> list[str] | str:
    """``--lora-target-modules`` as PEFT's ``target_modules``: the shorthand, or the names."""
    if targets.strip() == ALL_LINEAR:
        return ALL_LINEAR
    return [name.strip() for name in targets.split(",") if name.strip()]


def lora_problems(config: "TrainConfig") -> list[str]:
    """What is wrong with the LoRA options (before Ray starts; whether the named modules exist is
    checked by the memory plan for a model it knows, else when the model is built)."""
    p: list[str] = []
    if config.peft not in ("none", "lora"):
        return [f"peft={config.peft!r}; use none (full fine-tune) or lora"]
    if config.peft != "lora":
        if config.merge_lora:
            p.append("merge_lora is set but peft is 'none': a full fine-tune's final model is already whole; "
                     "drop --merge-lora or add --peft lora")
        return p
    if config.lora_rank < 1:
        p.append(f"lora_rank={config.lora_rank} must be at least 1 (8 to 64 is usual; 8 is the default)")
    if config.lora_alpha <= 0:
        p.append(f"lora_alpha={config.lora_alpha} must be positive (twice the rank is usual: 16 for rank 8)")
    if not 0 <= config.lora_dropout < 1:
        p.append(f"lora_dropout={config.lora_dropout} must be in [0, 1) (0 is the default)")
    targets = lora_target_list(config.lora_target_modules)
    if targets != ALL_LINEAR and OUTPUT_HEAD in targets:
        p.append(f"lora_target_modules={config.lora_target_modules!r}: the output head ({OUTPUT_HEAD}) cannot take an adapter: "
                 "the chunked loss multiplies by the head's weight itself (training/modeling/model.py), so an adapter there "
                 f"would never train; drop {OUTPUT_HEAD} from --lora-target-modules")
    if config.merge_lora_dtype not in (None, "bf16", "fp32"):
        p.append(f"merge_lora_dtype={config.merge_lora_dtype!r}; use bf16 or fp32 (or none: the run's compute dtype)")
    if targets != ALL_LINEAR and (not targets or not all(name.isidentifier() for name in targets)):
        p.append(f"lora_target_modules={config.lora_target_modules!r}: give {ALL_LINEAR} or comma-separated module "
                 "names such as q_proj,k_proj,v_proj,o_proj")
    return p


def objective_problems(config: "TrainConfig") -> list[str]:
    """``--objective`` and the preference options."""
    from .modeling.preference import LOSSES

    if config.objective not in ("sft", "dpo"):
        return [f"objective={config.objective!r}; use sft (supervised fine-tuning) or dpo (preference pairs)"]
    if config.objective != "dpo":
        given = [name for name, default in (("dpo_loss", "sigmoid"), ("dpo_beta", None), ("simpo_gamma", None))
                 if getattr(config, name) != default]
        return [f"{', '.join(given)} set but objective is 'sft': add --objective dpo, or drop them"] if given else []
    p = []
    if config.dpo_loss not in LOSSES:
        p.append(f"dpo_loss={config.dpo_loss!r}; use one of {', '.join(LOSSES)}")
    if config.dpo_beta is not None and not config.dpo_beta > 0:
        p.append(f"dpo_beta={config.dpo_beta} must be positive (0.1 is TRL's DPO default; SimPO uses 2.0 to 2.5)")
    if config.simpo_gamma is not None and not config.simpo_gamma >= 0:
        p.append(f"simpo_gamma={config.simpo_gamma} must be 0 or more (none: half of beta, SimPO's recipe)")
    return p
