"""What the dashboard and the idle-GPU alarm read, and what Container Insights costs: one
table of metric names and dimensions, each with the page it comes from, and the arithmetic
of the per-observation bill. No CDK here; ``ray_train_eks.constructs.observability`` builds
from it, and the tests check the synthesized dashboard against it.
"""

from __future__ import annotations

from dataclasses import dataclass

from ray_train_eks.training_code.telemetry.cloudwatch import PREFLIGHT_METRIC, PREFLIGHT_UNIT, STEP_METRICS

#: Container Insights with enhanced observability for Amazon EKS (the add-on's default,
#: "Classic" mode): metric names, dimension sets and units.
ENHANCED_EKS_METRICS_DOC = (
    "https://docs.aws.amazon.com/AmazonCloudWatch/latest/monitoring/Container-Insights-metrics-enhanced-EKS.html"
)
#: Where the training metrics are defined: rank 0 publishes them (training/telemetry/cloudwatch.py).
TRAINING_METRICS_SOURCE = "training/telemetry/cloudwatch.py (STEP_METRICS, PREFLIGHT_METRIC)"
CONTAINER_INSIGHTS = "ContainerInsights"
#: CloudWatch namespace of the training metrics rank 0 publishes; the Ray pods' role may put
#: metrics into this namespace only.
TRAINING_METRICS_NAMESPACE = "RayTrainEks/Training"
#: Pinned release of the amazon-cloudwatch-observability EKS add-on (it installs the
#: aws-observability/helm-charts chart 6.4.0). Newer ones: ``aws eks describe-addon-versions
#: --addon-name amazon-cloudwatch-observability --kubernetes-version 1.36``.
ADDON_VERSION = "v6.4.0-eksbuild.1"
#: The add-on takes its credentials from EKS Pod Identity from this release on.
MIN_POD_IDENTITY_ADDON_VERSION = (3, 1, 0)
#: CloudWatch Logs retention values (days) the API accepts.
LOG_RETENTION_DAYS = (1, 3, 5, 7, 14, 30, 60, 90, 120, 150, 180, 365, 400, 545, 731, 1096, 1827, 2192, 2557, 2922,
                      3288, 3653)

#: Dimension sets (sorted, as a SEARCH schema wants them) that the metric reference lists.
CLUSTER = ("ClusterName",)
NODE = ("ClusterName", "InstanceId", "NodeName")
POD = ("ClusterName", "FullPodName", "Namespace", "PodName")


@dataclass(frozen=True)
class MetricSpec:
    """One CloudWatch metric the dashboard or the alarm reads."""

    namespace: str
    name: str
    #: One dimension set the source lists for this metric, sorted.
    dimensions: tuple[str, ...]
    unit: str
    #: Where the name and the dimension set come from.
    source: str


def _container_insights(name: str, dimensions: tuple[str, ...], unit: str) -> MetricSpec:
    return MetricSpec(CONTAINER_INSIGHTS, name, dimensions, unit, ENHANCED_EKS_METRICS_DOC)


#: Every metric of the dashboard and the alarm, by the role it plays there.
METRICS: dict[str, MetricSpec] = {
    "gpu_utilization": _container_insights("node_gpu_utilization", NODE, "Percent"),
    "gpu_memory_utilization": _container_insights("node_gpu_memory_utilization", NODE, "Percent"),
    # The agent sends power draw without a unit ("None"; watts, but CloudWatch has no such unit).
    "gpu_power_draw": _container_insights("node_gpu_power_draw", NODE, "None"),
    # DCGM_FI_PROF_PIPE_TENSOR_ACTIVE: the ratio of cycles the tensor pipe is busy. Unlike GPU
    # utilisation (any kernel running, a spinning NCCL kernel too) it falls to 0 when a job hangs.
    "gpu_tensor_core_utilization": _container_insights("node_gpu_tensor_core_utilization", NODE, "Percent"),
    "efa_rx_bytes": _container_insights("node_efa_rx_bytes", NODE, "Bytes/Second"),
    "efa_tx_bytes": _container_insights("node_efa_tx_bytes", NODE, "Bytes/Second"),
    "node_count": _container_insights("cluster_node_count", CLUSTER, "Count"),
    # The alarm's (alarms cannot SEARCH): one series per cluster each. The tensor activity of the
    # busiest GPU, and the GPUs the nodes have (from their capacity, through the API server, not
    # DCGM): GPU nodes whose GPU metrics are missing alarm too.
    "cluster_gpu_tensor_core_utilization": _container_insights("node_gpu_tensor_core_utilization", CLUSTER, "Percent"),
    "cluster_gpu_limit": _container_insights("node_gpu_limit", CLUSTER, "Count"),
    "pod_cpu_utilization": _container_insights("pod_cpu_utilization", POD, "Percent"),
    "pod_memory_utilization": _container_insights("pod_memory_utilization", POD, "Percent"),
}
for _name, _key, _unit in STEP_METRICS:
    METRICS[f"training_{_key}"] = MetricSpec("<training>", _name, ("Run",), _unit, TRAINING_METRICS_SOURCE)
METRICS["training_preflight_bus_bandwidth"] = MetricSpec(
    "<training>", PREFLIGHT_METRIC, ("Run", "Transport"), PREFLIGHT_UNIT, TRAINING_METRICS_SOURCE
)


def with_namespace(spec: MetricSpec, training_namespace: str) -> MetricSpec:
    """``spec`` with the training namespace filled in (it is a deploy-time choice)."""
    if spec.namespace != "<training>":
        return spec
    return MetricSpec(training_namespace, spec.name, spec.dimensions, spec.unit, spec.source)


def search_expression(spec: MetricSpec, statistic: str, period_s: int, **equals: str) -> str:
    """A CloudWatch SEARCH expression for every series of ``spec`` (one per node, pod or
    run), narrowed by dimension values ``equals`` (e.g. ``ClusterName=...``)."""
    unknown = sorted(set(equals) - set(spec.dimensions))
    if unknown:
        raise ValueError(f"search_expression: {spec.name} has no dimension {', '.join(unknown)} (it has {spec.dimensions})")
    terms = [f'MetricName="{spec.name}"'] + [f'{key}="{value}"' for key, value in sorted(equals.items())]
    schema = ",".join((f'"{spec.namespace}"' if "/" in spec.namespace else spec.namespace, *spec.dimensions))
    return f"SEARCH('{{{schema}}} {' '.join(terms)}', '{statistic}', {period_s})"


# ---------------------------------------------------------------- what it costs (an estimate)

#: USD per million observations, first tier, us-east-1/us-west-2
#: (https://aws.amazon.com/cloudwatch/pricing/, "Container Insights with enhanced observability").
USD_PER_MILLION_OBSERVATIONS = 0.21
#: USD per month of one custom dashboard, of one standard-resolution alarm metric (the idle-GPU
#: alarm's expression reads two), and of one customer managed KMS key (the logs' and the topic's).
DASHBOARD_USD_PER_MONTH = 3.00
ALARM_USD_PER_MONTH = 2 * 0.10
KMS_KEY_USD_PER_MONTH = 1.00
HOURS_PER_MONTH = 730

#: Observations per minute one object sends: its metrics x their dimension sets, counted from the
#: CloudWatch agent's EMF metric declarations for enhanced Container Insights on EKS
#: (aws/amazon-cloudwatch-agent v1.300070.0, the agent chart 6.4.0 runs:
#: translator/translate/otel/exporter/awsemf/kubernetes.go) and the metric reference above. An
#: observation is one value of one metric for one dimension set; a GPU sends one value into each
#: set of its metrics (the ClusterName set too), an EFA node one per interface into the
#: per-interface set. node_gpu_request and node_gpu_total are no metrics (request is a field of
#: the performance events only; total does not exist).
OBSERVATIONS_PER_MINUTE = {
    "node": 52,  # 19 node metrics x 2 sets, 4 network/disk x 2, 3 filesystem x 2
    "pod": 138,  # 6 x 5 sets (cpu, memory, network), 2 x 4 (dropped packets), 25 x 4 (status, requests)
    "container": 36,  # 12 container metrics x 3 sets
    # node_gpu_* are 7 (utilization, memory utilization/used/total, temperature, power draw, tensor
    # core) x 3 sets; while a pod holds the GPU, pod_gpu_* 7 x 5 and container_gpu_* 7 x 4 too.
    "gpu": 7 * 3 + 7 * 5 + 7 * 4,
    "gpu_idle": 7 * 3,
    "gpu_pod": 4 * 4,  # pod_gpu_request/limit/usage_total/reserved_capacity x 4 sets, per pod holding GPUs
    "gpu_node": 5 * 2,  # node_gpu_limit/usage_total/reserved/unreserved/available_capacity x 2 sets
    "efa_node": 11 * 2 + 5 * 2,  # node_efa_* x 2 sets, node_efa capacity metrics x 2 sets
    "efa_interface": 11,  # node_efa_* into the per-interface set, per EFA interface
    "efa_pod": 11 * 6 + 11 * 4,  # pod_efa_* x 6 sets, container_efa_* x 4 sets
    "cluster": 200,  # cluster_*, namespace_*, service_* and the API-server metrics, per verb/code/resource
}
#: Pods the platform runs, besides the Ray workers (one per GPU node). On every node: aws-node,
#: kube-proxy, eks-pod-identity-agent, cloudwatch-agent, fluent-bit; on GPU nodes also the
#: NVIDIA and EFA device plugins and the DCGM exporter; once: two coredns, the KubeRay
#: operator and the add-on's operator (its cluster scraper, kube-state-metrics and node
#: exporter run in OTel mode only); while a job runs the Ray head and the job submitter.
DAEMON_PODS_PER_NODE = 5
DAEMON_PODS_PER_GPU_NODE = 3
CLUSTER_PODS = 4
JOB_PODS = 2


@dataclass(frozen=True)
class ObservabilityCost:
    """What Container Insights, the dashboard and the alarm add per hour (an estimate)."""

    observations_per_minute: int
    observations_per_minute_idle: int

    @property
    def fixed_usd_per_hour(self) -> float:
        return (DASHBOARD_USD_PER_MONTH + ALARM_USD_PER_MONTH + KMS_KEY_USD_PER_MONTH) / HOURS_PER_MONTH

    @staticmethod
    def observations_usd_per_hour(per_minute: int) -> float:
        return per_minute * 60 * USD_PER_MILLION_OBSERVATIONS / 1e6

    @property
    def usd_per_hour(self) -> float:
        """While a job runs."""
        return self.observations_usd_per_hour(self.observations_per_minute) + self.fixed_usd_per_hour

    @property
    def idle_usd_per_hour(self) -> float:
        """With no job running."""
        return self.observations_usd_per_hour(self.observations_per_minute_idle) + self.fixed_usd_per_hour

    def describe(self) -> str:
        """The arithmetic, in one line."""
        return (
            f"estimate: about {self.observations_per_minute:,} observations/minute while a job runs x 60 x "
            f"{USD_PER_MILLION_OBSERVATIONS} USD per million = "
            f"{self.observations_usd_per_hour(self.observations_per_minute):.3f} USD/hour, "
            f"{self.observations_per_minute_idle:,}/minute idle = "
            f"{self.observations_usd_per_hour(self.observations_per_minute_idle):.3f}; "
            f"dashboard, alarm and key {DASHBOARD_USD_PER_MONTH + ALARM_USD_PER_MONTH + KMS_KEY_USD_PER_MONTH:.2f} USD/month"
        )


def observations_per_minute(*, system_nodes: int, gpu_nodes: int, gpus_per_node: int, efa_per_node: int,
                            job_running: bool) -> int:
    """Container Insights observations per minute of the platform's cluster (an estimate:
    object counts x :data:`OBSERVATIONS_PER_MINUTE`). ``gpu_nodes``: the GPU nodes up."""
    per = OBSERVATIONS_PER_MINUTE
    workers = gpu_nodes if job_running else 0
    pods = (
        (system_nodes + gpu_nodes) * DAEMON_PODS_PER_NODE
        + gpu_nodes * DAEMON_PODS_PER_GPU_NODE
        + CLUSTER_PODS
        + (JOB_PODS + workers if job_running else 0)
    )
    gpus = gpu_nodes * gpus_per_node
    return (
        per["cluster"]
        + (system_nodes + gpu_nodes) * per["node"]
        + pods * (per["pod"] + per["container"])
        + gpus * (per["gpu"] if job_running else per["gpu_idle"])
        + workers * per["gpu_pod"]
        + gpu_nodes * per["gpu_node"]
        + (gpu_nodes * (per["efa_node"] + efa_per_node * per["efa_interface"]) if efa_per_node else 0)
        + (workers * per["efa_pod"] if efa_per_node else 0)
    )


def estimate_observability_cost(*, system_nodes: int, gpu_nodes: int, gpus_per_node: int, efa_per_node: int,
                                gpu_on_demand: bool) -> ObservabilityCost:
    """The cost of Container Insights for one platform; with ``gpu_on_demand`` (Karpenter)
    there are no GPU nodes while no job runs."""
    shape = dict(system_nodes=system_nodes, gpus_per_node=gpus_per_node, efa_per_node=efa_per_node)
    return ObservabilityCost(
        observations_per_minute=observations_per_minute(gpu_nodes=gpu_nodes, job_running=True, **shape),
        observations_per_minute_idle=observations_per_minute(
            gpu_nodes=0 if gpu_on_demand else gpu_nodes, job_running=False, **shape
        ),
    )
