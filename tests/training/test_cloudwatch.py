"""The CloudWatch publisher of the training metrics, with a stubbed client."""

from __future__ import annotations

import pytest

from datetime import datetime, timezone

from training.telemetry.cloudwatch import METRICS_NAMESPACE_ENV, MetricsPublisher, publisher_from_env

T0 = datetime(2026, 12, 1, 9, 0, tzinfo=timezone.utc)


class RecordingClient:
    def __init__(self, fail: bool = False):
        self.calls: list[dict] = []
        self.fail = fail

    def put_metric_data(self, **kwargs):
        self.calls.append(kwargs)
        if self.fail:
            raise RuntimeError("AccessDenied: not authorized to perform cloudwatch:PutMetricData")


STEP = {"loss": 2.5, "tokens_per_s": 12000.0, "mfu_percent": 41.5, "step_seconds": 0.8, "grad_norm": 1.25}


def test_every_few_steps_rank_zero_sends_the_step_metrics_with_the_run_as_dimension():
    client = RecordingClient()
    publisher = MetricsPublisher(namespace="RayTrainEks/Training", run_name="qwen-sft", client=client, every=2, clock=lambda: T0)
    publisher.step(1, STEP)
    assert publisher._outbox.empty()  # buffered until the second step
    publisher.step(2, {**STEP, "loss": 2.0})
    publisher.close()
    (call,) = client.calls
    assert call["Namespace"] == "RayTrainEks/Training"
    data = call["MetricData"]
    assert [(d["MetricName"], d["Value"], d["Unit"]) for d in data[:5]] == [
        ("Loss", 2.5, "None"), ("TokensPerSecond", 12000.0, "Count/Second"), ("MFU", 41.5, "Percent"),
        ("StepTime", 0.8, "Seconds"), ("GradientNorm", 1.25, "None"),
    ]
    assert data[5] == {"MetricName": "Loss", "Dimensions": [{"Name": "Run", "Value": "qwen-sft"}], "Value": 2.0, "Unit": "None",
                       "Timestamp": T0}
    assert all(d["Dimensions"] == [{"Name": "Run", "Value": "qwen-sft"}] for d in data)


def test_preflight_bandwidth_goes_with_its_transport_and_a_missing_mfu_is_skipped():
    client = RecordingClient()
    publisher = MetricsPublisher(namespace="N", run_name="r", client=client, every=1, clock=lambda: T0)
    publisher.preflight(transport="efa", bus_bandwidth_gbps=87.5)
    publisher.step(1, {**STEP, "mfu_percent": None})
    publisher.close()
    preflight, step = client.calls
    assert preflight["MetricData"] == [{"MetricName": "PreflightBusBandwidth", "Value": 87.5, "Unit": "Gigabytes/Second",
                                        "Dimensions": [{"Name": "Run", "Value": "r"}, {"Name": "Transport", "Value": "efa"}],
                                        "Timestamp": T0}]
    assert "MFU" not in [d["MetricName"] for d in step["MetricData"]]


def test_a_failing_client_is_logged_once_and_never_raises():
    client, lines = RecordingClient(fail=True), []
    publisher = MetricsPublisher(namespace="N", run_name="r", client=client, every=1, log=lines.append)
    for step in range(1, 4):
        publisher.step(step, STEP)  # must not raise
    publisher.close()
    assert len(client.calls) == 3  # it keeps trying (a throttle passes), quietly
    assert len(lines) == 1 and "AccessDenied" in lines[0] and "training goes on" in lines[0]


@pytest.mark.parametrize("environ, use_gpu", [({}, True), ({METRICS_NAMESPACE_ENV: "N"}, False), ({METRICS_NAMESPACE_ENV: " "}, True)])
def test_local_cpu_and_unconfigured_runs_publish_nothing(environ, use_gpu):
    def factory():
        raise AssertionError("no client may be made")

    assert publisher_from_env(run_name="r", use_gpu=use_gpu, environ=environ, client_factory=factory) is None


def test_the_rayjob_namespace_on_gpus_makes_a_publisher():
    client = RecordingClient()
    publisher = publisher_from_env(run_name="r", use_gpu=True, environ={METRICS_NAMESPACE_ENV: "RayTrainEks/Training"},
                                   client_factory=lambda: client)
    assert publisher is not None and publisher.namespace == "RayTrainEks/Training" and publisher.client is client


def test_no_client_means_no_metrics_not_a_failed_run():
    def factory():
        raise ModuleNotFoundError("No module named 'boto3'")

    assert publisher_from_env(run_name="r", use_gpu=True, environ={METRICS_NAMESPACE_ENV: "N"}, client_factory=factory) is None


def test_preflight_unit_is_what_the_preflight_measures():
    """bus_bandwidth_gbps divides bytes by 1e9: gigabytes, not gigabits, per second."""
    from training.telemetry.cloudwatch import PREFLIGHT_UNIT
    from training.resilience.preflight import bus_bandwidth_gbps

    # nccl-tests' bus bandwidth: 1e9 bytes all-reduced by 2 ranks in 1 s moves 1e9 x 2(2-1)/2 bytes/s.
    assert bus_bandwidth_gbps(size_bytes=10**9, seconds=1.0, world_size=2) == 1.0
    assert PREFLIGHT_UNIT == "Gigabytes/Second"


def test_non_finite_values_are_dropped_and_counted_so_the_batch_is_not_rejected():
    client, lines = RecordingClient(), []
    publisher = MetricsPublisher(namespace="N", run_name="r", client=client, every=2, log=lines.append, clock=lambda: T0)
    publisher.step(1, STEP)
    publisher.step(2, {**STEP, "loss": float("nan"), "grad_norm": float("inf")})
    publisher.close()
    (call,) = client.calls
    values = [d["Value"] for d in call["MetricData"]]
    assert all(v == v and abs(v) != float("inf") for v in values)  # PutMetricData rejects a whole request for one NaN
    assert len(values) == 2 * 5 - 2
    assert lines == ["[metrics] 2 non-finite value(s) were not sent to CloudWatch (it rejects them)"]


def test_each_datum_carries_its_steps_time_not_the_flush_time():
    client, times = RecordingClient(), iter([T0.replace(second=s) for s in range(10)])
    publisher = MetricsPublisher(namespace="N", run_name="r", client=client, every=3, clock=lambda: next(times))
    for step in (1, 2, 3):
        publisher.step(step, {"loss": 1.0})
    publisher.close()
    assert [d["Timestamp"].second for d in client.calls[0]["MetricData"]] == [0, 1, 2]


def test_a_slow_cloudwatch_never_holds_the_training_step():
    import time

    class SlowClient(RecordingClient):
        def put_metric_data(self, **kwargs):
            time.sleep(2)
            super().put_metric_data(**kwargs)

    client = SlowClient()
    publisher = MetricsPublisher(namespace="N", run_name="r", client=client, every=1)
    started = time.perf_counter()
    for step in range(1, 4):
        publisher.step(step, STEP)
    assert time.perf_counter() - started < 0.5  # sent from the sender thread
    publisher.close(timeout_s=0.1)  # the way out waits a bounded time, then leaves the thread behind
    assert time.perf_counter() - started < 1.5


def test_what_is_buffered_is_sent_on_the_way_out():
    client = RecordingClient()
    publisher = MetricsPublisher(namespace="N", run_name="r", client=client, every=10)
    publisher.step(1, STEP)
    publisher.close()
    assert len(client.calls) == 1 and len(client.calls[0]["MetricData"]) == 5
