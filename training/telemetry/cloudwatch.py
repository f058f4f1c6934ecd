"""Training metrics to CloudWatch, from rank 0 of a run on the cluster.

On only when ``RAY_TRAIN_EKS_METRICS_NAMESPACE`` is set (the RayJob sets it, and the Ray pods'
Pod Identity role may put metrics into that namespace only) and the run trains on GPUs:
local and CPU runs publish nothing. Every few steps rank 0 sends loss, eval loss, tokens/s
(the whole run's), MFU, step time and gradient norm, with the run name as dimension and
each datum stamped with its step's time; once, the preflight's bus bandwidth with its
transport.

The metrics are a view of the run, not part of it:
- ``PutMetricData`` rejects a whole request for one NaN or infinite value (its ``Value``
  takes finite numbers only), so non-finite values are dropped, and counted;
- the calls go out from a thread of their own with short timeouts and few retries, so a
  slow or unreachable CloudWatch never holds rank 0 (and with it every rank, at the next
  collective);
- a failure is logged once and never stops training; what is buffered is sent on every
  way out of the loop (:meth:`MetricsPublisher.close`).
"""

from __future__ import annotations

import math
import os
import queue
import sys
import threading
from datetime import datetime, timezone
from typing import Any, Callable

METRICS_NAMESPACE_ENV = "RAY_TRAIN_EKS_METRICS_NAMESPACE"
#: (metric name, key in the loop's metrics, unit). ``tokens_per_s`` is the run's total.
STEP_METRICS = (
    ("Loss", "loss", "None"),
    ("EvalLoss", "eval_loss", "None"),
    ("TokensPerSecond", "tokens_per_s", "Count/Second"),
    ("MFU", "mfu_percent", "Percent"),
    ("StepTime", "step_seconds", "Seconds"),
    ("GradientNorm", "grad_norm", "None"),
    # The slowest GPU's matmul throughput as a share of the median (training/resilience/health.py), every
    # --health-check-every steps: a straggler shows as a dip.
    ("SlowestGpuPercent", "slowest_gpu_percent", "Percent"),
)
PREFLIGHT_METRIC = "PreflightBusBandwidth"
#: The preflight measures bus bandwidth in GB/s (bytes / s / 1e9, as nccl-tests reports it).
PREFLIGHT_UNIT = "Gigabytes/Second"
#: CloudWatch takes at most 1000 metric data points per PutMetricData call.
MAX_DATA_PER_CALL = 1000
#: botocore settings of the client: a call gives up within seconds, not botocore's 60 s x retries.
CLIENT_TIMEOUTS = {"connect_timeout": 3, "read_timeout": 5, "retries": {"max_attempts": 2, "mode": "standard"}}
#: How long :meth:`MetricsPublisher.close` waits for the last sends.
CLOSE_TIMEOUT_S = 20


class MetricsPublisher:
    """Buffers step metrics and sends them every ``every`` steps with ``put_metric_data``,
    from a sender thread.

    :param client: a boto3 CloudWatch client (or anything with ``put_metric_data``).
    :param log: where the failure line and the count of dropped values go. Default - stderr.
    :param clock: the time each datum is stamped with. Default - now, in UTC.
    """

    def __init__(self, *, namespace: str, run_name: str, client: Any, every: int = 10,
                 log: Callable[[str], None] | None = None, clock: Callable[[], datetime] | None = None) -> None:
        self.namespace = namespace
        self.dimensions = [{"Name": "Run", "Value": run_name}]
        self.client = client
        self.every = max(1, every)
        self.log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        self.clock = clock or (lambda: datetime.now(timezone.utc))
        self.pending: list[dict] = []
        self.failed = False
        self.dropped = 0
        self._outbox: queue.Queue = queue.Queue()
        self._sender = threading.Thread(target=self._send_loop, name="cloudwatch-sender", daemon=True)
        self._sender.start()

    def _datum(self, name: str, value: Any, unit: str, dimensions: list[dict], when: datetime) -> dict | None:
        value = float(value)
        if not math.isfinite(value):
            self.dropped += 1
            return None
        return {"MetricName": name, "Dimensions": dimensions, "Value": value, "Unit": unit, "Timestamp": when}

    def step(self, step: int, metrics: dict) -> None:
        """Record one step's metrics (keys of :data:`STEP_METRICS`; None and non-finite values
        are skipped), stamped now, and send what is buffered every ``every`` steps."""
        when = self.clock()
        for name, key, unit in STEP_METRICS:
            if metrics.get(key) is not None:
                datum = self._datum(name, metrics[key], unit, self.dimensions, when)
                if datum:
                    self.pending.append(datum)
        if step % self.every == 0:
            self.flush()

    def preflight(self, *, transport: str, bus_bandwidth_gbps: float | None) -> None:
        """The preflight's all-reduce bus bandwidth, with the transport NCCL chose as a dimension."""
        if bus_bandwidth_gbps is None:
            return
        datum = self._datum(PREFLIGHT_METRIC, bus_bandwidth_gbps, PREFLIGHT_UNIT,
                            [*self.dimensions, {"Name": "Transport", "Value": transport}], self.clock())
        if datum:
            self.pending.append(datum)
        self.flush()

    def flush(self) -> None:
        """Hand everything buffered to the sender thread (returns at once)."""
        pending, self.pending = self.pending, []
        for start in range(0, len(pending), MAX_DATA_PER_CALL):
            self._outbox.put(pending[start:start + MAX_DATA_PER_CALL])

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Send what is buffered and wait (at most ``timeout_s``) for the sender to finish."""
        self.flush()
        self._outbox.put(None)
        self._sender.join(timeout_s)
        if self.dropped:
            self.log(f"[metrics] {self.dropped} non-finite value(s) were not sent to CloudWatch (it rejects them)")

    def _send_loop(self) -> None:
        while True:
            batch = self._outbox.get()
            if batch is None:
                return
            try:
                self.client.put_metric_data(Namespace=self.namespace, MetricData=batch)
            except Exception as error:  # noqa: BLE001 - no failure of a metrics call may stop training
                if not self.failed:
                    self.log(f"[metrics] publishing to CloudWatch namespace {self.namespace} failed, training goes on "
                             f"(further failures are not logged): {type(error).__name__}: {error}")
                self.failed = True


def publisher_from_env(*, run_name: str, use_gpu: bool, every: int = 10, environ=None,
                       client_factory: Callable[[], Any] | None = None) -> MetricsPublisher | None:
    """A publisher when ``RAY_TRAIN_EKS_METRICS_NAMESPACE`` is set and the run is on GPUs, else None."""
    environ = os.environ if environ is None else environ
    namespace = environ.get(METRICS_NAMESPACE_ENV, "").strip()
    if not namespace or not use_gpu:
        return None
    try:
        client = client_factory() if client_factory else _boto3_client()
    except Exception as error:  # noqa: BLE001 - no boto3, no region: no metrics, the run goes on
        print(f"[metrics] no CloudWatch client, publishing nothing: {type(error).__name__}: {error}", file=sys.stderr, flush=True)
        return None
    return MetricsPublisher(namespace=namespace, run_name=run_name, client=client, every=every)


def _boto3_client():
    import boto3  # in the DLC image; credentials from the pod's EKS Pod Identity
    from botocore.config import Config

    return boto3.client("cloudwatch", config=Config(**CLIENT_TIMEOUTS))
