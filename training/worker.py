"""One Ray Train worker's state between steps (:class:`Worker`) and its start: rank, world and
device, NCCL's logging, and a GPU found broken there taken out of the run like one in a step;
:class:`DeliberateStop`, how the run ends on purpose without a retry."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

import ray.train
from .storage.checkpoint import CheckpointWriter
from .telemetry.cloudwatch import MetricsPublisher
from .config import TrainConfig
from .evaluation.best import Best
from .data import DataOrder, TrainingData
from .resilience.faults import NODE_NAME_ENV, Fault, maybe_fake_start_fault, record_followed, start_fault, take_node_out
from .resilience.health import here
from .resilience.preemption import COUNTS, hold_until_replaced, retries_seen
from .resilience.preflight import start_nccl_logging
from .telemetry.runlog import RunLog


class DeliberateStop(Exception):
    """The run ends on purpose, on every worker at once, with ``reason`` and no retry: a failed
    preflight, a data set with nothing to train, a non-finite loss. Raising anything else
    from the training function makes Ray Train retry it ``max_failures`` times (and the
    RayJob start a new cluster), which would fail the same way."""

    def __init__(self, reason: str, *, step: int) -> None:
        super().__init__(reason)
        self.reason, self.step = reason, step


@dataclass
class Worker:
    """What one worker carries between steps."""

    config: TrainConfig
    invocation_id: str
    rank: int
    world: int
    device: torch.device
    nccl_log: str | None = None
    #: The process that prints NCCL's warnings into the job log (training/resilience/nccl_log.py).
    nccl_follower: object = None
    tokenizer: object = None
    data: TrainingData | None = None
    order: DataOrder | None = None
    model: torch.nn.Module | None = None
    optimizer: torch.optim.Optimizer | None = None
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
    hsdp: bool = False
    #: Preference tuning's loss (training/modeling/preference.py), None for supervised fine-tuning.
    preference: object = None
    #: A full fine-tune's precomputed DPO reference (training/modeling/reference.py); None otherwise.
    reference: object = None
    #: Its tables on the device (8 bytes a pair), indexed there by each micro-batch's pairs.
    _reference_tables: dict = field(default_factory=dict)
    flops_shape: dict = field(default_factory=dict)
    peak_tflops: float | None = None
    #: The memory plan of this run on this GPU (training/modeling/plan.py), when one can be made.
    memory_plan: object = None
    #: The plan against the GPU over a step with optimizer state (training/telemetry/memory.py), once measured.
    memory_calibration: dict | None = None
    calibrating: bool = False
    publisher: MetricsPublisher | None = None
    #: Rank 0's steps to the run's MLflow run (training/telemetry/tracking.py), when it is tracked.
    tracker: object = None
    #: The driver's MLflow run for rank 0 (``{"uri", "run_id"}``), or None: no tracking.
    tracking: dict | None = None
    run_log: RunLog | None = None
    checkpoints: CheckpointWriter | None = None
    #: Where this invocation starts, and the run's history that a checkpoint carries.
    start_step: int = 0
    first_loss: float | None = None
    resumed_from_step: int | None = None
    #: Why this invocation resumed ("failure", "preemption", "resize", "new run"), for the first step's record.
    resume_cause: str | None = None
    #: The workers of the group before this one, where an elastic run's size changed (training/resizing.py ``resized_from``).
    resized_from: int | None = None
    #: Earlier invocations' restarts (carried by the checkpoints); this one's are Ray Train's.
    earlier: dict = field(default_factory=lambda: {count: 0 for count in COUNTS})
    restored: dict | None = None
    #: The lowest eval loss so far and the evaluations since (training/evaluation/best.py), carried by checkpoints.
    best: Best = field(default_factory=Best)
    #: Where the learning-rate schedule was re-anchored (a resume with another --max-steps).
    lr_anchor: tuple[int, float] | None = None
    #: Tokens/s of this invocation's steps, the first (warm-up) excluded.
    throughput: list[float] = field(default_factory=list)
    #: Step times since the last health probe.
    step_times: list[float] = field(default_factory=list)
    #: This worker took its node out of the run (a node condition); the notice follows.
    node_out: bool = False
    #: This worker is its node's first rank (it reads the node's conditions), and when it last did.
    reads_node: bool = False
    node_read_at: float = 0.0
    #: The driver's notifier (training/telemetry/notify.py), or None: no topic.
    notifier: object = None
    #: When the run must have checkpointed and stopped (training/resilience/deadline.py), or None.
    deadline: object = None
    #: Seconds the last reported checkpoint took to write (this rank's), for the stop time's margin.
    checkpoint_seconds: float | None = None
    #: What the run's GPU nodes cost (training/telemetry/cost.py), None where not known; and from when
    #: (the job's start) and what earlier invocations cost, as the driver hands them over.
    cost: object = None
    started: float | None = None
    earlier_usd: float = 0.0
    cluster_start: float | None = None  # the Ray cluster's start, for the nodes' time before the driver's

    def reference_on_device(self, which: str) -> torch.Tensor | None:
        """The precomputed DPO reference table ``which`` (train or eval) on this worker's device, moved
        there once; None without one (SFT, LoRA, SimPO)."""
        table = getattr(self.reference, which, None) if self.reference is not None else None
        if table is None:
            return None
        if which not in self._reference_tables:
            self._reference_tables[which] = torch.from_numpy(table).to(self.device)
        return self._reference_tables[which]

    @property
    def preemptions(self) -> int:
        """The run's preemptions: earlier invocations' and those Ray Train counted in this one."""
        return self.earlier["preemptions"] + retries_seen()["preemptions"]

    @property
    def failures(self) -> int:
        """The run's failures (without notice), counted alike."""
        return self.earlier["failures"] + retries_seen()["failures"]

    @property
    def hardware_faults(self) -> int:
        """The run's hardware faults (a worker found its GPU broken and took its node out), counted alike."""
        return self.earlier.get("hardware_faults", 0) + retries_seen()["hardware_faults"]


def start_worker_or_take_node_out(config: TrainConfig, invocation_id: str) -> Worker:
    """:func:`start_worker`; a GPU found broken there (``torch.cuda.set_device``, CUDA's
    initialisation) is a hardware fault like one in a step: the node is taken out and the run
    resumes elsewhere, nothing charged to ``--max-failures``."""
    try:
        return start_worker(config, invocation_id)
    except Exception as error:
        what = start_fault(error)
        if what is None:
            raise
        rank = ray.train.get_context().get_world_rank()
        take_node_out(Fault("gpu error", f"{what} at the worker's start: {str(error).splitlines()[0][:300]}",
                            **here(torch.device("cpu"), rank)), invocation_id=invocation_id)
        hold_until_replaced()
        raise


def start_worker(config: TrainConfig, invocation_id: str) -> Worker:
    """This worker's rank, world and device (NCCL's logging prepared before any communicator)."""
    maybe_fake_start_fault()
    context = ray.train.get_context()
    worker = Worker(config=config, invocation_id=invocation_id, rank=context.get_world_rank(),
                    world=context.get_world_size(), device=torch.device("cpu"))
    if config.use_gpu:
        worker.device = ray.train.torch.get_device()
        torch.cuda.set_device(worker.device)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(worker.world, 1)))
    if config.use_gpu or os.environ.get(NODE_NAME_ENV):
        # NCCL's warnings into the job log; and, in a pod, the node taken out when a GPU fault ends
        # this process before Python can act (torch's NCCL watchdog): the follower outlives it.
        take_out = {**here(worker.device, worker.rank), "invocation_id": invocation_id,
                    "gcs_address": ray.get_runtime_context().gcs_address} if os.environ.get(NODE_NAME_ENV) else None
        worker.nccl_log, worker.nccl_follower = start_nccl_logging(take_out=take_out)
        if take_out:
            record_followed(invocation_id)
    return worker
