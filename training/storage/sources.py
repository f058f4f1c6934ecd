"""Where models and data sets come from: a Hub id, a local path, an ``s3://`` URI, or a
``tiny:`` sentinel built on the spot. Remote and built things are fetched once per node
into a local cache (a file lock keeps the node's workers from doing it twice).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from filelock import FileLock

from ..config import TINY_DATASET, TINY_MODEL, TINY_PREFERENCE_DATASET
from .files import download, version

CACHE = Path(os.environ.get("RAY_TRAIN_EKS_CACHE", Path.home() / ".cache" / "ray-train-eks"))


def _cache_dir(kind: str, uri: str) -> Path:
    target = CACHE / kind / hashlib.sha256(uri.encode()).hexdigest()[:16]
    target.parent.mkdir(parents=True, exist_ok=True)
    return target


def resolve_model(uri: str) -> str:
    """A local directory or a Hub id that ``from_pretrained`` can load."""
    if uri == TINY_MODEL:
        from .tiny import BUILD, materialize_model

        target = _cache_dir("model", f"{uri}:{BUILD}")
        with FileLock(str(target) + ".lock"):
            return str(materialize_model(target))
    if uri.startswith("s3://"):
        target = _cache_dir("model", uri)
        with FileLock(str(target) + ".lock"):
            if not (target / "config.json").exists():
                download(uri, target)
        return str(target)
    if uri.startswith("tiny:"):
        raise ValueError(f"model={uri!r}: the only built-in model is {TINY_MODEL}")
    return uri  # a local directory or a Hub id


def resolve_dataset(uri: str, *, seed: int = 0) -> str:
    """A local JSONL path, or a Hub id."""
    if uri in (TINY_DATASET, TINY_PREFERENCE_DATASET):
        from .tiny import BUILD, write_dataset

        target = _cache_dir("data", f"{uri}:{seed}:{BUILD}") / "train.jsonl"
        with FileLock(str(target) + ".lock"):
            if not target.exists():
                write_dataset(target, seed=seed, pairs=uri == TINY_PREFERENCE_DATASET)
        return str(target)
    if uri.startswith("s3://"):
        target = _cache_dir("data", uri)
        with FileLock(str(target) + ".lock"):
            local, seen = target / Path(uri).name, target / ".version"
            # Re-uploaded to the same key (a standing RayCluster's nodes keep their cache): the
            # object's ETag says so, and the copy is replaced.
            current = version(uri)
            if not local.exists() or not seen.exists() or seen.read_text() != current:
                local.unlink(missing_ok=True)
                download(uri, target)
                seen.write_text(current)
        return str(local)
    if uri.startswith("tiny:"):
        raise ValueError(f"dataset={uri!r}: the built-in data sets are {TINY_DATASET} and {TINY_PREFERENCE_DATASET}")
    return uri


#: The files a tokenizer loads from (transformers' AutoTokenizer: its config, vocabulary,
#: merges, special tokens, chat template), and the model's config.json it reads the class from.
TOKENIZER_FILES = frozenset({"tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "special_tokens_map.json",
                             "added_tokens.json", "tokenizer.model", "chat_template.jinja", "chat_template.json",
                             "config.json"})


def resolve_tokenizer(uri: str) -> str:
    """What ``AutoTokenizer.from_pretrained`` loads the model's tokenizer from: for ``s3://``
    its files alone (the driver needs no weights), else as :func:`resolve_model`."""
    if uri.startswith("s3://"):
        target = _cache_dir("tokenizer", uri)
        with FileLock(str(target) + ".lock"):
            if not (target / "tokenizer_config.json").exists():
                download(uri, target, names=TOKENIZER_FILES)
        return str(target)
    return resolve_model(uri)

def read_model_config(model_dir_or_id: str, revision: str | None = None) -> dict:
    """The model's ``config.json`` as a dict: read from the folder, or fetched alone from
    the Hub at ``revision`` (no weights; cheaper than importing transformers on the driver)."""
    local = os.path.join(model_dir_or_id, "config.json")
    if not os.path.exists(local):
        from huggingface_hub import hf_hub_download

        local = hf_hub_download(model_dir_or_id, "config.json", revision=revision)
    with open(local) as handle:
        return json.load(handle)


def is_hub_model(uri: str) -> bool:
    """Whether ``--model`` names a Hub model (not built, not in S3, not a local folder)."""
    return not uri.startswith(("tiny:", "s3://")) and not os.path.exists(os.path.expanduser(uri))


def hub_commit(model: str, revision: str | None) -> str:
    """The commit a Hub model's ``revision`` (a branch, tag or commit; None: main) is at now."""
    if revision is not None and len(revision) == 40 and all(c in "0123456789abcdef" for c in revision):
        return revision  # a commit already: no call
    from huggingface_hub import HfApi, constants, snapshot_download

    if constants.HF_HUB_OFFLINE:  # HF_HUB_OFFLINE=1: the commit of the copy in the local cache
        return Path(snapshot_download(model, revision=revision, local_files_only=True, allow_patterns=["config.json"])).name
    return HfApi().model_info(model, revision=revision).sha


def pinned_revision(model: str, revision: str | None, recorded: dict) -> str | None:
    """The commit a run loads a Hub model at: ``revision`` resolved; else the one the run recorded
    at its first start (``recorded``: its run.json, for a resume) when it names the same model;
    else the main branch's now. None for a model that is not on the Hub."""
    if not is_hub_model(model):
        return None
    if revision is None and recorded.get("model") == model:
        revision = recorded.get("model_revision")
    return hub_commit(model, revision)
