"""Instance facts the platform relies on: one table, used by the node groups, the cost
estimate and the Ray pod sizing.

Prices are Linux on-demand USD per hour in us-east-1/us-west-2 (AWS price list,
checked Nov 2026); other regions differ by a few percent. EFA interface counts are the
number of network cards: the launch template gets one EFA interface per card. Instance
storage is the local NVMe of each type (disks x GB), from the EC2 instance type
specifications ("Accelerated computing" and "General purpose" instance store volumes,
https://docs.aws.amazon.com/ec2/latest/instancetypes/), the totals matching Karpenter 1.14's
generated instance-type table.
"""

from __future__ import annotations

from dataclasses import dataclass

from ray_train_eks.observability import ObservabilityCost, estimate_observability_cost

#: EKS control plane, standard support, USD per hour.
EKS_CONTROL_PLANE_USD_PER_HOUR = 0.10
#: One NAT gateway, USD per hour (data processing is billed per GB on top).
NAT_GATEWAY_USD_PER_HOUR = 0.045


@dataclass(frozen=True, kw_only=True)
class InstanceSpec:
    """What the platform needs to know about one EC2 instance type."""

    name: str
    vcpus: int
    memory_gib: int
    on_demand_usd_per_hour: float
    gpus: int = 0
    gpu_model: str | None = None
    gpu_memory_gib: int = 0
    network_cards: int = 1
    efa: bool = False
    #: Local NVMe instance store: disks x GB each (0: none).
    instance_store_disks: int = 0
    instance_store_disk_gb: int = 0

    @property
    def instance_store_gb(self) -> int:
        """Total local NVMe, GB (0: none): nodeadm's RAID0 spans it."""
        return self.instance_store_disks * self.instance_store_disk_gb

    @property
    def efa_interfaces(self) -> int:
        """EFA interfaces a node of this type carries: one per network card, 0 without EFA."""
        return self.network_cards if self.efa else 0


_TABLE = [
    # NVIDIA L4 (24 GB): the g6 family. EFA only from 8xlarge up; no GPUDirect RDMA.
    InstanceSpec(name="g6.xlarge", vcpus=4, memory_gib=16, gpus=1, gpu_model="L4", gpu_memory_gib=24, on_demand_usd_per_hour=0.8048, instance_store_disks=1, instance_store_disk_gb=250),
    InstanceSpec(name="g6.2xlarge", vcpus=8, memory_gib=32, gpus=1, gpu_model="L4", gpu_memory_gib=24, on_demand_usd_per_hour=0.9776, instance_store_disks=1, instance_store_disk_gb=450),
    InstanceSpec(name="g6.4xlarge", vcpus=16, memory_gib=64, gpus=1, gpu_model="L4", gpu_memory_gib=24, on_demand_usd_per_hour=1.3232, instance_store_disks=1, instance_store_disk_gb=600),
    InstanceSpec(name="g6.8xlarge", vcpus=32, memory_gib=128, gpus=1, gpu_model="L4", gpu_memory_gib=24, efa=True, on_demand_usd_per_hour=2.0144, instance_store_disks=2, instance_store_disk_gb=450),
    InstanceSpec(name="g6.12xlarge", vcpus=48, memory_gib=192, gpus=4, gpu_model="L4", gpu_memory_gib=24, efa=True, on_demand_usd_per_hour=4.6016, instance_store_disks=4, instance_store_disk_gb=940),
    InstanceSpec(name="g6.16xlarge", vcpus=64, memory_gib=256, gpus=1, gpu_model="L4", gpu_memory_gib=24, efa=True, on_demand_usd_per_hour=3.3968, instance_store_disks=2, instance_store_disk_gb=940),
    InstanceSpec(name="g6.24xlarge", vcpus=96, memory_gib=384, gpus=4, gpu_model="L4", gpu_memory_gib=24, efa=True, on_demand_usd_per_hour=6.6752, instance_store_disks=4, instance_store_disk_gb=940),
    InstanceSpec(name="g6.48xlarge", vcpus=192, memory_gib=768, gpus=8, gpu_model="L4", gpu_memory_gib=24, efa=True, on_demand_usd_per_hour=13.3504, instance_store_disks=8, instance_store_disk_gb=940),
    InstanceSpec(name="gr6.8xlarge", vcpus=32, memory_gib=256, gpus=1, gpu_model="L4", gpu_memory_gib=24, efa=True, on_demand_usd_per_hour=2.4464, instance_store_disks=2, instance_store_disk_gb=450),
    # NVIDIA A10G (24 GB).
    InstanceSpec(name="g5.48xlarge", vcpus=192, memory_gib=768, gpus=8, gpu_model="A10G", gpu_memory_gib=24, efa=True, on_demand_usd_per_hour=16.288, instance_store_disks=2, instance_store_disk_gb=3800),
    # NVIDIA A100 40 GB: 4 network cards, so 4 EFA interfaces.
    InstanceSpec(name="p4d.24xlarge", vcpus=96, memory_gib=1152, gpus=8, gpu_model="A100", gpu_memory_gib=40, network_cards=4, efa=True, on_demand_usd_per_hour=21.9576, instance_store_disks=8, instance_store_disk_gb=1000),
    # NVIDIA H100 80 GB: 32 network cards.
    InstanceSpec(name="p5.48xlarge", vcpus=192, memory_gib=2048, gpus=8, gpu_model="H100", gpu_memory_gib=80, network_cards=32, efa=True, on_demand_usd_per_hour=55.04, instance_store_disks=8, instance_store_disk_gb=3800),
    # NVIDIA H200 141 GB: 16 network cards.
    InstanceSpec(name="p5en.48xlarge", vcpus=192, memory_gib=2048, gpus=8, gpu_model="H200", gpu_memory_gib=141, network_cards=16, efa=True, on_demand_usd_per_hour=63.296, instance_store_disks=8, instance_store_disk_gb=3800),
    # CPU types for the system node group (operator, Ray head, cluster add-ons).
    InstanceSpec(name="m7i.large", vcpus=2, memory_gib=8, on_demand_usd_per_hour=0.1008),
    InstanceSpec(name="m7i.xlarge", vcpus=4, memory_gib=16, on_demand_usd_per_hour=0.2016),
    InstanceSpec(name="m7i.2xlarge", vcpus=8, memory_gib=32, on_demand_usd_per_hour=0.4032),
    InstanceSpec(name="m7i.4xlarge", vcpus=16, memory_gib=64, on_demand_usd_per_hour=0.8064),
    InstanceSpec(name="m6i.xlarge", vcpus=4, memory_gib=16, on_demand_usd_per_hour=0.192),
    InstanceSpec(name="m6i.2xlarge", vcpus=8, memory_gib=32, on_demand_usd_per_hour=0.384),
    InstanceSpec(name="m5.xlarge", vcpus=4, memory_gib=16, on_demand_usd_per_hour=0.192),
    InstanceSpec(name="m5.2xlarge", vcpus=8, memory_gib=32, on_demand_usd_per_hour=0.384),
    # With local NVMe: the system nodes' image pulls and the Ray head's scratch on it.
    InstanceSpec(name="m6id.xlarge", vcpus=4, memory_gib=16, on_demand_usd_per_hour=0.2373, instance_store_disks=1, instance_store_disk_gb=237),
    InstanceSpec(name="m6id.2xlarge", vcpus=8, memory_gib=32, on_demand_usd_per_hour=0.4746, instance_store_disks=1, instance_store_disk_gb=474),
    InstanceSpec(name="m6id.4xlarge", vcpus=16, memory_gib=64, on_demand_usd_per_hour=0.9492, instance_store_disks=1, instance_store_disk_gb=950),
]

INSTANCE_TYPES: dict[str, InstanceSpec] = {spec.name: spec for spec in _TABLE}

#: The regions of ray_train_eks/regions.py where the table's instance families are not offered, every
#: size of a family alike. Source: cfn-lint 1.58.0's E3628 data
#: (``cfnlint/data/schemas/extensions/aws_ec2_instance/instancetype_enum.json``, from the EC2 price
#: list of each region). A snapshot: AWS adds types to regions, so synth only warns, and the deploy's
#: account checks ask EC2 (``DescribeInstanceTypeOfferings``) in its first minute. tests/test_regions.py
#: compares it, type by type, with cfn-lint's data.
_G6_ABSENT = frozenset({"af-south-1", "ap-east-1", "ap-east-2", "ap-northeast-3", "ap-southeast-1", "ap-southeast-3",
                        "ap-southeast-4", "ap-southeast-6", "ap-southeast-7", "ca-west-1", "eu-south-1", "eu-west-1",
                        "il-central-1", "me-south-1", "mx-central-1", "us-west-1"})
NOT_OFFERED_IN: dict[str, frozenset[str]] = {
    "g6": _G6_ABSENT,
    "gr6": _G6_ABSENT | {"ap-south-2", "me-central-1"},
    "g5": frozenset({"af-south-1", "ap-east-2", "ap-northeast-3", "ap-south-2", "ap-southeast-1", "ap-southeast-4",
                     "ap-southeast-5", "ap-southeast-6", "ap-southeast-7", "ca-west-1", "eu-central-2", "eu-south-1",
                     "me-south-1", "mx-central-1", "us-west-1"}),
    "p4d": frozenset({"af-south-1", "ap-east-1", "ap-east-2", "ap-northeast-3", "ap-south-2", "ap-southeast-3",
                      "ap-southeast-4", "ap-southeast-5", "ap-southeast-6", "ap-southeast-7", "ca-west-1", "eu-central-2",
                      "eu-south-1", "eu-south-2", "eu-west-3", "il-central-1", "me-central-1", "me-south-1",
                      "mx-central-1", "us-west-1"}),
    "p5": frozenset({"af-south-1", "ap-east-1", "ap-east-2", "ap-northeast-3", "ap-south-2", "ap-southeast-1",
                     "ap-southeast-4", "ap-southeast-5", "ap-southeast-6", "ap-southeast-7", "ca-west-1", "eu-central-1",
                     "eu-central-2", "eu-south-1", "eu-south-2", "eu-west-1", "eu-west-3", "il-central-1", "me-central-1",
                     "me-south-1", "mx-central-1"}),
    "p5en": frozenset({"af-south-1", "ap-east-1", "ap-east-2", "ap-northeast-3", "ap-south-2", "ap-southeast-1",
                       "ap-southeast-2", "ap-southeast-4", "ap-southeast-5", "ap-southeast-6", "ap-southeast-7",
                       "ca-central-1", "ca-west-1", "eu-central-1", "eu-central-2", "eu-south-1", "eu-west-1", "eu-west-2",
                       "eu-west-3", "il-central-1", "me-south-1", "mx-central-1", "sa-east-1"}),
    "m7i": frozenset({"ca-west-1", "me-south-1"}),
    "m6i": frozenset({"ap-southeast-4", "eu-south-2"}),
    "m5": frozenset({"ap-east-2", "ap-southeast-5", "ap-southeast-6", "ap-southeast-7", "mx-central-1"}),
    "m6id": frozenset({"af-south-1", "ap-east-1", "ap-northeast-3", "ap-south-2", "ap-southeast-3", "ap-southeast-4",
                       "eu-north-1", "eu-west-3", "me-central-1", "me-south-1"}),
}


def offered_in(instance_type: str, region: str) -> bool:
    """Whether ``instance_type`` (of the table) is offered in ``region``, as far as :data:`NOT_OFFERED_IN` knows."""
    return region not in NOT_OFFERED_IN.get(instance_type.split(".")[0], frozenset())


def not_offered_note(key: str, instance_type: str, region: str) -> str | None:
    """What synth says when the context key ``key``'s ``instance_type`` is not offered in ``region``
    (None: it is, or the table does not know the type), with the table's types of its kind that are."""
    spec = INSTANCE_TYPES.get(instance_type)
    if spec is None or offered_in(instance_type, region):
        return None
    kind = gpu_efa_instance_types() if spec.gpus else cpu_instance_types()
    there = [name for name in kind if offered_in(name, region)]
    # The account checks read the GPU type's offerings in its AZ; nothing reads the system type's before its node group.
    when = ("the deploy's account checks ask EC2 in their first minute" if spec.gpus else
            "else the system node group fails some 20 minutes into the deploy")
    return (f"{key}={instance_type!r} is not offered in {region} (EC2's price list as cfn-lint 1.58.0 has it), so its "
            f"nodes would not launch; offered there: {', '.join(there) or 'none of the table'}, or deploy to another "
            f"region ({when})")


def gpu_efa_instance_types() -> list[str]:
    """Names of the GPU types in the table that support EFA, for error messages."""
    return sorted(name for name, spec in INSTANCE_TYPES.items() if spec.gpus and spec.efa)


def cpu_instance_types() -> list[str]:
    """Names of the CPU-only types in the table (system node group candidates)."""
    return sorted(name for name, spec in INSTANCE_TYPES.items() if not spec.gpus)


@dataclass(frozen=True, kw_only=True)
class CostEstimate:
    """Hourly cost of one platform configuration while it is up."""

    gpu_nodes_usd: float
    system_nodes_usd: float
    #: True when the GPU nodes exist only while a job runs (Karpenter).
    gpu_on_demand: bool = False
    control_plane_usd: float = EKS_CONTROL_PLANE_USD_PER_HOUR
    nat_gateway_usd: float = NAT_GATEWAY_USD_PER_HOUR
    #: Container Insights, the dashboard and the alarm (an estimate); None without them.
    observability: ObservabilityCost | None = None
    #: The GPU nodes are Spot: the figures stay on-demand's, an upper bound.
    gpu_spot: bool = False
    #: A SageMaker MLflow App for the runs: serverless, no hourly charge (its artifacts are S3's).
    mlflow_app: bool = False
    #: The GPU nodes launch into reservations: ``default`` (On-Demand Capacity Reservations) or
    #: ``capacity-block``; None: none.
    gpu_reserved: str | None = None
    #: GPU nodes served models' replicas may take, one's price an hour, and whether they are nodes of
    #: their own (Karpenter's serving NodePool) or the GPU node group's (nothing more, a job waits).
    serving_gpu_nodes: int = 0
    serving_node_usd: float = 0.0
    serving_own_nodes: bool = False
    #: Minutes a replica, then its GPU node, stays without a request.
    serving_idle_minutes: int = 15

    @property
    def serving_usd(self) -> float:
        """Hourly cost more while served models answer, at most: their own GPU nodes, all taken. Idle it
        is nothing: a service's head runs on the system nodes and its GPU nodes go after the idle minutes."""
        return round(self.serving_gpu_nodes * self.serving_node_usd, 4) if self.serving_own_nodes else 0.0

    def describe_serving(self) -> str:
        """What serving adds, idle and answering; empty without serving."""
        if not self.serving_gpu_nodes:
            return ""
        if not self.serving_own_nodes:
            return ("; serving: nothing more, idle or answering (its replicas take the GPU node group's nodes, and a job "
                    "waits for them; a service's head runs on the system nodes)")
        return (f"; serving: 0.00 idle (a service's head runs on the system nodes; its GPU nodes go "
                f"{self.serving_idle_minutes} min after the last request), up to {self.serving_usd:.2f} more while served "
                f"models answer ({self.serving_gpu_nodes} GPU node(s) at {self.serving_node_usd:.2f})")

    @property
    def observability_usd(self) -> float:
        return self.observability.usd_per_hour if self.observability else 0.0

    @property
    def total_usd(self) -> float:
        """Sum of every hourly item."""
        return (self.gpu_nodes_usd + self.system_nodes_usd + self.control_plane_usd + self.nat_gateway_usd
                + self.observability_usd)

    @property
    def idle_usd(self) -> float:
        """Hourly cost with no job running: without the GPU nodes when they come on demand."""
        gpu = self.gpu_nodes_usd if self.gpu_on_demand else 0.0
        observability = self.observability_usd - self.observability.idle_usd_per_hour if self.observability else 0.0
        return self.total_usd - gpu - observability

    def describe(self) -> str:
        """One line a person reads at synth: running and idle figures, and what makes them up."""
        idle = (
            f"idle {self.idle_usd:.2f} (Karpenter removes the GPU nodes when no job runs)"
            if self.gpu_on_demand
            else f"idle {self.idle_usd:.2f} (the GPU node group stays up; -c gpuCapacity=karpenter removes it between jobs)"
        )
        observability = (
            f" + Container Insights {self.observability_usd:.2f} ({self.observability.describe()})" if self.observability else ""
        )
        spot = (" (GPU nodes on Spot: their price varies by AZ and hour, usually well below on-demand's; see "
                "https://aws.amazon.com/ec2/spot/pricing/ or aws ec2 describe-spot-price-history; these figures are "
                "on-demand's, an upper bound)") if self.gpu_spot else ""
        spot += {
            None: "",
            # EC2 User Guide, "Capacity Reservation pricing and billing"; "Capacity Blocks pricing and billing".
            "default": (" (GPU nodes in On-Demand Capacity Reservations: a reservation bills at the On-Demand rate "
                        "while it stands, used or not, so an idle GPU node saves nothing until it is cancelled)"),
            "capacity-block": (" (GPU nodes on Capacity Blocks: the block was paid up front when booked, for its whole "
                               "duration; these figures are On-Demand's, for comparison)"),
        }[self.gpu_reserved]
        return (
            f"{self.total_usd:.2f} USD/hour on demand while a job runs{spot} = GPU nodes {self.gpu_nodes_usd:.2f}"
            f" + system nodes {self.system_nodes_usd:.2f} + EKS control plane {self.control_plane_usd:.2f}"
            f" + NAT gateway {self.nat_gateway_usd:.3f}{observability}"
            f"{' + MLflow App 0.00 (serverless, no hourly charge)' if self.mlflow_app else ''}; {idle}"
            f"{self.describe_serving()} (S3, CloudWatch Logs and data transfer extra)"
        )


def estimate_cost(*, gpu_instance_type: str, gpu_node_count: int, system_instance_type: str, system_node_count: int,
                  gpu_on_demand: bool = False, observability: bool = False, gpu_spot: bool = False,
                  mlflow_app: bool = False, gpu_reserved: str | None = None, serving_gpu_nodes: int = 0,
                  serving_idle_minutes: int = 15) -> CostEstimate:
    """Hourly on-demand cost of the instances, the EKS control plane and the NAT gateway;
    ``gpu_on_demand``: the GPU nodes exist only while a job runs (and served models' GPU nodes are
    Karpenter's too: nodes of their own); ``observability``: with Container Insights, the dashboard and
    the alarm; ``serving_gpu_nodes``: GPU nodes served models' replicas may take."""
    gpu = INSTANCE_TYPES[gpu_instance_type]
    system = INSTANCE_TYPES[system_instance_type]
    return CostEstimate(
        gpu_nodes_usd=round(gpu.on_demand_usd_per_hour * gpu_node_count, 4),
        system_nodes_usd=round(system.on_demand_usd_per_hour * system_node_count, 4),
        gpu_on_demand=gpu_on_demand,
        gpu_spot=gpu_spot,
        observability=estimate_observability_cost(
            system_nodes=system_node_count, gpu_nodes=gpu_node_count, gpus_per_node=gpu.gpus,
            efa_per_node=gpu.efa_interfaces, gpu_on_demand=gpu_on_demand,
        ) if observability else None,
        mlflow_app=mlflow_app,
        gpu_reserved=gpu_reserved,
        serving_gpu_nodes=serving_gpu_nodes,
        serving_node_usd=gpu.on_demand_usd_per_hour,
        serving_own_nodes=gpu_on_demand,
        serving_idle_minutes=serving_idle_minutes,
    )
