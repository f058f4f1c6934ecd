"""What the benchmark scores the tuned model and the base under, so that their difference measures the
training and nothing else: the same tokenizer, chat template and stop rules, the exported ones
(:func:`scoring_base`); and how its work is laid out on a node's GPUs (:func:`placement`).

lm-evaluation-harness 0.4.13's ``hf`` model (``lm_eval/models/huggingface.py``) takes its tokenizer from
``pretrained`` unless given one, and ``generate`` stops rows where the model's generation config says
(``generation_config.json`` of ``pretrained``); its own stop strings add the tokenizer's EOS, and a batch
stops only when every row has (``lm_eval/models/utils_hf.py`` ``MultiTokenEOSCriteria``); answers are
decoded without special tokens. A LoRA adapter (``peft=``) loads on ``pretrained``: with the base's
folder it gets the base's tokenizer and generation config (Qwen2.5 base: ``<|endoftext|>``, not the
chat template's ``<|im_end|>``), so a row that ended its turn keeps generating turns into its answer,
and the same weights score otherwise as an adapter and merged. So both the tuned model and the base are
scored on a folder of the base's weights with the exported model's tokenizer files and generation
config (``final/`` holds both, training/modeling/export.py and lora.py)."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

from ..storage.sources import TOKENIZER_FILES

#: The exported model's files that set how text is tokenized, templated and where generation stops.
SCORING_FILES = frozenset(TOKENIZER_FILES - {"config.json"} | {"generation_config.json"})
#: A model whose bf16 weights take under this share of one GPU is evaluated on one GPU (the rest: the
#: KV cache and activations of a batch of generations: Qwen2.5-7B's 15.2 GB on an L4's 24 GB leaves 8.9 GB,
#: against 1.8 GB of KV cache for 16 rows of 2,048 tokens).
ONE_GPU_SHARE = 0.75
#: The longest padded row a log-likelihood batch is budgeted for (mmlu's few-shot prompts; professional_law's
#: reach this): lm-eval 0.4.13 ``_loglikelihood_tokens`` (``lm_eval/models/huggingface.py``) builds the batch's
#: logits, ``[batch, padded length, vocab]`` in the model's dtype, and their ``log_softmax`` beside them.
LOGLIKELIHOOD_TOKENS = 1024


def scoring_base(base_dir: str, exported_dir: str, local: str) -> str:
    """A folder of the base's weights and config (linked, not copied) with ``exported_dir``'s tokenizer
    and generation config (:data:`SCORING_FILES`): what the base, and an adapter on it, are scored as."""
    folder = Path(local)
    folder.mkdir(parents=True, exist_ok=True)
    for entry in Path(base_dir).iterdir():
        if entry.name not in SCORING_FILES:
            (folder / entry.name).symlink_to(entry.resolve())
    for name in SCORING_FILES:
        if (Path(exported_dir) / name).is_file():
            shutil.copyfile(Path(exported_dir) / name, folder / name)
    return str(folder)


def local_base(base: str, revision: str | None) -> str:
    """The base's local folder: as resolved (a built or downloaded model), or a Hub model's snapshot at
    ``revision`` (the commit the run trained on)."""
    if os.path.isdir(base):
        return base
    from huggingface_hub import snapshot_download

    return snapshot_download(base, revision=revision)


def scoring_digest(exported_dir: str) -> str:
    """sha256 (16 hex digits) of the files the scores are computed under (:data:`SCORING_FILES`): what a
    base's kept scores must match to be reused."""
    digest = hashlib.sha256()
    for name in sorted(SCORING_FILES):
        path = Path(exported_dir) / name
        if path.is_file():
            digest.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def placement(config, parameters: int | None, vocab: int | None = None, *, batch_size: int = 16) -> tuple[int, bool]:
    """GPUs per benchmark task and whether the model is spread across them (the harness's
    ``parallelize``: accelerate's ``device_map="auto"``, a pipeline with one GPU busy at a time): one GPU
    where the bf16 weights and a log-likelihood batch's logits (:func:`loglikelihood_bytes`) fit
    :data:`ONE_GPU_SHARE` of the GPU (the tasks then run side by side, one a GPU), else a node's GPUs for
    one spread model. No GPU on CPU; a node where the GPU or the model's size or vocabulary is unknown.
    ``batch_size``: the harness's (harness.py ``BATCH_SIZE``)."""
    if not config.use_gpu:
        return 0, False
    from ..modeling.moments import GPU_MEMORY_MIB

    memory = GPU_MEMORY_MIB.get(config.gpu_type or "")
    if (parameters is not None and vocab is not None and memory is not None
            and parameters * 2 + loglikelihood_bytes(vocab, batch_size) <= ONE_GPU_SHARE * memory * 2**20):
        return 1, False
    return config.workers_per_node, config.workers_per_node > 1


def loglikelihood_bytes(vocab: int, batch_size: int) -> int:
    """A log-likelihood batch's logits and their log-softmax in bf16: ``batch_size`` rows of
    :data:`LOGLIKELIHOOD_TOKENS` tokens over the vocabulary, twice (16 rows over Qwen2.5's 151,936: 10 GB)."""
    return batch_size * LOGLIKELIHOOD_TOKENS * vocab * 2 * 2


def task_groups(names: list[str], gpus: int, workers_per_node: int) -> list[list[str]]:
    """The tasks split into groups, one Ray task each: as many as a node's GPUs where each takes one
    (names dealt out in turn), else one group (one model spread over the node)."""
    count = min(len(names), workers_per_node) if gpus == 1 else 1
    return [names[i::count] for i in range(count)]


#: The harness's per-task entries of its results (``lm_eval/evaluator.py`` ``simple_evaluate``).
PER_TASK = ("results", "groups", "group_subtasks", "configs", "versions", "n-shot", "higher_is_better", "n-samples")


def merged_results(parts: list[dict]) -> dict:
    """The results of tasks run apart, as one run of them all gives them (the per-task entries merged,
    the rest the first's)."""
    merged = dict(parts[0]) if parts else {}
    for key in PER_TASK:
        merged[key] = {name: value for part in parts for name, value in (part.get(key) or {}).items()}
    return merged
