"""The CloudWatch publisher of the training metrics, with a stubbed client."""

from __future__ import annotations

import pytest

from training.cloudwatch import METRICS_NAMESPACE_ENV, MetricsPublisher, publisher_from_env


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
    publisher = MetricsPublisher(namespace="RayTrainEks/Training", run_name="qwen-sft", client=client, every=2)
    publisher.step(1, STEP)
    assert client.calls == []  # buffered until the second step
    publisher.step(2, {**STEP, "loss": 2.0})
    (call,) = client.calls
    assert call["Namespace"] == "RayTrainEks/Training"
    data = call["MetricData"]
    assert [(d["MetricName"], d["Value"], d["Unit"]) for d in data[:5]] == [
        ("Loss", 2.5, "None"), ("TokensPerSecond", 12000.0, "Count/Second"), ("MFU", 41.5, "Percent"),
        ("StepTime", 0.8, "Seconds"), ("GradientNorm", 1.25, "None"),
    ]
    assert data[5] == {"MetricName": "Loss", "Dimensions": [{"Name": "Run", "Value": "qwen-sft"}], "Value": 2.0, "Unit": "None"}
    assert all(d["Dimensions"] == [{"Name": "Run", "Value": "qwen-sft"}] for d in data)


def test_preflight_bandwidth_goes_with_its_transport_and_a_missing_mfu_is_skipped():
    client = RecordingClient()
    publisher = MetricsPublisher(namespace="N", run_name="r", client=client, every=1)
    publisher.preflight(transport="efa", bus_bandwidth_gbps=87.5)
    publisher.step(1, {**STEP, "mfu_percent": None})
    preflight, step = client.calls
    assert preflight["MetricData"] == [{"MetricName": "PreflightBusBandwidth", "Value": 87.5, "Unit": "Gigabytes/Second",
                                        "Dimensions": [{"Name": "Run", "Value": "r"}, {"Name": "Transport", "Value": "efa"}]}]
    assert "MFU" not in [d["MetricName"] for d in step["MetricData"]]


def test_a_failing_client_is_logged_once_and_never_raises():
    client, lines = RecordingClient(fail=True), []
    publisher = MetricsPublisher(namespace="N", run_name="r", client=client, every=1, log=lines.append)
    for step in range(1, 4):
        publisher.step(step, STEP)  # must not raise
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
    from training.cloudwatch import PREFLIGHT_UNIT
    from training.preflight import bus_bandwidth_gbps

    # nccl-tests' bus bandwidth: 1e9 bytes all-reduced by 2 ranks in 1 s moves 1e9 x 2(2-1)/2 bytes/s.
    assert bus_bandwidth_gbps(size_bytes=10**9, seconds=1.0, world_size=2) == 1.0
    assert PREFLIGHT_UNIT == "Gigabytes/Second"
