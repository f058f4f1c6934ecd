"""GPU capacity on demand: Karpenter launches EFA GPU nodes while Ray pods need them and
removes them when they are empty.

Karpenter 1.14.1 (the chart, the controller's IAM and the interruption queue of the upstream
getting-started reference, written down in ``karpenter_iam.py`` beside this module), an
EC2NodeClass with the EFA wiring of :class:`EfaNodeGroup` (its security group, a cluster
placement group, IMDSv2, an encrypted gp3 root volume) and a NodePool of one instance type.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence

from aws_cdk import Acknowledgment, Annotations, Duration, Fn, Stack, Validations, aws_ec2 as ec2, aws_eks_v2 as eks, aws_events as events, aws_events_targets as targets
from aws_cdk import aws_iam as iam, aws_sqs as sqs
from constructs import Construct

from ray_train_eks.constructs.addons import HELM_TIMEOUT
from ray_train_eks.constructs.efa_node_group import (
    GPU_TAINT,
    NVIDIA_PRESENT_LABEL,
    capacity_type_problem,  # noqa: F401 - importable from here, as before reservations
    efa_gpu_instance,
    efa_security_group,
)
from ray_train_eks.constructs.karpenter_iam import CONTROLLER_POLICIES, INTERRUPTION_RULES, controller_policy_text
from ray_train_eks.constructs.launch_templates import node_config_user_data, node_disks
# The EC2NodeClass and NodePool as data live beside this module; importable from here too.
from ray_train_eks.constructs.karpenter_manifests import (  # noqa: F401
    _go_duration,
    capacity_reservation_terms,
    ec2_node_class,
    kubernetes_taint,
    node_pool,
    node_pool_disruption,
)
from ray_train_eks.constructs.custom_resource import PythonCustomResource
from ray_train_eks.handlers.karpenter_leftovers import CLUSTER_TAG
from ray_train_eks.constructs.chart_packages import chart_source
from ray_train_eks.helm_charts import KARPENTER, KARPENTER_CRD, PinnedChart
from ray_train_eks.nag import acknowledge, checkov_skip, managed_policy_rule, wildcard_rule
from ray_train_eks.rules.reservations import (
    GpuCapacityChoice,
    capacity_order_problem,
    placement_group_problem,
    reservation_ids_problem,
    reservation_selection_problem,
    reservation_tags_problem,
    reservation_type_problem,
    resolve_order,
)
from ray_train_eks.validation import Prop, raise_problems

#: The serving NodePool's nodes' own label, by default.
SERVING_POOL_LABELS = {"ray-train-eks/serving": "true"}
#: Nodes' worth of room in the NodePool's GPU limit for a replacement (KarpenterGpuCapacity ``spare_nodes``).
SPARE_NODES = 1

KARPENTER_VERSION = KARPENTER.version
#: The controller's chart, and Karpenter's CRDs as a chart of their own, same version
#: (ray_train_eks.helm_charts.KARPENTER, KARPENTER_CRD): Helm installs a chart's crds/ on the
#: first install only, so the controller's chart would never upgrade them (upstream's upgrade
#: guide recommends the CRD chart for that reason). Its CRDs are templates: uninstalling it
#: deletes them, so it goes last.
#: How long a node may drain before Karpenter deletes its remaining pods and terminates it
#: (NodePool spec.template.spec.terminationGracePeriod). Without it a pod with
#: karpenter.sh/do-not-disrupt blocks a node's termination forever, and with it the
#: EC2NodeClass's deletion (and cdk destroy). Under the kubectl handler's 15 minutes.
NODE_TERMINATION_GRACE = Duration.minutes(10)
#: The controller's service account: the chart's full name, which is the release name.
CONTROLLER_SERVICE_ACCOUNT = "karpenter"
# The construct's rules live in ray_train_eks/rules/karpenter.py; importable from here too.
from ray_train_eks.rules.karpenter import (DEFAULT_AMI_ALIAS, ami_alias_problem, kubernetes_name_problem,  # noqa: E402,F401
                                           replicas_problem)


class KarpenterGpuCapacity(Construct):
    """EFA GPU nodes that exist only while pods need them, launched by Karpenter 1.14.1.

    It creates:

    - the controller's IAM: the six managed policies of the upstream reference (scoped to
      this cluster by its tag conditions, ``ec2:DescribePlacementGroups`` included), on a role
      the controller gets through EKS Pod Identity (no IRSA, nothing on a node role);
    - the nodes' role (EKS worker, CNI and ECR pull-only managed policies) and its
      ``EC2_LINUX`` access entry, so the nodes join the cluster;
    - the interruption queue (SQS, encrypted, TLS only, 5-minute retention) and the five
      EventBridge rules of the reference;
    - the CRDs from the ``karpenter-crd`` chart (so that they are upgraded with the version),
      then the controller from ``oci://public.ecr.aws/karpenter/karpenter`` 1.14.1 in
      ``namespace``, with ``AWS_REGION`` set (else it asks IMDS, out of a pod's reach at hop limit 1);
    - an EFA security group (every protocol to and from itself) and a cluster placement group;
    - an EC2NodeClass (AL2023 NVIDIA AMI through an ``al2023`` alias, the one subnet, the
      cluster security group plus the EFA group, the placement group, IMDSv2 with one hop,
      an encrypted gp3 root volume) and a NodePool (the instance type, on-demand, the subnet's
      AZ, a limit of ``node_count`` × GPUs per node, ``WhenEmpty`` consolidation after
      ``consolidate_after``, no expiry, at most ``termination_grace`` of draining) with
      ``labels`` and ``taints`` on its nodes.

    Teardown: the NodePool depends on the EC2NodeClass, which depends on the chart and on
    everything the controller and the nodes need (IAM, Pod Identity, the access entry, the
    queue, the security group, the placement group), so ``cdk destroy`` deletes the NodePool
    first (its NodeClaims go by cascading deletion), then the EC2NodeClass, whose termination
    finalizer holds ``kubectl delete`` until every NodeClaim, and so every instance, is gone,
    and only then the controller. Put whatever schedules pods on these nodes after
    :attr:`node_pool_manifest` (``node.add_dependency``) so it goes first.

    :param cluster: any EKS cluster with the Pod Identity agent add-on.
    :param subnet: the one subnet (one AZ) the GPU nodes go to.
    :param instance_type: an EFA-capable GPU type of :data:`ray_train_eks.instances.INSTANCE_TYPES`. Default - g6.12xlarge.
    :param node_count: most nodes at once; the NodePool's GPU limit is this times the type's GPUs. Default - 2.
    :param root_volume_gib: Default - 50 on a type with local NVMe (``instanceStorePolicy: RAID0``
        puts containerd and kubelet there), else 200 with pull throughput.
    :param ami_alias: Default - ``al2023@v20260714`` (pinned: ``latest`` would drift every node at each AMI release).
    :param labels: node labels. Default - ``nvidia.com/gpu.present=true`` (what the NVIDIA device
        plugin selects); pass more to add your own, that one is always set.
    :param taints: Default - ``nvidia.com/gpu=true:NoSchedule``.
    :param consolidate_after: how long a node stays empty before it goes. Default - 5 minutes.
    :param capacity_type: ``on-demand``, or ``spot`` (on-demand when Spot has no capacity:
        Karpenter prefers spot when both are allowed). Default - on-demand. ``capacity_types`` overrides it.
    :param capacity_types: the capacity types in Karpenter's order (reserved, spot, on-demand), a
        subset of it: ``("reserved",)`` launches into the reservations only, ``("reserved",
        "on-demand")`` falls back (ray_train_eks/rules/reservations.py). Default - from ``capacity_type``,
        or ``("reserved",)`` with reservations.
    :param capacity_reservation_ids: the reservations (On-Demand Capacity Reservations or Capacity
        Blocks) by id, for ``reserved``. Default - none.
    :param capacity_reservation_tags: or the reservations by tags (every tag must match). Default - none.
    :param reservation_type: ``default`` or ``capacity-block``: what the reservations are (Karpenter
        reads it from EC2; it names what the account checks and the docs expect). Default - default.
    :param placement_group_name: an existing cluster placement group (the reservations') for every node,
        reserved or not. Default - a new one without reservations; none with them (a launch into a
        reservation made outside a placement group cannot go into one; a Capacity Block is in one
        UltraCluster and AWS advises no placement group with it).
    :param fast_image_pull: nodeadm's ``FastImagePull`` feature gate in the nodes' user data
        (ray_train_eks/constructs/launch_templates.py ``node_config``). Default - on.
    :param termination_grace: how long a node may drain before its remaining pods (those with
        ``karpenter.sh/do-not-disrupt`` too) are deleted and it is terminated; it bounds the
        EC2NodeClass's deletion. Default - 10 minutes (inside the kubectl handler's 15).
    :param name: name of the EC2NodeClass and the NodePool. Default - gpu-efa.
    :param namespace: the controller's namespace. Default - kube-system.
    :param replicas: controller replicas; the chart's anti-affinity puts each on its own node, so
        at most the nodes that may run it (a second replica with nowhere to go stays Pending and
        Helm's wait fails the deploy). Default - 1.
    :param controller_node_selector: where the controller runs (never on its own nodes: the chart
        keeps it off nodes with ``karpenter.sh/nodepool``). Default - ``kubernetes.io/os=linux`` (the chart's).
    :param chart_packages: a folder of pinned chart packages (``make upstream``'s cache): the two
        charts whose verified package it holds are installed as CDK assets. Default - the OCI registry.
    :param node_repair: Karpenter's node repair (feature gate ``NodeRepair``, alpha in 1.14.1, off by
        default): a node whose ``AcceleratedHardwareReady`` stays false 10 minutes (``Ready`` and the
        node monitoring agent's other conditions: 30) is replaced (ray_train_eks.constructs.node_health). Default - on.
    :param serving_nodes: GPU nodes of a second NodePool, ``<name>-serving``, for served models' replicas
        (ray_train_eks/workload/serving.py): a limit of their own, so serving never takes training's
        nodes nor waits for them; its nodes carry ``serving_labels`` (which the services' pods select)
        instead of ``labels``, on the same EC2NodeClass, On-Demand (or Spot first where the order has
        it; never a reservation, which is training's). Default - 0, no serving NodePool.
    :param serving_labels: the serving nodes' labels (a training pod must select a label they lack).
        Default - :data:`SERVING_POOL_LABELS`.
    :param spare_nodes: room in the NodePool's GPU limit beyond ``node_count``: a node a training
        worker took out of the run (tainted at a GPU fault, training/resilience/health.py) counts against the
        limit until it is empty for ``consolidate_after`` and goes; with room for one more, its
        replacement launches at once. Default - 1.
    """

    def __init__(
        self,
        scope: Construct,
        id: str,
        *,
        cluster: eks.ICluster,
        subnet: ec2.ISubnet,
        instance_type: str = "g6.12xlarge",
        node_count: int = 2,
        root_volume_gib: int | None = None,
        ami_alias: str = DEFAULT_AMI_ALIAS,
        labels: Mapping[str, str] | None = None,
        taints: Sequence[eks.TaintSpec] = (GPU_TAINT,),
        consolidate_after: Duration = Duration.minutes(5),
        termination_grace: Duration = NODE_TERMINATION_GRACE,
        capacity_type: str = "on-demand",
        name: str = "gpu-efa",
        namespace: str = "kube-system",
        replicas: int = 1,
        controller_node_selector: Mapping[str, str] | None = None,
        chart_packages: Path | None = None,
        node_repair: bool = True,
        spare_nodes: int = SPARE_NODES,
        capacity_types: Sequence[str] | None = None,
        capacity_reservation_ids: Sequence[str] = (),
        capacity_reservation_tags: Mapping[str, str] | None = None,
        reservation_type: str = "default",
        placement_group_name: str | None = None,
        fast_image_pull: bool = True,
        serving_nodes: int = 0,
        serving_labels: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(scope, id)
        self.instance = efa_gpu_instance("KarpenterGpuCapacity", instance_type, node_count, root_volume_gib)
        if spare_nodes < 0:
            raise ValueError(f"KarpenterGpuCapacity: spare_nodes={spare_nodes} must be 0 or more (1: a replacement "
                             "launches while a node taken out of a run still stands)")
        self.node_repair = node_repair
        reserved = bool(capacity_reservation_ids or capacity_reservation_tags)
        order = resolve_order(capacity_types if capacity_types is not None else
                              ("" if reserved and capacity_type == "on-demand" else capacity_type), reserved=reserved, karpenter=True)
        raise_problems("KarpenterGpuCapacity", [
            replicas_problem(replicas), kubernetes_name_problem(name), ami_alias_problem(ami_alias),
            capacity_order_problem(order, reserved=reserved, karpenter=True), reservation_ids_problem(capacity_reservation_ids),
            reservation_tags_problem(capacity_reservation_tags or {}), reservation_type_problem(reservation_type),
            reservation_selection_problem(capacity_reservation_ids, capacity_reservation_tags or {}, karpenter=True,
                                          reservation_type=reservation_type),
            placement_group_problem(placement_group_name, reservation_type=reservation_type if reserved else "default")])
        #: The capacity types in order, and the reservations.
        self.capacity = GpuCapacityChoice(order=order, reservation_ids=tuple(capacity_reservation_ids),
                                          reservation_tags=dict(capacity_reservation_tags or {}), reservation_type=reservation_type)
        if ami_alias.endswith("@latest"):
            Annotations.of(self).add_warning_v2(
                "ray-train-eks:ami-latest",
                f"ami_alias={ami_alias}: every AMI release drifts the GPU nodes; pin a release, e.g. {DEFAULT_AMI_ALIAS}",
            )
        self.name = name
        self.namespace = namespace

        self._interruption_handling()
        self._node_role(cluster)
        self._controller_iam(cluster)
        self._controller(cluster, replicas=replicas, node_selector=controller_node_selector, chart_packages=chart_packages)
        self._node_class_and_pool(
            cluster, subnet=subnet, ami_alias=ami_alias, root_volume_gib=root_volume_gib,
            gpu_limit=(node_count + spare_nodes) * self.instance.gpus, labels={**NVIDIA_PRESENT_LABEL, **(labels or {})},
            taints=[kubernetes_taint(t) for t in taints], consolidate_after=_go_duration(consolidate_after),
            termination_grace=_go_duration(termination_grace), placement_group_name=placement_group_name,
            user_data=node_config_user_data(fast_image_pull=fast_image_pull, local_storage=False) if fast_image_pull else None,
        )
        self._serving_pool(cluster, subnet=subnet, nodes=serving_nodes, labels={**NVIDIA_PRESENT_LABEL, **(serving_labels or SERVING_POOL_LABELS)},
                           taints=[kubernetes_taint(t) for t in taints], consolidate_after=_go_duration(consolidate_after),
                           termination_grace=_go_duration(termination_grace))
        self._leftover_cleanup(cluster)

    def _interruption_handling(self) -> None:
        """The reference's interruption queue (SQS, encrypted, TLS only, 5-minute retention) and
        its five EventBridge rules, which send Spot interruptions, rebalance recommendations,
        scheduled changes and instance state changes to it."""
        self.queue = sqs.Queue(
            self,
            "InterruptionQueue",
            retention_period=Duration.minutes(5),
            encryption=sqs.QueueEncryption.SQS_MANAGED,
            enforce_ssl=True,
        )
        checkov_skip(self.queue, "Encrypted at rest with SQS-managed keys (SqsManagedSseEnabled), as Karpenter's reference "
                                 "queue is; a customer managed key would need a key policy for EventBridge, and the "
                                 "messages are EC2 instance events, no secret.", "CKV_AWS_27")
        acknowledge(
            self.queue,
            "Karpenter's interruption queue keeps events for 5 minutes, as upstream's: a dead-letter queue would only "
            "hold interruption notices that are stale by the time anyone reads them.",
            "AwsSolutions-SQS3",
        )
        self.rules = []
        for rule_name, (source, detail_type) in INTERRUPTION_RULES.items():
            rule = events.Rule(
                self,
                rule_name,
                event_pattern=events.EventPattern(source=[source], detail_type=[detail_type]),
                targets=[targets.SqsQueue(self.queue)],
            )
            self.rules.append(rule)

    def _node_role(self, cluster: eks.ICluster) -> None:
        """The nodes' role (EKS worker, CNI and ECR pull-only managed policies) and its
        ``EC2_LINUX`` access entry, so that the nodes Karpenter launches join the cluster."""
        self.node_role = iam.Role(
            self,
            "NodeRole",
            assumed_by=iam.ServicePrincipal("ec2.amazonaws.com"),
            managed_policies=[
                iam.ManagedPolicy.from_aws_managed_policy_name(policy)
                for policy in ("AmazonEKSWorkerNodePolicy", "AmazonEKS_CNI_Policy", "AmazonEC2ContainerRegistryPullOnly")
            ],
        )
        acknowledge(
            self.node_role,
            "EKS requires these AWS managed policies on node roles (kubelet registration, VPC CNI, image pulls); "
            "AWS keeps them in step with EKS. Pull-only ECR access, as Karpenter's reference.",
            managed_policy_rule("AmazonEKSWorkerNodePolicy"),
            managed_policy_rule("AmazonEKS_CNI_Policy"),
            managed_policy_rule("AmazonEC2ContainerRegistryPullOnly"),
        )
        self.node_access_entry = eks.AccessEntry(
            self,
            "NodeAccessEntry",
            cluster=cluster,
            principal=self.node_role.role_arn,
            access_entry_type=eks.AccessEntryType.EC2_LINUX,
            access_policies=[],
        )

    def _controller_iam(self, cluster: eks.ICluster) -> None:
        """The controller's role, with the reference's six managed policies (scoped to this
        cluster by its tag conditions), given to the controller's service account through EKS
        Pod Identity."""
        self.controller_role = iam.Role(
            self,
            "ControllerRole",
            assumed_by=iam.ServicePrincipal("pods.eks.amazonaws.com").with_session_tags(),
            description=f"Karpenter {KARPENTER_VERSION} controller (EKS Pod Identity)",
        )
        variables = {
            "ClusterName": cluster.cluster_name,
            "NodeRoleArn": self.node_role.role_arn,
            "InterruptionQueueArn": self.queue.queue_arn,
        }
        self.controller_policies: list[iam.CfnManagedPolicy] = []
        for policy_name in CONTROLLER_POLICIES:
            text = controller_policy_text(policy_name)
            used = {v: variables[v] for v in variables if "${" + v + "}" in text}
            # A JSON string through Fn::Sub, as upstream: the cluster name is a key inside the
            # conditions (aws:ResourceTag/kubernetes.io/cluster/<name>), which CloudFormation
            # cannot fill in an object.
            policy = iam.CfnManagedPolicy(
                self,
                policy_name,
                description=f"Karpenter {KARPENTER_VERSION} controller: {policy_name} of the upstream reference",
                policy_document=Fn.sub(text, used) if used else Fn.sub(text),
                roles=[self.controller_role.role_name],
            )
            self.controller_policies.append(policy)
            # CDK's template check knows PolicyDocument as an object only; CloudFormation takes
            # the JSON text too (IAM parses it), which is how upstream's template deploys.
            Validations.of(policy).acknowledge(
                Acknowledgment(
                    id="CloudFormation-Validate::E3510",
                    reason="PolicyDocument is JSON text through Fn::Sub, as in Karpenter's reference template: "
                    "the cluster name is part of condition keys, which an object cannot hold as a token.",
                )
            )
        acknowledge(
            self.controller_role,
            "Karpenter's own controller policies (aws/karpenter-provider-aws v1.14.1 reference): it launches and "
            "terminates instances of any id, so instance, fleet, volume, launch-template and instance-profile "
            "resources are wildcards narrowed by this cluster's tags in conditions; Describe*, pricing and SSM "
            "public-parameter reads are region-wide by nature.",
            "AwsSolutions-IAM5",
        )
        self.pod_identity = eks.CfnPodIdentityAssociation(
            self,
            "PodIdentity",
            cluster_name=cluster.cluster_name,
            namespace=self.namespace,
            service_account=CONTROLLER_SERVICE_ACCOUNT,
            role_arn=self.controller_role.role_arn,
        )
        if cluster.eks_pod_identity_agent is not None:
            self.pod_identity.node.add_dependency(cluster.eks_pod_identity_agent)

    def _controller(self, cluster: eks.ICluster, *, replicas: int, node_selector: Mapping[str, str] | None,
                    chart_packages: Path | None) -> None:
        """The CRDs (their own chart, so that they are upgraded), then the controller, after its
        credentials (and, on delete, before them; the CRDs go last)."""
        def release(id: str, pin: PinnedChart, values: dict | None = None) -> eks.HelmChart:
            return eks.HelmChart(self, id, cluster=cluster, **chart_source(self, f"{id}Package", pin, chart_packages),
                                 release=pin.chart, namespace=self.namespace,
                                 create_namespace=self.namespace != "kube-system", timeout=HELM_TIMEOUT, wait=True,
                                 values=values)

        self.crd_chart = release("CrdChart", KARPENTER_CRD)
        self.chart_values = {
            "replicas": replicas,
            "nodeSelector": dict(node_selector or {"kubernetes.io/os": "linux"}),
            "settings": {"clusterName": cluster.cluster_name, "interruptionQueue": self.queue.queue_name,
                         # values.yaml of the 1.14.1 chart: settings.featureGates.nodeRepair (FEATURE_GATES);
                         # reservedCapacity is beta and on by default there, said anyway where it is used.
                         "featureGates": {"nodeRepair": self.node_repair,
                                          **({"reservedCapacity": True} if self.capacity.reserved else {})}},
            "controller": {
                # Karpenter's getting-started sizing: the controller caches every node and pod.
                "resources": {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"cpu": "1", "memory": "1Gi"}},
                # Without it the controller asks IMDS for its region (pkg/operator/operator.go), which
                # a hop limit of 1 keeps from pods; it panics then.
                "env": [{"name": "AWS_REGION", "value": Stack.of(self).region}],
            },
        }
        self.chart = release("Chart", KARPENTER, self.chart_values)
        self.chart.node.add_dependency(self.pod_identity, *self.controller_policies, self.crd_chart)

    def _node_class_and_pool(self, cluster: eks.ICluster, *, subnet: ec2.ISubnet, ami_alias: str, root_volume_gib: int | None,
                             gpu_limit: int, labels: Mapping[str, str], taints: Sequence[Mapping[str, str]],
                             consolidate_after: str, termination_grace: str, placement_group_name: str | None,
                             user_data: str | None) -> None:
        """The nodes: the EFA wiring of :class:`EfaNodeGroup` (its security group, a cluster
        placement group) in an EC2NodeClass, and the NodePool that launches them.

        The EC2NodeClass's finalizer waits for its NodeClaims' instances: everything those
        instances use, and the controller that terminates them, must outlive it."""
        self.security_group = efa_security_group(self, "EfaSecurityGroup", cluster.vpc)
        #: Ours, without reservations and without one given; else None.
        self.placement_group: ec2.PlacementGroup | None = None
        if placement_group_name is None and not self.capacity.reserved:
            self.placement_group = ec2.PlacementGroup(self, "PlacementGroup", strategy=ec2.PlacementGroupStrategy.CLUSTER)
            placement_group_name = self.placement_group.placement_group_name
        self.node_class = ec2_node_class(
            name=self.name,
            role_name=self.node_role.role_name,
            ami_alias=ami_alias,
            subnet_id=subnet.subnet_id,
            security_group_ids=[cluster.cluster_security_group_id, self.security_group.security_group_id],
            placement_group_name=placement_group_name,
            disks=node_disks(self.instance.name, root_volume_gib=root_volume_gib),
            reservation_terms=capacity_reservation_terms(self.capacity.reservation_ids, self.capacity.reservation_tags),
            user_data=user_data,
        )
        self.node_pool = node_pool(
            name=self.name,
            node_class_name=self.name,
            instance_type=self.instance.name,
            availability_zone=subnet.availability_zone,
            gpu_limit=gpu_limit,
            labels=labels,
            taints=taints,
            consolidate_after=consolidate_after,
            termination_grace=termination_grace,
            capacity_types=self.capacity.order,
        )
        self.node_class_manifest = eks.KubernetesManifest(self, "NodeClass", cluster=cluster, manifest=[self.node_class])
        self.node_class_manifest.node.add_dependency(
            self.chart, self.node_access_entry, self.queue, *self.rules, self.security_group,
            *([self.placement_group] if self.placement_group else [])
        )
        self.node_pool_manifest = eks.KubernetesManifest(self, "NodePool", cluster=cluster, manifest=[self.node_pool])
        self.node_pool_manifest.node.add_dependency(self.node_class_manifest)

    def _serving_pool(self, cluster: eks.ICluster, *, subnet: ec2.ISubnet, nodes: int, labels: Mapping[str, str],
                      taints: Sequence[Mapping[str, str]], consolidate_after: str, termination_grace: str) -> None:
        """The serving NodePool (``serving_nodes``), on the training pool's EC2NodeClass; None without."""
        #: The serving NodePool (None without ``serving_nodes``) and its manifest.
        self.serving_pool: dict | None = None
        self.serving_pool_manifest: eks.KubernetesManifest | None = None
        if nodes < 1:
            return
        order = tuple(kind for kind in self.capacity.order if kind != "reserved") or ("on-demand",)
        self.serving_pool = node_pool(name=f"{self.name}-serving", node_class_name=self.name, instance_type=self.instance.name,
                                      availability_zone=subnet.availability_zone, gpu_limit=nodes * self.instance.gpus,
                                      labels=labels, taints=taints, consolidate_after=consolidate_after,
                                      termination_grace=termination_grace, capacity_types=order)
        self.serving_pool_manifest = eks.KubernetesManifest(self, "ServingNodePool", cluster=cluster, manifest=[self.serving_pool])
        self.serving_pool_manifest.node.add_dependency(self.node_class_manifest)

    def _leftover_cleanup(self, cluster: eks.ICluster) -> None:
        """A last step of ``cdk destroy``, after every Karpenter object and before the VPC, the
        security group, the placement group and the node role: whatever Karpenter launched for
        this cluster and a failed delete left (instances, launch templates, instance profiles,
        found by Karpenter's own tags and path) is removed (ray_train_eks/handlers/karpenter_leftovers.py)."""
        stack = Stack.of(self)
        cluster_name = cluster.cluster_name
        by_cluster = {"StringEquals": {f"aws:ResourceTag/{CLUSTER_TAG}": cluster_name}}
        instances, templates, profiles = (
            stack.format_arn(service="ec2", resource="instance", resource_name="*"),
            stack.format_arn(service="ec2", resource="launch-template", resource_name="*"),
            stack.format_arn(service="iam", region="", resource="instance-profile",
                             resource_name=f"karpenter/{stack.region}/{cluster_name}/*"))
        self.leftover_cleanup = PythonCustomResource(
            self, "LeftoverCleanup", handler="karpenter_leftovers.on_event",
            description="ray-train-eks: on delete, terminate what Karpenter launched for this cluster and left behind",
            properties={"ClusterName": cluster_name, "Region": stack.region, "WaitSeconds": 600},
            timeout=Duration.minutes(14),
            statements=[
                iam.PolicyStatement(actions=["ec2:DescribeInstances", "ec2:DescribeLaunchTemplates"], resources=["*"]),
                iam.PolicyStatement(actions=["ec2:TerminateInstances", "ec2:DeleteLaunchTemplate"], conditions=by_cluster,
                                    resources=[instances, templates]),
                iam.PolicyStatement(actions=["iam:ListInstanceProfiles"], resources=["*"]),
                iam.PolicyStatement(actions=["iam:RemoveRoleFromInstanceProfile", "iam:DeleteInstanceProfile"],
                                    resources=[profiles]),
            ],
        )
        # Each finding named from its ARN as this stack renders it: with the account where `cdk deploy`
        # (credentials) makes the stack account-specific, <AWS::AccountId> where `cdk synth` without them does not.
        acknowledge(self.leftover_cleanup,
                    "Describe and list calls cannot be scoped to resources; terminate and delete are scoped to this "
                    "cluster's tag, the instance profiles to Karpenter's path for this cluster.",
                    "AwsSolutions-IAM5[Resource::*]", *(wildcard_rule(self, arn) for arn in (instances, templates, profiles)))
        # Created before, so deleted after, every Karpenter object (the CRDs' chart comes first of
        # them); created after, so deleted before, what Karpenter's instances use.
        self.leftover_cleanup.node.add_dependency(self.security_group, self.node_role, cluster.vpc,
                                                  *([self.placement_group] if self.placement_group else []))
        self.crd_chart.node.add_dependency(self.leftover_cleanup)

    @property
    def gpu_limit(self) -> int:
        """GPUs the NodePool may hold at once."""
        return int(self.node_pool["spec"]["limits"]["nvidia.com/gpu"])

