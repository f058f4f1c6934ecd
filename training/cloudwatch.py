"""Training metrics to CloudWatch, from rank 0 of a run on the cluster.

On only when ``RAY_TRAIN_EKS_METRICS_NAMESPACE`` is set (the RayJob sets it, and the Ray pods'
Pod Identity role may put metrics into that namespace only) and the run trains on GPUs:
local and CPU runs publish nothing. Every few steps rank 0 sends loss, tokens/s (the whole
run's), MFU, step time and gradient norm, with the run name as dimension; once, the
preflight's bus bandwidth with its transport. A failure to publish is logged once and never
stops training: the metrics are a view of the run, not part of it.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable

METRICS_NAMESPACE_ENV = "RAY_TRAIN_EKS_METRICS_NAMESPACE"
#: (metric name, key in the loop's metrics, unit). ``tokens_per_s`` is the run's total.
STEP_METRICS = (
    ("Loss", "loss", "None"),
    ("TokensPerSecond", "tokens_per_s", "Count/Second"),
    ("MFU", "mfu_percent", "Percent"),
    ("StepTime", "step_seconds", "Seconds"),
    ("GradientNorm", "grad_norm", "None"),
)
PREFLIGHT_METRIC = "PreflightBusBandwidth"
#: The preflight measures bus bandwidth in GB/s (bytes / s / 1e9, as nccl-tests reports it).
PREFLIGHT_UNIT = "Gigabytes/Second"
#: CloudWatch takes at most 1000 metric data points per PutMetricData call.
MAX_DATA_PER_CALL = 1000


class MetricsPublisher:
    """Buffers step metrics and sends them every ``every`` steps with ``put_metric_data``.

    :param client: a boto3 CloudWatch client (or anything with ``put_metric_data``).
    :param log: where the one failure line goes. Default - stderr.
    """

    def __init__(self, *, namespace: str, run_name: str, client: Any, every: int = 10,
                 log: Callable[[str], None] | None = None) -> None:
        self.namespace = namespace
        self.dimensions = [{"Name": "Run", "Value": run_name}]
        self.client = client
        self.every = max(1, every)
        self.log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        self.pending: list[dict] = []
        self.failed = False

    def step(self, step: int, metrics: dict) -> None:
        """Record one step's metrics (keys of :data:`STEP_METRICS`; a None value is skipped),
        and send what is buffered every ``every`` steps."""
        for name, key, unit in STEP_METRICS:
            value = metrics.get(key)
            if value is not None:
                self.pending.append({"MetricName": name, "Dimensions": self.dimensions, "Value": float(value), "Unit": unit})
        if step % self.every == 0:
            self.flush()

    def preflight(self, *, transport: str, bus_bandwidth_gbps: float | None) -> None:
        """The preflight's all-reduce bus bandwidth, with the transport NCCL chose as a dimension."""
        if bus_bandwidth_gbps is None:
            return
        self.pending.append({
            "MetricName": PREFLIGHT_METRIC,
            "Dimensions": [*self.dimensions, {"Name": "Transport", "Value": transport}],
            "Value": float(bus_bandwidth_gbps),
            "Unit": PREFLIGHT_UNIT,
        })
        self.flush()

    def flush(self) -> None:
        """Send everything buffered; on failure log once, drop the data and carry on."""
        pending, self.pending = self.pending, []
        for start in range(0, len(pending), MAX_DATA_PER_CALL):
            try:
                self.client.put_metric_data(Namespace=self.namespace, MetricData=pending[start:start + MAX_DATA_PER_CALL])
            except Exception as error:  # noqa: BLE001 - no failure of a metrics call may stop training
                if not self.failed:
                    self.log(f"[metrics] publishing to CloudWatch namespace {self.namespace} failed, training goes on "
                             f"(further failures are not logged): {type(error).__name__}: {error}")
                self.failed = True
                return


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

    return boto3.client("cloudwatch")
