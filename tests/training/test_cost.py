"""What a run costs (training/telemetry/cost.py): each GPU node priced as it is billed, from the labels
Karpenter or EKS put on it (read from the Kubernetes API as a pod reads them, here a stand-in API
server, tests/training/fake_kube.py), and the run's cost so far and at its pace. (The figures in a
run's records, summary and tracker: tests/training/test_end_to_end.py.)"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from training.telemetry.cost import RunCost, earlier_cost, this_node_price

#: The platform the pods run on (ray_train_eks/charts/pods.py): two g6.12xlarge at 4.6016 USD/h each.
PLATFORM = json.dumps({"instance_type": "g6.12xlarge", "node_count": 2, "gpu_usd_per_hour": 9.2032})


class Ec2:
    """Stands in for EC2's DescribeSpotPriceHistory answer (or its refusal)."""

    def __init__(self, price: str | None) -> None:
        self.price, self.asked = price, []

    def describe_spot_price_history(self, **query):
        self.asked.append(query)
        if self.price is None:
            raise RuntimeError("UnauthorizedOperation: ec2:DescribeSpotPriceHistory")
        if isinstance(self.price, list):  # several changes, as EC2 may list them (its order is not documented)
            return {"SpotPriceHistory": [{"SpotPrice": price, "Timestamp": when, "AvailabilityZone": query["AvailabilityZone"]}
                                         for price, when in self.price]}
        return {"SpotPriceHistory": [{"SpotPrice": self.price, "Timestamp": "2026-12-06T04:00:00Z",
                                      "AvailabilityZone": query["AvailabilityZone"]}]}


@pytest.fixture
def api(monkeypatch):
    """A pod's view of its node: the API server with one node, whose labels a test sets (read afresh: no
    earlier read of it in this process)."""
    from fake_kube import FakeKubernetes

    from training.resilience import kube

    monkeypatch.setattr(kube, "_LAST_READ", {})
    found = FakeKubernetes("gpu-node-1")
    monkeypatch.setenv("RAY_TRAIN_EKS_KUBE_API", found.url)
    monkeypatch.setenv("RAY_TRAIN_EKS_NODE_NAME", "gpu-node-1")
    yield found
    found.server.shutdown()


@pytest.fixture
def node(api):
    """The node's metadata, whose labels a test sets."""
    return api.nodes["gpu-node-1"]["metadata"]


BASE = {"node.kubernetes.io/instance-type": "g6.12xlarge", "topology.kubernetes.io/zone": "us-west-2a"}


@pytest.mark.parametrize("labels, spot, expected_usd, basis", [
    ({"karpenter.sh/capacity-type": "on-demand"}, None, 4.6016, "On-Demand"),
    ({"eks.amazonaws.com/capacityType": "ON_DEMAND"}, None, 4.6016, "On-Demand"),
    ({"karpenter.sh/capacity-type": "spot"}, "1.9872", 1.9872, "Spot at 1.9872 USD/h in us-west-2a"),
    ({"eks.amazonaws.com/capacityType": "SPOT"}, "1.9872", 1.9872, "Spot at 1.9872 USD/h in us-west-2a"),
    ({"karpenter.sh/capacity-type": "spot"}, None, 4.6016, "the On-Demand price, its ceiling"),
    ({"karpenter.sh/capacity-type": "reserved", "karpenter.k8s.aws/capacity-reservation-type": "default"}, None, 4.6016,
     "capacity reservation, billed at the On-Demand rate used or not"),
    ({"karpenter.sh/capacity-type": "reserved", "karpenter.k8s.aws/capacity-reservation-type": "capacity-block"}, None,
     4.6016, "Capacity Block, paid up front: the On-Demand rate as an estimate"),
    ({"eks.amazonaws.com/capacityType": "CAPACITY_BLOCK"}, None, 4.6016, "Capacity Block, paid up front"),
], ids=["karpenter-on-demand", "nodegroup-on-demand", "karpenter-spot", "nodegroup-spot", "spot-price-unreadable",
        "reservation", "karpenter-capacity-block", "nodegroup-capacity-block"])
def test_a_gpu_node_is_priced_as_it_is_billed_from_its_labels(node, monkeypatch, labels, spot, expected_usd, basis):
    monkeypatch.setenv("RAY_TRAIN_EKS_PLATFORM", PLATFORM)
    node["labels"] = {**BASE, **labels}
    ec2 = Ec2(spot)
    price = this_node_price(SimpleNamespace(gpu_usd_per_hour=None), ec2=ec2)
    assert price.usd_per_hour == pytest.approx(expected_usd) and basis in price.basis, price
    if ec2.asked:  # the node's own type and zone
        assert ec2.asked[0]["InstanceTypes"] == ["g6.12xlarge"] and ec2.asked[0]["AvailabilityZone"] == "us-west-2a"


def test_the_spot_price_is_the_latest_change_as_of_now_in_whatever_order_ec2_lists_them(node, monkeypatch):
    """DescribeSpotPriceHistory asked for now (StartTime = EndTime = now, UTC: the documented form, which also
    returns the last change before the start, the price in effect); its answer's order is not documented, so
    an answer listed oldest first (this stand-in's) still gives the latest change."""
    import datetime

    monkeypatch.setenv("RAY_TRAIN_EKS_PLATFORM", PLATFORM)
    node["labels"] = {**BASE, "karpenter.sh/capacity-type": "spot"}
    hour = datetime.timedelta(hours=1)
    now = datetime.datetime.now(datetime.timezone.utc)
    ec2 = Ec2([("2.4100", now - 3 * hour), ("1.9872", now - hour), ("2.2000", now - 2 * hour)])
    price = this_node_price(SimpleNamespace(gpu_usd_per_hour=None), ec2=ec2)
    assert price.usd_per_hour == pytest.approx(1.9872), price
    asked = ec2.asked[0]
    assert asked["StartTime"] == asked["EndTime"] and asked["StartTime"].tzinfo is not None
    assert abs(asked["StartTime"] - now) < datetime.timedelta(minutes=1) and "MaxResults" not in asked


def test_a_rate_given_for_a_capacity_block_is_the_nodes_price(node, monkeypatch):
    """EC2's API does not return what a bought Capacity Block cost: --gpu-usd-per-hour gives it."""
    monkeypatch.setenv("RAY_TRAIN_EKS_PLATFORM", PLATFORM)
    node["labels"] = {**BASE, "eks.amazonaws.com/capacityType": "CAPACITY_BLOCK"}
    price = this_node_price(SimpleNamespace(gpu_usd_per_hour=3.25))
    assert (price.usd_per_hour, price.basis) == (3.25, "--gpu-usd-per-hour")


def test_the_price_takes_the_labels_the_preflight_read_adding_no_call(api, node, monkeypatch):
    """The node's first worker read the node at the preflight (its conditions); the price reads nothing more
    (the node monitoring agent's fault shows at a known read: tests/training/test_preemption.py counts them)."""
    from training.resilience.health import node_condition_fault

    monkeypatch.setenv("RAY_TRAIN_EKS_PLATFORM", PLATFORM)
    node["labels"] = {**BASE, "karpenter.sh/capacity-type": "on-demand"}
    assert node_condition_fault("gpu-node-1") is None  # the preflight's read
    assert this_node_price(SimpleNamespace(gpu_usd_per_hour=None)).basis == "On-Demand"
    assert api.gets["gpu-node-1"] == 1


def test_the_runs_cost_so_far_and_at_its_pace_count_every_node_and_the_earlier_invocations():
    """Two nodes (one Spot, one On-Demand), an hour and a half since the job started, 12.5 USD spent by
    earlier invocations, 100 steps left at a median of 36 s."""
    from training.telemetry.cost import NodePrice

    spot, on_demand = NodePrice(1.9872, "Spot at 1.9872 USD/h in us-west-2a"), NodePrice(4.6016, "On-Demand")
    cost = RunCost.of([spot, None, None, None, on_demand, None, None, None], started=1000.0, earlier_usd=12.5)
    assert cost.usd_per_hour == pytest.approx(6.5888) and cost.nodes == 2
    assert cost.basis == "On-Demand; Spot at 1.9872 USD/h in us-west-2a"
    now = 1000.0 + 1.5 * 3600
    assert cost.so_far(now) == pytest.approx(12.5 + 6.5888 * 1.5)
    assert cost.projected(steps_left=100, step_seconds=[90.0, 36.0, 35.0, 37.0], now=now) == pytest.approx(
        12.5 + 6.5888 * 1.5 + 6.5888 * 100 * 37.0 / 3600)  # the median of the recent steps, warm-up and all
    assert RunCost.from_record(json.loads(json.dumps(cost.record()))).so_far(now) == pytest.approx(cost.so_far(now))
    assert RunCost.of([None, NodePrice(None, "On-Demand")], started=0.0, earlier_usd=0.0) is None  # unknown: no figure


def test_a_restarted_or_resized_worker_group_counts_on_from_the_last_steps_figure_at_its_own_nodes():
    """An elastic run on two nodes (9.2 USD/h) lost one at step 40 and goes on with the other (4.6): from
    the last step's figure on, the new group's rate; a record of an earlier invocation changes nothing."""
    from training.telemetry.cost import NodePrice

    cost = RunCost.of([NodePrice(4.6016, "On-Demand"), None], started=1000.0, earlier_usd=1.5)
    cost.continue_from({"step": 40, "cost_usd": 10.7, "time": 4600.0})
    assert cost.so_far(4600.0 + 1800) == pytest.approx(10.7 + 4.6016 / 2)
    fresh = RunCost.of([NodePrice(4.6016, "On-Demand")], started=5000.0, earlier_usd=10.7)
    fresh.continue_from({"step": 40, "cost_usd": 10.7, "time": 4600.0})  # the invocation before this one
    assert (fresh.started, fresh.earlier_usd) == (5000.0, 10.7)


def test_a_resumed_run_counts_what_its_earlier_invocations_cost(tmp_path):
    """The last figure recorded: a step's cost_usd (an invocation that never reached its end) or a finished
    one's summary."""
    assert earlier_cost(str(tmp_path)) == 0.0
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0, "cost_usd": 0.5 * s}) + "\n"
                                                    for s in (1, 2, 3)))
    assert earlier_cost(str(tmp_path)) == 1.5
    (tmp_path / "summary.json").write_text(json.dumps({"cost": {"usd": 2.25}}))
    assert earlier_cost(str(tmp_path)) == 2.25


def _rfc3339(when: float) -> str:
    import datetime

    return datetime.datetime.fromtimestamp(when, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@pytest.mark.parametrize("created_before_driver_s, cluster_before_driver_s, counted_s", [
    (480, 600, 480),    # a RayJob's own cluster: the node launched after the cluster's head, 8 min of boot and image pull
    (7200, 600, 600),   # a node up before (another job's, kept by Karpenter): from the cluster's start
    (7200, 5 * 3600, 0),  # a standing RayCluster, up for hours: its idle time is not this job's
], ids=["jobs-own-cluster", "node-older-than-the-cluster", "standing-cluster"])
def test_a_nodes_time_before_the_driver_starts_is_counted_where_the_cluster_was_made_for_the_job(
        node, monkeypatch, created_before_driver_s, cluster_before_driver_s, counted_s):
    """GPU nodes are billed from launch: KubeRay submits the driver only once the cluster's pods are up (the
    nodes booted, the image pulled). Each node counts from the later of its Kubernetes node's
    creationTimestamp (as the preflight read it) and the Ray cluster's start (its session's name), where the
    cluster started under an hour before the driver."""
    from training.telemetry.cost import cluster_started

    monkeypatch.setenv("RAY_TRAIN_EKS_PLATFORM", PLATFORM)
    driver = 1_800_000_000.0
    node["labels"] = {**BASE, "karpenter.sh/capacity-type": "on-demand"}
    node["creationTimestamp"] = _rfc3339(driver - created_before_driver_s)
    import datetime

    session = datetime.datetime.fromtimestamp(driver - cluster_before_driver_s).strftime("session_%Y-%m-%d_%H-%M-%S_%f_4242")
    price = this_node_price(SimpleNamespace(gpu_usd_per_hour=None), started=driver, cluster_start=cluster_started(session))
    cost = RunCost.of([price, None], started=driver, earlier_usd=1.0)
    assert cost.before_start_usd == pytest.approx(4.6016 * counted_s / 3600)
    assert cost.so_far(driver + 3600) == pytest.approx(1.0 + 4.6016 * (counted_s + 3600) / 3600)
    assert RunCost.from_record(json.loads(json.dumps(cost.record()))).so_far(driver) == pytest.approx(cost.so_far(driver), abs=1e-4)
    cost.continue_from({"step": 40, "cost_usd": 3.0, "time": driver + 60})  # a restart: the last step's figure has it
    assert cost.so_far(driver + 60) == pytest.approx(3.0)


def test_the_ray_clusters_start_is_read_from_its_session_name_in_the_heads_local_time():
    """Ray 2.58 names a session ``session_%Y-%m-%d_%H-%M-%S_%f_<pid>`` from the head's local clock
    (ray/_private/node.py); a name of another form gives no start (the nodes then count from the driver's)."""
    import datetime

    from training.telemetry.cost import cluster_started

    assert cluster_started("session_2026-12-06_08-14-28_123456_4242") == datetime.datetime(
        2026, 12, 6, 8, 14, 28, 123456).timestamp()
    assert cluster_started("session_latest") is None
