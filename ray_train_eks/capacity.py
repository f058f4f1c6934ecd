"""What has to fit on the system nodes, in CPU requests: the DaemonSets of every node, the
cluster's own pods (coredns, the KubeRay operator, Karpenter, the CloudWatch add-on's
operator) and the RayJob's submitter. The Ray head gets what is left, up to half a node.

A pod that does not fit stays Pending, and a RayJob whose submitter is Pending never runs:
that has to be caught at synth, not found an hour into a deploy. The figures are the
requests of the versions this app pins, each with where it comes from; the Kubernetes
scheduler sums requests, not use.
"""

from __future__ import annotations

from dataclasses import dataclass

#: CPU millicores each component requests, and where the figure comes from.
CPU_REQUESTS_M: dict[str, tuple[int, str]] = {
    "aws-node": (50, "vpc-cni add-on DaemonSet: aws-node 25m + aws-eks-nodeagent 25m"),
    "kube-proxy": (100, "kube-proxy add-on DaemonSet"),
    "eks-pod-identity-agent": (0, "aws/eks-charts stable/eks-pod-identity-agent values: resources {}"),
    "cloudwatch-agent": (250, "amazon-cloudwatch-observability 6.4.0 values: agent.resources.requests.cpu"),
    "fluent-bit": (50, "amazon-cloudwatch-observability 6.4.0 values: containerLogs.fluentBit.resources.requests.cpu"),
    "coredns": (100, "coredns add-on, per replica (2 replicas)"),
    "kuberay-operator": (100, "kuberay-operator 1.7.0 values: limits cpu 100m and no requests, so requests = limits"),
    "cloudwatch-observability-operator": (100, "amazon-cloudwatch-observability 6.4.0 values: manager.resources.requests.cpu"),
    "karpenter": (1000, "KarpenterGpuCapacity chart values: controller.resources.requests.cpu, per replica "
                        "(tests/test_helm_render.py renders the chart with them)"),
    "eks-node-monitoring-agent": (10, "eks-node-monitoring-agent v1.7.0 chart values: nodeAgent.resources.requests.cpu "
                                      "(its DCGM DaemonSet runs on NVIDIA instance types only)"),
    "rayjob-submitter": (500, "KubeRay v1.7.0 default submitter pod: ray-operator/controllers/ray/common/job.go"),
    "kueue": (500, "kueue 0.19.2 values: controllerManager.manager.resources.requests.cpu"),
    "stopped-job-watch": (50, "ray_train_eks/workload/stopped_jobs.py watch_container: in the Ray head's pod, beside the head"),
    "serving-head": (350, "ray_train_eks/workload/serving.py: a service's Ray head (SERVING_HEAD_CPU_M, 250m, bursting to "
                          "2 CPUs) and the Ray autoscaler beside it (AUTOSCALER_CPU_M, 100m); one service's room"),
}
#: The head needs at least this much to run the GCS, the dashboard and the job's driver.
MIN_HEAD_CPU_M = 1000


#: What the system nodes' own pods ask of memory besides the heads (coredns, the KubeRay and
#: CloudWatch operators, Karpenter, the agents): an allowance, not a sum of pinned requests.
OTHER_PODS_MEMORY_MIB = 1024
#: The kubelet's share of a node's memory (nodeadm ``getMemoryMebibytesToReserve``: 255 MiB and 11 MiB
#: a pod, taken at 110 pods here, an upper bound) and its hard eviction threshold (100 Mi).
KUBE_RESERVED_MEMORY_MIB = 255 + 11 * 110 + 100


def allocatable_memory_mib(memory_gib: int) -> int:
    """A node's allocatable memory, at most (:data:`KUBE_RESERVED_MEMORY_MIB` less)."""
    return memory_gib * 1024 - KUBE_RESERVED_MEMORY_MIB


def memory_beside_head_mib(memory_gib: int, nodes: int, head_gib: int) -> int:
    """Memory a pod can have on one system node once the training's head runs: another node's (less
    the other pods' allowance) where there are two or more, else what the head's node has left."""
    allocatable = allocatable_memory_mib(memory_gib) - OTHER_PODS_MEMORY_MIB
    return allocatable if nodes >= 2 else allocatable - head_gib * 1024


def allocatable_cpu_m(vcpus: int) -> int:
    """A node's allocatable CPU: its cores less EKS's kube-reserved share (6% of the first
    core, 1% of the second, 0.5% of the third and fourth, 0.25% of the rest; nodeadm's
    ``getCPUMillicoresToReserve``, awslabs/amazon-eks-ami)."""
    total = vcpus * 1000
    reserved = 0
    for start, end, basis_points in ((0, 1000, 600), (1000, 2000, 100), (2000, 4000, 50), (4000, total, 25)):
        if total > start:
            reserved += (min(total, end) - start) * basis_points // 10000
    return total - reserved


@dataclass(frozen=True)
class SystemNodeBudget:
    """The system nodes' CPU, and who takes it before the Ray head."""

    vcpus: int
    nodes: int
    #: Requests of the DaemonSets on every system node, by component.
    per_node: dict[str, int]
    #: Requests of the pods that run once (or once per replica) somewhere on the system nodes.
    once: dict[str, int]
    #: Requests of the other containers of the head's pod (on the head's node).
    beside_head: dict[str, int] = None  # type: ignore[assignment]

    @property
    def room_per_node_m(self) -> int:
        return allocatable_cpu_m(self.vcpus) - sum(self.per_node.values())

    @property
    def head_room_m(self) -> int:
        """CPU left for the Ray head on the node it lands on (with one node: exactly that)."""
        beside = sum((self.beside_head or {}).values())
        return min(self.room_per_node_m, self.nodes * self.room_per_node_m - sum(self.once.values())) - beside

    def head_cpu(self) -> int:
        """Whole CPUs for the head: half a node, or what is left if that is less."""
        return max(0, min(self.vcpus // 2, self.head_room_m // 1000))

    def room_beside_head_m(self, head_cpu: int) -> int:
        """CPU the system nodes have left once the training's head (``head_cpu``) runs: where a
        service's head goes (``serving-head``), or it waits until no training runs."""
        return self.nodes * self.room_per_node_m - sum(self.once.values()) - sum((self.beside_head or {}).values()) \
            - head_cpu * 1000

    def describe(self) -> str:
        taken = {**{f"{name} (per node)": m for name, m in self.per_node.items() if m},
                 **{name: m for name, m in self.once.items() if m},
                 **{f"{name} (in the head's pod)": m for name, m in (self.beside_head or {}).items() if m}}
        return (f"{self.nodes} x {allocatable_cpu_m(self.vcpus)}m allocatable, requested before the head: "
                + ", ".join(f"{name} {m}m" for name, m in taken.items()))


def system_node_budget(*, vcpus: int, nodes: int, observability: bool, karpenter_replicas: int,
                       submitter: bool, node_monitoring: bool = False, kueue: bool = False,
                       stopped_job_watch: bool = False) -> SystemNodeBudget:
    """The budget of this platform's system nodes."""
    cpu = {name: m for name, (m, _source) in CPU_REQUESTS_M.items()}
    per_node = {name: cpu[name] for name in ("aws-node", "kube-proxy", "eks-pod-identity-agent")}
    once = {"coredns x 2": 2 * cpu["coredns"], "kuberay-operator": cpu["kuberay-operator"]}
    if node_monitoring:
        per_node["eks-node-monitoring-agent"] = cpu["eks-node-monitoring-agent"]
    if observability:
        per_node.update({name: cpu[name] for name in ("cloudwatch-agent", "fluent-bit")})
        once["cloudwatch-observability-operator"] = cpu["cloudwatch-observability-operator"]
    if karpenter_replicas:
        once[f"karpenter x {karpenter_replicas}"] = karpenter_replicas * cpu["karpenter"]
    if submitter:
        once["rayjob-submitter"] = cpu["rayjob-submitter"]
    if kueue:
        once["kueue"] = cpu["kueue"]
    beside_head = {"stopped-job-watch": cpu["stopped-job-watch"]} if stopped_job_watch else {}
    return SystemNodeBudget(vcpus=vcpus, nodes=nodes, per_node=per_node, once=once, beside_head=beside_head)
