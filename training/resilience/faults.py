"""A hardware fault and what taking its node out of the run means; no torch here, so that the
NCCL log follower (:mod:`.nccl_log`), which outlives a worker torch's watchdog killed, can do it too.

Taking a node out (:func:`take_node_out`), in the order that keeps the run's failure budget whole:

1. the fault goes into Ray's key-value store (:data:`LEDGER_NAMESPACE`), where the controller's
   ``RetryCounter`` (training/resilience/preemption.py) reads it and counts the restart as a hardware
   fault, apart from preemptions and software failures (and never against ``--max-failures``);
2. the node is tainted in Kubernetes (:data:`UNHEALTHY_TAINT_ENV`, ``NoSchedule``; :mod:`.kube`):
   the worker pod KubeRay creates next cannot land on it, so it stays Pending and Karpenter
   launches a new node for it (a NodePool's empty, tainted node is then consolidated away), or
   the node group's repair replaces the node;
3. the Ray node is drained with reason ``DRAIN_NODE_REASON_PREEMPTION`` and the deadline *now*
   (or after a notice): Ray schedules nothing new on it, and Ray Train restarts the worker group
   from the last checkpoint.

Testing aids, set in a node's environment (a Ray worker inherits its raylet's), each delivering a
fault the way the world does where a CPU can: :data:`FAKE_FAULT_ENV` (CUDA's ECC error raised in
a step), :data:`FAKE_NCCL_ABORT_ENV` (training/resilience/nccl_log.py: NCCL's and torch's lines for a CUDA error in a collective,
then SIGABRT, as torch's watchdog ends the process), :data:`FAKE_START_FAULT_ENV` (c10's error
where the worker sets its device up).
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import asdict, dataclass

#: Kubernetes node name of the pod (the downward API's ``spec.nodeName``), set in the GPU worker pods.
NODE_NAME_ENV = "RAY_TRAIN_EKS_NODE_NAME"
#: The taint key a worker puts on its node at a hardware fault; unset: no taint (e.g. outside Kubernetes).
UNHEALTHY_TAINT_ENV = "RAY_TRAIN_EKS_UNHEALTHY_TAINT"
FAKE_FAULT_ENV = "RAY_TRAIN_EKS_FAKE_GPU_FAULT"
FAKE_START_FAULT_ENV = "RAY_TRAIN_EKS_FAKE_GPU_START_FAULT"
FAKE_NCCL_ABORT_ENV = "RAY_TRAIN_EKS_FAKE_NCCL_ABORT"

#: Ray internal KV namespace of the hardware-fault ledger (key ``<invocation>/<ray node id>``).
LEDGER_NAMESPACE = "ray-train-eks-hardware"

#: Which CUDA errors are whose (CUDA Runtime API, ``cudaError``, the cudaGetErrorString texts and
#: their documented causes; NVIDIA's XID catalog, docs.nvidia.com/deploy/xid-errors, for the XIDs
#: each goes with). A fault is hardware only on evidence (:func:`classify_cuda_error`).
#:
#: The device says so: a fault of the GPU or its node, whatever the program did.
HARDWARE_ERRORS: tuple[tuple[str, str], ...] = (
    (r"uncorrectable ECC error", "uncorrectable ECC error (cudaErrorECCUncorrectable; XID 48, 63/64, 94/95)"),
    (r"uncorrectable NVLink error", "uncorrectable NVLink error (cudaErrorNvlinkUncorrectable; XID 74)"),
    (r"fallen off the bus|GPU is lost|GPU requires reset", "GPU lost (XID 79: fallen off the bus)"),
    (r"busy or unavailable", "GPU unavailable (cudaErrorDevicesUnavailable)"),
    (r"no CUDA-capable device is detected", "no GPU visible (cudaErrorNoDevice)"),
)
#: The program's: the CUDA documentation gives the program as the cause, and a new node would fail
#: the same way (XID 13 and 31 are application-class in NVIDIA's catalog, XID 43 a stopped context).
PROGRAM_ERRORS: tuple[tuple[str, str], ...] = (
    (r"illegal memory access", "an illegal memory access (cudaErrorIllegalAddress; XID 13/31): a kernel read or "
                               "wrote memory it does not own"),
    (r"misaligned address", "a misaligned address (cudaErrorMisalignedAddress; XID 13)"),
    (r"illegal instruction", "an illegal instruction (cudaErrorIllegalInstruction; XID 13)"),
    (r"invalid program counter", "an invalid program counter (cudaErrorInvalidPc)"),
    (r"device-side assert", "a device-side assert (cudaErrorAssert; XID 43): an index out of range, typically"),
    (r"hardware stack error", "a call-stack error in a kernel (cudaErrorHardwareStackError: \"stack corruption or "
                              "exceeding the stack size limit\")"),
    (r"out of memory", "out of GPU memory (cudaErrorMemoryAllocation)"),
    (r"too many resources requested for launch", "a kernel launched with too many resources (cudaErrorLaunchOutOfResources)"),
)
#: Either: "unspecified launch failure" is an invalid device pointer or out-of-bounds shared memory
#: in the CUDA documentation's words (cudaErrorLaunchFailure; XID 13/43), and the GPU's after XID 62
#: or 79; "unknown error" likewise. The evidence decides: the node's conditions, and whether the same
#: error follows the node (hardware) or the code (another node: the program's).
AMBIGUOUS_ERRORS: tuple[tuple[str, str], ...] = (
    (r"unspecified launch failure", "unspecified launch failure (cudaErrorLaunchFailure)"),
    (r"CUDA error: unknown error", "CUDA unknown error (cudaErrorUnknown)"),
)


#: At a worker's start, where its GPU is first used (``torch.cuda.set_device``, CUDA's
#: initialisation): PyTorch's messages for a GPU lost before the first kernel
#: (c10/cuda/CUDAFunctions.cpp, device_count; pytorch/pytorch#49081), which on a node that
#: started with all its GPUs (the pod was given them) are the node's fault.
START_ERRORS: tuple[tuple[str, str], ...] = (
    (r"CUDA unknown error", "CUDA unknown error at initialisation (a GPU lost since the node started, as after XID 79)"),
    (r"invalid device ordinal", "a GPU of the pod is missing (invalid device ordinal)"),
    (r"CUDA driver initialization failed", "the CUDA driver failed to initialise"),
    (r"No CUDA GPUs are available", "no GPU visible to the worker"),
)


@dataclass(frozen=True)
class Fault:
    """A hardware fault of this worker's node."""

    kind: str  # "gpu error", "gpu missing", "straggler"
    reason: str
    ray_node: str = ""
    node_name: str = ""
    gpu: str = ""
    rank: int = -1

    @classmethod
    def from_record(cls, record: dict) -> "Fault":
        """The fault a ledger record holds (which has more: when, the taint)."""
        return cls(**{key: value for key, value in record.items() if key in cls.__dataclass_fields__})

    def describe(self) -> str:
        where = self.node_name or (self.ray_node[:12] if self.ray_node else "this node")
        return f"{self.kind} on node {where}{' GPU ' + self.gpu if self.gpu else ''} (rank {self.rank}): {self.reason}"


def hardware_line(text: str, patterns=HARDWARE_ERRORS) -> str | None:
    """What hardware fault a message (an error's, a line of NCCL's or torch's watchdog's log) reports, or None."""
    for pattern, what in patterns:
        if re.search(pattern, text, re.IGNORECASE):
            return what
    return None


def hardware_fault(error: BaseException, patterns=HARDWARE_ERRORS) -> str | None:
    """What hardware fault ``error`` (or an error it was raised from) reports (``patterns``: of
    another class), or None."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        what = hardware_line(str(error), patterns)
        if what:
            return what
        error = error.__cause__ or error.__context__
    return None


def classify_cuda_error(error: BaseException) -> tuple[str, str] | None:
    """``("hardware" | "program" | "ambiguous", what)`` for a CUDA error in ``error`` (or what it
    was raised from), or None for any other error."""
    for kind, patterns in (("hardware", HARDWARE_ERRORS), ("program", PROGRAM_ERRORS), ("ambiguous", AMBIGUOUS_ERRORS)):
        what = hardware_fault(error, patterns)
        if what:
            return kind, what
    return None


#: Marks an error the run must stop at, not retry (the program's, seen on two nodes): the
#: controller's RetryCounter (training/resilience/preemption.py) ends the run when a worker raised it.
PROGRAM_ERROR_MARK = "[ray-train-eks: the program's error]"


class ProgramError(RuntimeError):
    """A CUDA error that followed the code to another node: the program's, not the GPUs'."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return f"{PROGRAM_ERROR_MARK} {self.message}"

    def __reduce__(self):  # pickled to the controller: the message once, the mark once
        return (type(self), (self.message,))


def signature(error: BaseException, patterns=AMBIGUOUS_ERRORS) -> str:
    """The CUDA error ``error`` (or an error it was raised from) names, as its class in the table
    (the same fault wherever it shows: a Python exception on one node, torch's watchdog line or
    NCCL's warning, with another host, pid and address, on another); the first line where none does."""
    what = hardware_fault(error, patterns)
    if what:
        return what
    lines = str(error).strip().splitlines()
    return re.sub(r"0x[0-9a-fA-F]+|\d+", "N", lines[0] if lines else "")[:300]


#: Key prefix, in the ledger's namespace, of the ambiguous CUDA errors seen in an invocation: one
#: key a report, ``<prefix><invocation>/<signature's hash>/<attempt>/<node>/<rank>``, so that the
#: ranks of one node, which all fail in the same step, never read each other as an earlier time.
SUSPECT_PREFIX = "suspect/"
#: Key, in the ledger's namespace, of an invocation's error found to be the program's by a process
#: that cannot raise into the run (the NCCL log follower of a worker torch's watchdog aborted):
#: ``<prefix><invocation>``; the controller's RetryCounter stops the run with it.
PROGRAM_PREFIX = "program/"


def _kv(gcs=None):
    """(put, keys, get) on Ray's key-value store in the ledger's namespace: through ``gcs`` (a
    ``ray._raylet.GcsClient``, outside a Ray worker: the follower) or this worker's connection."""
    namespace = LEDGER_NAMESPACE
    if gcs is not None:
        return (lambda key, value, overwrite: gcs.internal_kv_put(key.encode(), value.encode(), overwrite, namespace.encode()),
                lambda prefix: gcs.internal_kv_keys(prefix.encode(), namespace.encode()),
                lambda key: gcs.internal_kv_get(key.encode(), namespace.encode()))
    from ray.experimental import internal_kv

    return (lambda key, value, overwrite: internal_kv._internal_kv_put(key, value, overwrite=overwrite, namespace=namespace),
            lambda prefix: internal_kv._internal_kv_list(prefix, namespace=namespace),
            lambda key: internal_kv._internal_kv_get(key, namespace=namespace))


def record_suspect(invocation_id: str, error: BaseException, node: str, attempt: int, rank: int,
                   gcs=None, step: int | None = None) -> list[tuple[int, str, int | None]]:
    """Note that ``error`` happened on ``node`` (its Kubernetes name where there is one) in the
    run's ``attempt`` (its restarts so far), after ``step`` where it is known; the (attempt, node,
    step) of the same error in earlier attempts."""
    import hashlib

    put, keys, _ = _kv(gcs)
    prefix = f"{SUSPECT_PREFIX}{invocation_id}/{hashlib.sha256(signature(error).encode()).hexdigest()[:16]}/"
    put(f"{prefix}{attempt}/{node}/{rank}/{'' if step is None else step}", str(time.time()), False)
    earlier = set()
    for key in keys(prefix):
        key = key.decode() if isinstance(key, bytes) else key
        seen_attempt, seen_node, _, seen_step = (key[len(prefix):].split("/") + ["", ""])[:4]
        if int(seen_attempt) < attempt:
            earlier.add((int(seen_attempt), seen_node, int(seen_step) if seen_step else None))
    return sorted(earlier, key=lambda seen: (seen[0], seen[1], -1 if seen[2] is None else seen[2]))


def record_program_error(invocation_id: str, attempt: int, message: str, gcs=None) -> None:
    """Note that this invocation's error in ``attempt`` is the program's (:data:`PROGRAM_PREFIX`)."""
    put, _, _ = _kv(gcs)
    put(f"{PROGRAM_PREFIX}{invocation_id}/{attempt}", message, True)


def program_error_recorded(invocation_id: str, attempt: int) -> str | None:
    """The program's error a follower recorded for this invocation's ``attempt``, or None."""
    _, _, get = _kv()
    value = get(f"{PROGRAM_PREFIX}{invocation_id}/{attempt}")
    return (value.decode() if isinstance(value, bytes) else value) or None


def start_fault(error: BaseException) -> str | None:
    """What hardware fault an error at a worker's start reports: any of the run's, or a GPU lost
    before the first kernel."""
    return hardware_fault(error) or hardware_fault(error, START_ERRORS)


def maybe_fake_start_fault() -> None:
    """Testing aid: at the start of a worker on a node whose environment has
    :data:`FAKE_START_FAULT_ENV`, raise what ``torch.cuda.set_device`` raises there when a GPU was
    lost (c10's message), where the worker sets its device up."""
    if os.environ.get(FAKE_START_FAULT_ENV):
        raise RuntimeError("CUDA unknown error - this may be due to an incorrectly set up environment, e.g. changing "
                           "env variable CUDA_VISIBLE_DEVICES after program start. Setting the available devices to be "
                           f"zero. (injected: {FAKE_START_FAULT_ENV} on this node)")


#: The CUDA errors :func:`maybe_fake_fault` raises, by the name after the step (``6:illegal-address``),
#: as torch raises them (c10/cuda/CUDAException.cpp: ``CUDA error: `` and cudaGetErrorString's text).
FAKE_FAULTS = {
    "ecc": "CUDA error: uncorrectable ECC error encountered",
    "illegal-address": "CUDA error: an illegal memory access was encountered",
    "launch-failure": "CUDA error: unspecified launch failure",
}


def maybe_fake_fault(step: int) -> None:
    """Testing aid: raise a CUDA error after ``step`` on the workers of a node whose environment has
    :data:`FAKE_FAULT_ENV` at that step: ``<step>`` (the ECC error) or ``<step>:<name>`` of
    :data:`FAKE_FAULTS`."""
    at = os.environ.get(FAKE_FAULT_ENV)
    if not at:
        return
    at_step, _, name = at.partition(":")
    if int(at_step) == step:
        raise RuntimeError(f"{FAKE_FAULTS[name or 'ecc']} (injected: {FAKE_FAULT_ENV}={at} on this node)\n"
                           "CUDA kernel errors might be asynchronously reported at some other API call")


def take_node_out(fault: Fault, *, invocation_id: str, notice_s: float = 0, gcs=None) -> None:
    """Record the fault, taint the Kubernetes node, drain the Ray node with a deadline ``notice_s``
    from now (0: the GPU is broken, nothing more runs there; more: the training checkpoints at the
    notice first). Each part is logged; none raises: what follows (a hold, or the next step) must happen.
    ``gcs``: a ``ray._raylet.GcsClient`` where this process is not a Ray worker (the NCCL log follower)."""
    import ray
    from ray.core.generated import autoscaler_pb2

    print(f"[health] HARDWARE FAULT: {fault.describe()}; taking the node out of the run", flush=True)
    node = fault.ray_node or ray.get_runtime_context().get_node_id()
    gcs = gcs or ray._private.worker.global_worker.gcs_client
    taint_key = os.environ.get(UNHEALTHY_TAINT_ENV)
    try:
        record = {**asdict(fault), "time": time.time(), "taint": taint_key}
        gcs.internal_kv_put(f"{invocation_id}/{node}".encode(), json.dumps(record).encode(), True, LEDGER_NAMESPACE.encode())
    except Exception as error:  # noqa: BLE001 - the count is lost, not the run
        print(f"[health] could not record the fault: {type(error).__name__}: {error}", flush=True)
    _notify_node_out(fault, invocation_id=invocation_id, node=node, gcs=gcs, notice_s=notice_s)
    if taint_key and fault.node_name:
        from .kube import taint_node

        try:
            print(f"[health] {taint_node(fault.node_name, key=taint_key, value=_taint_value(fault.kind))}", flush=True)
        except Exception as error:  # noqa: BLE001 - the Ray drain still keeps this run off the node
            print(f"[health] could not taint node {fault.node_name} ({type(error).__name__}: {error}); the retry may "
                  "land on it again once its pod restarts", flush=True)
    try:
        accepted, why = gcs.drain_node(node, autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"),
                                       f"hardware fault: {fault.describe()}"[:1000], int((time.time() + notice_s) * 1000))
    except Exception as error:  # noqa: BLE001
        accepted, why = False, f"{type(error).__name__}: {error}"
    print(f"[health] Ray node {node[:12]} drained (no new work; the run restarts elsewhere"
          f"{f' after a checkpoint, within {notice_s:.0f} s' if notice_s else ''}): accepted={accepted} {why}".rstrip(), flush=True)


#: Key prefix, in the ledger's namespace, of the nodes whose being taken out was published
#: (``<prefix><invocation>/<ray node id>``): the ranks of one node that all find its GPU broken send one message.
NOTIFIED_PREFIX = "notified/"


def _notify_node_out(fault: Fault, *, invocation_id: str, node: str, gcs, notice_s: float) -> None:
    """The node taken out, to the run's watchers (training/telemetry/notify.py), once a node; before the
    drain, after which Ray Train tears this worker down. Never raises."""
    from ..telemetry.notify import current

    notifier = current()
    if notifier is None:
        return
    try:
        first = bool(gcs.internal_kv_put(f"{NOTIFIED_PREFIX}{invocation_id}/{node}".encode(), b"1", False,
                                         LEDGER_NAMESPACE.encode()))
    except Exception:  # noqa: BLE001 - unknown: say it (twice, at worst)
        first = True
    if first:
        then = (f"the run checkpoints within {notice_s:.0f} s and resumes on a new node from that checkpoint" if notice_s
                else "the run resumes on a new node from its last checkpoint")
        notifier.publish("node taken out", f"{fault.describe()}. The node is tainted and drained; {then}", quick=True)


def _taint_value(kind: str) -> str:
    """A taint value (a label value: letters, digits, '-', '_', '.')."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", kind).strip("-")[:63]


def faults_recorded(invocation_id: str) -> dict[str, dict]:
    """The hardware faults recorded in this invocation, by Ray node id (any process of the cluster)."""
    from ray.experimental import internal_kv

    found = {}
    prefix = f"{invocation_id}/"
    for key in internal_kv._internal_kv_list(prefix, namespace=LEDGER_NAMESPACE):
        key = key.decode() if isinstance(key, bytes) else key
        value = internal_kv._internal_kv_get(key, namespace=LEDGER_NAMESPACE)
        if value:
            found[key[len(prefix):]] = json.loads(value)
    return found


#: Key prefix, in the ledger's namespace, of the nodes whose workers have an NCCL log follower that
#: takes the node out at a GPU fault (``<prefix><invocation>/<ray node id>``): only such a worker's
#: death can still be followed by a fault record, so only then does the controller wait for one.
FOLLOWED_PREFIX = "followed/"


def record_followed(invocation_id: str) -> None:
    """Note in the ledger that this worker's node has a follower that takes it out at a GPU fault."""
    import ray
    from ray.experimental import internal_kv

    node = ray.get_runtime_context().get_node_id()
    internal_kv._internal_kv_put(f"{FOLLOWED_PREFIX}{invocation_id}/{node}", "1", namespace=LEDGER_NAMESPACE)


def followed(invocation_id: str) -> bool:
    """Whether a worker of this invocation has a follower that may still record a fault
    (:func:`record_followed`): outside a pod none does, and a dead worker's fault can never come."""
    from ray.experimental import internal_kv

    return bool(internal_kv._internal_kv_list(f"{FOLLOWED_PREFIX}{invocation_id}/", namespace=LEDGER_NAMESPACE))
