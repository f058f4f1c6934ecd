"""Which weights ship: the best evaluation so far and early stopping (:class:`Best`, carried by
every checkpoint so a resume keeps both), Ray Train's checkpoint scoring that keeps the best
checkpoints beside the latest (:func:`checkpoint_config`), and the choice of what ``final/``
holds at the end (:func:`choose_export`, :func:`load_model_weights`).

Ray Train 2.58 keeps checkpoints by a score (``CheckpointConfig.checkpoint_score_attribute``;
``ray/train/_internal/checkpoint_manager.py``): the ``num_to_keep`` best by it, and always the
latest registered one (``_save_state_and_delete_old_checkpoints`` never deletes it), which is
the one a restart resumes from (``before_init_train_context`` hands every worker the latest).
So Ray's own manager does what a run needs: the best K by eval loss for the export, the latest
for the resume. Two things in it are handled here:

- a checkpoint whose metrics lack the score attribute scores ``-inf`` before the order's sign is
  applied (``_get_checkpoint_score``), which under ``min`` makes it the *best*: every checkpoint
  reports :data:`RANK_METRIC`, the eval loss of its weights or about :data:`UNRANKED` where the
  step was not evaluated (a checkpoint at ``--checkpoint-every`` or at a preemption notice);
- the manager's state file stores metrics as JSON through pydantic, which writes ``inf`` and
  ``nan`` as ``null``: a restarted controller would then fail to score them. :data:`UNRANKED` is
  finite, and a non-finite eval loss ranks as unranked."""

from __future__ import annotations

import math
from dataclasses import dataclass

#: The metric Ray Train ranks checkpoints by (lowest first).
RANK_METRIC = "eval_loss_ranked"
#: The rank of a checkpoint whose step was not evaluated, less a thousandth per step: after every evaluated one,
#: and among the unevaluated the later first. Ray breaks ties by report index, which restarts at 0 with each
#: worker group (v2 ``CheckpointManager._current_report_index``): after a restart a tie would keep the older.
UNRANKED = 1.0e9


def rank_of(eval_loss: float | None, step: int) -> float:
    """:data:`RANK_METRIC`'s value for the weights of ``step`` with ``eval_loss`` (None: not evaluated)."""
    return eval_loss if eval_loss is not None and math.isfinite(eval_loss) else UNRANKED - step / 1000


def ranks_by_eval(config) -> bool:
    """Whether checkpoints are kept and exported by eval loss: ``--export best`` with eval data."""
    from .options import has_eval_data

    return config.export == "best" and has_eval_data(config)


def checkpoint_config(config):
    """Ray Train's ``CheckpointConfig`` of the run: the ``--keep-checkpoints`` lowest by eval loss
    (and the latest) where the run exports its best, else the last ``--keep-checkpoints``."""
    from ray.train import CheckpointConfig

    if ranks_by_eval(config):
        return CheckpointConfig(num_to_keep=config.keep_checkpoints, checkpoint_score_attribute=RANK_METRIC,
                                checkpoint_score_order="min")
    return CheckpointConfig(num_to_keep=config.keep_checkpoints)


@dataclass
class Best:
    """The lowest eval loss so far, at which step, and the evaluations since (early stopping)."""

    step: int | None = None
    eval_loss: float | None = None
    since: int = 0

    def update(self, step: int, eval_loss: float | None) -> bool:
        """One evaluation: True when it is a new best (strictly lower; a non-finite loss never is)."""
        if eval_loss is None or not math.isfinite(eval_loss):
            self.since += 1
            return False
        if self.eval_loss is None or eval_loss < self.eval_loss:
            self.step, self.eval_loss, self.since = step, eval_loss, 0
            return True
        self.since += 1
        return False

    def stop_reason(self, patience: int) -> str | None:
        """Why the run stops early, or None: ``patience`` evaluations without a new best (0: never)."""
        if not patience or self.since < patience or self.step is None:
            return None
        return (f"early stopping: {self.since} evaluation(s) without a lower eval loss than {self.eval_loss:.4f} "
                f"at step {self.step} (--early-stopping-patience {patience})")

    def to_state(self) -> dict:
        """What a checkpoint carries (``train_state['best']``)."""
        return {"step": self.step, "eval_loss": self.eval_loss, "since": self.since}

    @classmethod
    def from_state(cls, state: dict | None) -> "Best":
        """From a checkpoint's ``train_state['best']`` (absent in a checkpoint of an older version: nothing known)."""
        state = state or {}
        return cls(step=state.get("step"), eval_loss=state.get("eval_loss"), since=int(state.get("since") or 0))


@dataclass
class ExportChoice:
    """What ``final/`` holds and why: ``which`` is ``best`` or ``last``; ``step`` the step whose
    weights they are; ``checkpoint`` the best's checkpoint to load (None: the weights in memory)."""

    which: str
    step: int
    eval_loss: float | None
    last_step: int
    last_eval_loss: float | None
    reason: str
    checkpoint: object = None

    def summary(self) -> dict:
        """The summary's ``export`` entry (and the tracker's)."""
        return {"which": self.which, "step": self.step, "eval_loss": self.eval_loss, "last_step": self.last_step,
                "last_eval_loss": self.last_eval_loss, "reason": self.reason}


def _loss(value: float | None) -> str:
    return f"{value:.4f}" if value is not None else "none"


def choose_export(config, best: Best, *, last_step: int, last_eval_loss: float | None, evaluated: bool,
                  reported: list | None) -> ExportChoice:
    """The export of a run ending at ``last_step``: its best evaluated step's weights (from
    ``reported``, Ray Train's reported checkpoints: ``ReportedCheckpoint`` with ``metrics`` and
    ``checkpoint``) unless they are the last step's, ``--export last`` asks for the last, or the
    run has no eval data."""
    def last(reason: str) -> ExportChoice:
        return ExportChoice("last", last_step, last_eval_loss, last_step, last_eval_loss, reason)

    if config.export == "last":
        return last(f"--export last: the last step's weights (eval loss {_loss(last_eval_loss)}; the lowest was "
                    f"{_loss(best.eval_loss)} at step {best.step})" if best.step is not None else
                    "--export last: the last step's weights")
    if not evaluated:
        return last("no eval data (--eval-fraction 0 and no --eval-split): the last step's weights; hold rows out to "
                    "export the best")
    if best.step is None:
        return last("no evaluation gave a finite eval loss: the last step's weights")
    if best.step == last_step:
        return ExportChoice("best", last_step, best.eval_loss, last_step, last_eval_loss,
                            f"the last step has the lowest eval loss ({_loss(best.eval_loss)})")
    found = [r for r in reported or () if r.metrics.get("step") == best.step]
    if not found:
        return last(f"the best step's checkpoint (step {best.step}, eval loss {_loss(best.eval_loss)}) is no longer kept: "
                    f"the last step's weights (eval loss {_loss(last_eval_loss)})")
    return ExportChoice("best", best.step, best.eval_loss, last_step, last_eval_loss,
                        f"step {best.step} has the lowest eval loss ({_loss(best.eval_loss)}), against "
                        f"{_loss(last_eval_loss)} at the last step {last_step}", checkpoint=found[-1].checkpoint)


def load_model_weights(checkpoint, model) -> None:
    """Load the model's part of a checkpoint written by ``training.storage.checkpoint`` into the
    sharded ``model`` (collective): each rank reads its shards of the model where the checkpoint is
    stored, nothing of the optimizer's state or of the other ranks' shards
    (training/storage/checkpoint_reader.py). ``checkpoint``: Ray Train's ``Checkpoint``, a URI or a folder."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    from ..modeling.lora import check_loaded, checkpoint_state, state_dict_options
    from ..storage.checkpoint_reader import CheckpointReader

    state = checkpoint_state(model, get_model_state_dict(model, options=state_dict_options(model)))
    loaded = {"model": state}
    dcp.load(loaded, storage_reader=CheckpointReader(checkpoint))
    result = set_model_state_dict(model, loaded["model"], options=state_dict_options(model, loading=True))
    check_loaded(model, result)


def rank_earlier_checkpoints(config, run_folder: str) -> int:
    """Before a run ranked by eval loss resumes a folder whose checkpoints were reported without
    :data:`RANK_METRIC` (an earlier version, or ``--export last``): the rank of each is written into Ray
    Train's snapshot (``checkpoint_manager_snapshot.json``, read when the controller starts), from its
    eval loss; else Ray would score them ``-inf`` under ``min``, the best, and keep them over every
    new best. Returns how many were ranked."""
    if not ranks_by_eval(config):
        return 0
    import json

    from ..storage.files import read_text, write_text

    uri = f"{run_folder}/checkpoint_manager_snapshot.json"
    text = read_text(uri)
    if not text:
        return 0
    snapshot = json.loads(text)
    results = [*snapshot.get("checkpoint_results", []), *filter(None, [snapshot.get("latest_checkpoint_result")]),
               *snapshot.get("pending_training_results", [])]
    unranked = [result for result in results if RANK_METRIC not in result.get("metrics", {})]
    for result in unranked:
        metrics = result["metrics"]
        metrics[RANK_METRIC] = rank_of(metrics.get("eval_loss"), int(metrics.get("step") or 0))
    if unranked:  # and in Ray's order: worst first (the lowest score, -rank under min), ties by report
        pairs = sorted(zip(snapshot["checkpoint_results"], snapshot["checkpoint_report_indices"]),
                       key=lambda pair: (-pair[0]["metrics"][RANK_METRIC], pair[1]))
        snapshot["checkpoint_results"] = [result for result, _ in pairs]
        snapshot["checkpoint_report_indices"] = [index for _, index in pairs]
        write_text(uri, json.dumps(snapshot))
        print(f"[train] ranked {len(unranked)} earlier checkpoint(s) by their eval loss for --export best", flush=True)
    return len(unranked)
