"""Shared fixtures: each stack configuration is synthesized once per test session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("JSII_SILENCE_WARNING_END_OF_LIFE_NODE_VERSION", "20")
# Every Ray the tests start (local clusters, `ray start` heads, drivers, `ray job submit`) runs
# with token authentication, as KubeRay runs the pods of a cluster with authOptions.mode token
# (RAY_AUTH_MODE and RAY_AUTH_TOKEN in every container). Ray reads the mode once per process,
# when its core library loads, so this is set before anything imports ray.
os.environ.setdefault("RAY_AUTH_MODE", "token")
os.environ.setdefault("RAY_AUTH_TOKEN", __import__("secrets").token_hex(32))
# The suite is CPU-bound on two cores, and an idle Ray spends CPU on metrics nothing here reads:
# each node's agent collects and exports them every few seconds. Off for the tests' Rays only
# (RayConfig ``enable_metrics_collection``, src/ray/common/ray_config_def.h, set as RAY_<name>);
# the pods keep them (the dashboard, CloudWatch). No usage report either (the machine is offline).
os.environ.setdefault("RAY_enable_metrics_collection", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# Synth must never depend on the machine's AWS set-up.
for _var in ("CDK_DEFAULT_ACCOUNT", "CDK_DEFAULT_REGION", "AWS_REGION", "AWS_DEFAULT_REGION"):
    os.environ.pop(_var, None)

from leftovers import left_behind  # noqa: E402
from platform_synth import Synthesized, synth_platform  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def nothing_left_running():
    """Fails the run when a test left a process, a thread or a Ray behind: it would take the
    next test's CPUs, ports or Ray cluster, and a fresh machine would see what this one hides.
    Session fixtures end in reverse order, so this check comes after every other teardown."""
    yield
    problems = left_behind()
    assert not problems, "left running after the tests: " + "; ".join(problems)


#: The account `cdk deploy` synthesizes the app with: the CDK CLI sets CDK_DEFAULT_ACCOUNT whenever it
#: has credentials, and the ``account`` setting reads it, so the stack is account-specific and its ARNs
#: are concrete. cdk-nag's findings (and our acknowledgments of them) then name the account.
DEPLOY_ACCOUNT = "123456789012"


def as_deployed(region: str = "us-west-2") -> dict:
    """The context `cdk deploy` with credentials gives where no ``availabilityZones`` is set: the
    account, and the region's AZs as the CLI's lookup writes them to cdk.context.json (an
    account-specific stack asks for them)."""
    return {"account": DEPLOY_ACCOUNT, "region": region,
            f"availability-zones:account={DEPLOY_ACCOUNT}:region={region}": [f"{region}{z}" for z in "abcd"]}


@pytest.fixture(scope="session")
def default_platform(tmp_path_factory) -> Synthesized:
    """The default configuration (g6.12xlarge x 2), with an admin role and a narrow CIDR."""
    return synth_platform(
        tmp_path_factory.mktemp("default"),
        {"adminRoleArn": "arn:aws:iam::123456789012:role/Admin", "endpointAccessCidrs": "203.0.113.0/24"},
    )


@pytest.fixture(scope="session")
def p4d_platform(tmp_path_factory) -> Synthesized:
    """A type with four network cards (p4d.24xlarge), pinned AZs, an account, two capacity
    reservations (a capacity reservation group), destroyData, and the idle-GPU alarm's e-mail and other thresholds."""
    return synth_platform(
        tmp_path_factory.mktemp("p4d"),
        {
            "gpuInstanceType": "p4d.24xlarge",
            "gpuNodeCount": "3",
            "account": "123456789012",
            "region": "us-east-1",
            "availabilityZones": "us-east-1b,us-east-1c",
            "capacityReservationIds": "cr-0123456789abcdef0,cr-0123456789abcdef1",
            "destroyData": "true",
            "alarmEmail": "ml-team@example.com",
            "idleGpuUtilizationPercent": "10",
            "idleGpuMinutes": "60",
            "logRetentionDays": "90",
        },
    )


@pytest.fixture(scope="session")
def karpenter_platform(tmp_path_factory) -> Synthesized:
    """The default configuration with GPU capacity from Karpenter (gpuCapacity=karpenter), without tracking,
    synthesized as `cdk deploy` with credentials makes it (:func:`as_deployed`); reserved_platform is
    Karpenter account-agnostic."""
    return synth_platform(
        tmp_path_factory.mktemp("karpenter"),
        {
            **as_deployed(),
            "gpuCapacity": "karpenter",
            "mlflowTracking": "none",
            "adminRoleArn": "arn:aws:iam::123456789012:role/Admin",
            "endpointAccessCidrs": "203.0.113.0/24",
        },
    )


@pytest.fixture(scope="session")
def reserved_platform(tmp_path_factory) -> Synthesized:
    """Karpenter on a p5 Capacity Block alone (a run stops before it ends; issue 59; the fallback orders
    and the user's placement group: tests/test_reservations.py), in a region without SageMaker MLflow
    Apps (ap-southeast-3: mlflowTracking=auto makes none there, and synth says so)."""
    return synth_platform(
        tmp_path_factory.mktemp("reserved"),
        {
            "region": "ap-southeast-3",
            "gpuCapacity": "karpenter",
            "gpuInstanceType": "p5.48xlarge",
            "capacityReservationIds": "cr-0123456789abcdef0",
            "capacityReservationType": "capacity-block",
        },
    )


@pytest.fixture(scope="session")
def queued_platform(tmp_path_factory) -> Synthesized:
    """The default configuration without the CloudWatch add-on, dashboard and alarm, with Kueue
    queueing the Ray jobs (queueing=kueue), logging to the team's SageMaker MLflow tracking server,
    without the account checks (skipAccountChecks), synthesized as `cdk deploy` makes it (:func:`as_deployed`)."""
    return synth_platform(tmp_path_factory.mktemp("queued"), {**as_deployed(), "observability": "false", "queueing": "kueue",
                                                             "skipAccountChecks": "true",
                                                             "trainerRoleArns": "arn:aws:iam::123456789012:role/Trainer",
                                                             "mlflowTrackingUri": TEAM_TRACKING_SERVER})


#: A tracking server the queued platform's runs log to (-c mlflowTrackingUri).
TEAM_TRACKING_SERVER = "arn:aws:sagemaker:us-west-2:123456789012:mlflow-tracking-server/team"


#: How `make test` spreads the suite over the machine's two cores (pytest-xdist, ``-n 2 --dist
#: loadgroup``; a plain ``pytest`` on one process takes the same order): the multi-node Ray runs wait
#: more than they compute (about 60 % of two cores on their own), so the rest of the suite runs beside
#: them. Each group runs whole on one worker, in order:
#: - "preemption": its own Ray cluster, the longest module, so it starts first;
#: - "ray": every other test that starts a Ray (one at a time: a local Ray's dashboard agent
#:   listens on Ray's fixed default port);
#: - "synth": the modules that read the session's synthesized stacks, synthesized once;
#: - "wheel": the example app's, which builds the wheel in the repository's build/ once.
XDIST_GROUPS = {
    "training/test_preemption.py": "preemption",
    "training/test_end_to_end.py": "ray",
    "training/test_data_rows.py": "ray",
    "training/test_best_export.py": "ray",
    # Its session fixture builds the wheel in the repository's build/ (setuptools): on two workers at once
    # one's rmtree pulls the other's build from under it.
    "test_example_app.py": "wheel",
}
SYNTH_FIXTURES = {"default_platform", "p4d_platform", "karpenter_platform", "queued_platform", "reserved_platform"}
FIRST = ("preemption", "ray")


def _xdist_group(item) -> str | None:
    relative = item.path.relative_to(Path(__file__).parent).as_posix()
    if relative in XDIST_GROUPS:
        return XDIST_GROUPS[relative]
    if SYNTH_FIXTURES & set(getattr(item, "fixturenames", ())):
        return "synth"
    return None


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the marks
def pytest_collection_modifyitems(config, items):
    """Marks each test with its xdist group (:data:`XDIST_GROUPS`) and runs the longest groups first,
    so that no worker starts a long module when the other is nearly done."""
    groups = {}
    for item in items:
        group = _xdist_group(item)
        groups[item.nodeid] = group
        if group:
            item.add_marker(pytest.mark.xdist_group(name=group))
    rank = {name: index for index, name in enumerate(FIRST)}
    items.sort(key=lambda item: rank.get(groups[item.nodeid], len(FIRST)))
