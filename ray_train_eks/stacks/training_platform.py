"""The whole training platform in one stack."""

from __future__ import annotations

import json
from dataclasses import replace

from aws_cdk import Annotations, CfnOutput, Environment, Fn, RemovalPolicy, Stack, aws_iam as iam
from constructs import Construct

from ray_train_eks.config import TRAINING_METRICS_NAMESPACE, PlatformConfig
from ray_train_eks.constructs import (
    AccountChecks,
    EfaDevicePlugin,
    EfaNodeGroup,
    KarpenterGpuCapacity,
    KubeRayOperator,
    KueueQueueing,
    NodeMonitoringAgent,
    NvidiaDevicePlugin,
    RayServiceAccount,
    RayWorkload,
    TrainingBucket,
    TrainingCluster,
    TrainingNetwork,
)
from ray_train_eks.constructs.observability import (
    CloudWatchObservability,
    IdleGpuAlarm,
    TrainingDashboard,
    application_log_group_name,
)
from ray_train_eks.constructs.karpenter import SPARE_NODES
from ray_train_eks.constructs.keys import customer_managed_key
from ray_train_eks.constructs.network import VPC_AZS
from ray_train_eks.constructs.network_leftovers import GuardDutyLeftoverCleanup, NetworkLeftoverCleanup
from ray_train_eks.constructs.trainer_access import TrainerAccess
from ray_train_eks.constructs.tracking import MlflowTracking, tracking_access
from ray_train_eks.handlers.reservation_checks import ReservationRequest
from ray_train_eks.instances import estimate_cost, not_offered_note
from ray_train_eks.nag import checkov_skip_deploy_time_functions
from ray_train_eks.scheduling import GPU_NODE_SELECTOR, RAY_NAMESPACE, SERVING_NODE_SELECTOR, SYSTEM_NODE_SELECTOR
from ray_train_eks.tracking import mlflow_app_made, untracked_note


class TrainingPlatformStack(Stack):
    """VPC, EKS cluster, system and EFA GPU node groups, device plugins, KubeRay and the
    training bucket, from one validated :class:`PlatformConfig`."""

    def __init__(self, scope: Construct, id: str, *, config: PlatformConfig, **kwargs) -> None:
        # Set before super().__init__: the availability_zones override below is read by
        # the VPC, and it must never trigger an AWS lookup at synth.
        self._configured_azs = list(config.availability_zones)
        super().__init__(
            scope,
            id,
            env=Environment(account=config.account, region=config.region),
            description="ray-train-eks: EKS + EFA GPU nodes + KubeRay for Ray Train FSDP fine-tuning",
            **kwargs,
        )
        self.config = config
        self._instance_types_in_region(config)
        self._network_and_cluster(config)
        gpu_ready = self._gpu_capacity(config)
        # The alarm's topic first: the Ray pods publish a run's end and its faults to it.
        self._observability(config)
        self._ray(config, gpu_ready)
        self._outputs(config)
        self.training_cluster.outlive_kubernetes_objects(self)
        # checkov's Lambda findings on deploy-time functions, skipped with their reasons.
        checkov_skip_deploy_time_functions(self)

    def _instance_types_in_region(self, config: PlatformConfig) -> None:
        """A warning for each instance type the region's EC2 does not offer, as far as the instance table
        knows (ray_train_eks/instances.py ``NOT_OFFERED_IN``): said, not refused, since AWS adds types to regions."""
        for key, instance_type in (("gpuInstanceType", config.gpu_instance_type),
                                   ("systemInstanceType", config.system_instance_type)):
            if note := not_offered_note(key, instance_type, config.region):
                Annotations.of(self).add_warning_v2(f"ray-train-eks:{key}-not-offered", note)

    def _network_and_cluster(self, config: PlatformConfig) -> None:
        """The account checks first, then the VPC, the cluster with its system nodes, and the
        device plugins every GPU node needs."""
        self.account_checks: AccountChecks | None = None
        if not config.skip_account_checks:
            # The GPU subnet's AZ is the VPC's first (TrainingNetwork), known without building it.
            self.account_checks = AccountChecks(
                self, "AccountChecks", instance_type=config.gpu_instance_type, node_count=config.gpu_node_count,
                availability_zone=self.availability_zones[0], kubernetes_version=config.kubernetes_version,
                ami_release=config.gpu_ami_version if config.gpu_capacity == "karpenter" else "",
                capacity_type="spot" if config.capacity.spot else "on-demand", node_group=config.gpu_capacity != "karpenter",
                system_instance_type=config.system_instance_type, system_node_count=config.system_node_count,
                # The VPC's first two: an account-specific stack's lookup gives every AZ of the region.
                system_availability_zones=len(self.availability_zones[:VPC_AZS]),
                spare_nodes=SPARE_NODES if config.gpu_capacity == "karpenter" else 0,
                reservations=self._reservation_request(config),
            )
        self.network = TrainingNetwork(self, "Network", availability_zones=config.availability_zones or None)
        if self.account_checks is not None:
            self.network.node.add_dependency(self.account_checks)
        self.training_cluster = TrainingCluster(
            self,
            "Cluster",
            vpc=self.network.vpc,
            kubernetes_version=config.kubernetes_version,
            system_instance_type=config.system_instance_type,
            system_node_count=config.system_node_count,
            system_root_volume_gib=config.system_root_volume_gib,
            root_volume_throughput_mibps=config.root_volume_throughput_mibps,
            root_volume_iops=config.root_volume_iops,
            system_node_labels=SYSTEM_NODE_SELECTOR,
            network_policy_enforcement=config.network_policies,
            endpoint_access_cidrs=config.endpoint_access_cidrs,
            admin_role_arn=config.admin_role_arn,
        )
        cluster = self.training_cluster.cluster
        # GuardDuty's automated agent (an account setting) leaves an endpoint and a group in the VPC.
        self.guardduty_leftovers = GuardDutyLeftoverCleanup(self, "GuardDutyLeftovers", vpc=self.network.vpc)
        self.guardduty_leftovers.goes_after(cluster.node.default_child)  # the EKS cluster itself
        packages = config.chart_packages_dir
        self.nvidia_plugin = NvidiaDevicePlugin(self, "NvidiaDevicePlugin", cluster=cluster, chart_packages=packages)
        self.efa_plugin = EfaDevicePlugin(
            self, "EfaDevicePlugin", cluster=cluster, region=config.region, instance_types=[config.gpu_instance_type],
            chart_packages=packages,
        )
        # Node conditions for GPU, network, disk, kernel and runtime faults, which node repair acts on.
        self.node_monitoring: NodeMonitoringAgent | None = None
        if config.node_monitoring:
            self.node_monitoring = NodeMonitoringAgent(self, "NodeMonitoringAgent", cluster=cluster)
            self.node_monitoring.addon.node.add_dependency(self.training_cluster.system_nodes)

    def _gpu_capacity(self, config: PlatformConfig) -> list:
        """The GPU nodes: a managed node group, or Karpenter's NodePool. Returns what the Ray
        objects must come after (and, on destroy, go before)."""
        cluster = self.training_cluster.cluster
        self.gpu_nodes: EfaNodeGroup | None = None
        self.gpu_capacity: KarpenterGpuCapacity | None = None
        if config.gpu_capacity == "karpenter":
            self.gpu_capacity = KarpenterGpuCapacity(
                self,
                "GpuCapacity",
                cluster=cluster,
                subnet=self.network.gpu_subnet,
                instance_type=config.gpu_instance_type,
                node_count=config.gpu_node_count,
                root_volume_gib=config.gpu_root_volume_gib,
                ami_alias=f"al2023@{config.gpu_ami_version}",
                labels=GPU_NODE_SELECTOR,
                replicas=config.karpenter_replicas,
                controller_node_selector=SYSTEM_NODE_SELECTOR,
                capacity_types=config.capacity.order,
                capacity_reservation_ids=config.capacity.reservation_ids,
                capacity_reservation_tags=config.capacity.reservation_tags,
                reservation_type=config.capacity_reservation_type,
                placement_group_name=config.gpu_placement_group,
                fast_image_pull=config.fast_image_pull,
                chart_packages=config.chart_packages_dir,
                node_repair=config.node_repair,
                serving_nodes=config.serving_gpu_nodes,
                serving_labels=SERVING_NODE_SELECTOR,
            )
            self.gpu_capacity.chart.node.add_dependency(self.training_cluster.system_nodes)
            # With no GPU node yet the plugins' DaemonSets are complete at zero pods. The Ray
            # objects depend on the NodePool and the plugins, so on destroy their pods leave
            # first and the NodePool's nodes are empty when it goes.
            gpu_ready = [self.gpu_capacity.node_pool_manifest, self.nvidia_plugin, self.efa_plugin]
        else:
            self.gpu_nodes = EfaNodeGroup(
                self,
                "GpuNodes",
                cluster=cluster,
                subnet=self.network.gpu_subnet,
                instance_type=config.gpu_instance_type,
                node_count=config.gpu_node_count,
                root_volume_gib=config.gpu_root_volume_gib,
                root_volume_throughput_mibps=config.root_volume_throughput_mibps,
                root_volume_iops=config.root_volume_iops,
                labels=GPU_NODE_SELECTOR,
                capacity_reservation_ids=config.capacity.reservation_ids,
                capacity_type=config.capacity.order[0],
                reservation_type=config.capacity_reservation_type,
                placement_group_name=config.gpu_placement_group,
                node_repair=config.node_repair,
                fast_image_pull=config.fast_image_pull,
            )
            # The plugins' DaemonSets are waited on: the GPU nodes must exist first.
            for plugin in (self.nvidia_plugin, self.efa_plugin):
                plugin.node.add_dependency(self.gpu_nodes.nodegroup)
            gpu_ready = [self.gpu_nodes.nodegroup]
        capacity = self.gpu_capacity or self.gpu_nodes
        self.network_leftovers = NetworkLeftoverCleanup(self, "LeftoverInterfaces", security_groups=[capacity.security_group],
                                                        other_group_ids=[cluster.cluster_security_group_id])
        self.network_leftovers.resource.node.add_dependency(self.network.gpu_subnet, cluster.vpc)
        self.network_leftovers.goes_after(self.gpu_capacity.leftover_cleanup if self.gpu_capacity else self.gpu_nodes.nodegroup)
        return gpu_ready

    def _ray(self, config: PlatformConfig, gpu_ready: list) -> None:
        """KubeRay, the training bucket, the Ray pods' service account and the Ray workload."""
        cluster = self.training_cluster.cluster
        self.kuberay = KubeRayOperator(self, "KubeRayOperator", cluster=cluster, node_selector=SYSTEM_NODE_SELECTOR,
                                       chart_packages=config.chart_packages_dir)
        self.kuberay.node.add_dependency(self.training_cluster.system_nodes)

        self.storage = TrainingBucket(self, "Storage", destroy_data=config.destroy_data)
        self.ray_service_account = RayServiceAccount(
            self, "RayServiceAccount", cluster=cluster, bucket=self.storage.bucket,
            metrics_namespace=TRAINING_METRICS_NAMESPACE,
        )

        # On destroy the Ray namespace (every pod in it, a user's own RayCluster too) goes before
        # the GPU capacity, so the NodePool's nodes are empty when Karpenter terminates them, and
        # before the KubeRay operator: a RayJob keeps ray.io/rayjob-finalizer until the operator
        # removes it (rayjob_controller.go), so without the operator the namespace would never
        # finish terminating and the kubectl handler would wait out its Lambda's 15 minutes.
        self.ray_service_account.namespace_manifest.node.add_dependency(self.kuberay)
        for capacity in gpu_ready:
            self.ray_service_account.namespace_manifest.node.add_dependency(capacity)
        spec = replace(config.workload_spec(), operator_namespace=self.kuberay.namespace)
        tracking_uri = self._tracking(config)
        # -c queueing=kueue: Kueue, and the queue every job waits in. Created before the Ray namespace
        # and gone after it (its finalizers on the jobs' workloads need the controller); the queues
        # in the namespace after it, and the jobs after the queues.
        self.queueing: KueueQueueing | None = None
        queued = []
        if config.queueing == "kueue":
            self.queueing = KueueQueueing(self, "Queueing", cluster=cluster, spec=spec, node_selector=SYSTEM_NODE_SELECTOR,
                                          chart_packages=config.chart_packages_dir)
            self.queueing.chart.node.add_dependency(self.training_cluster.system_nodes)
            self.ray_service_account.namespace_manifest.node.add_dependency(self.queueing.chart)
            self.queueing.queues.node.add_dependency(self.ray_service_account.namespace_manifest)
            queued = [self.queueing.queues]
        self.ray_workload = RayWorkload(
            self,
            "RayWorkload",
            cluster=cluster,
            spec=spec,
            bucket=self.storage.bucket,
            depends_on=[self.kuberay, self.ray_service_account, *gpu_ready, *queued],
            network_policy_enforced=self.training_cluster.network_policy_enforced,
            tracking_uri=tracking_uri,
            settings=self._run_settings(config),
        )
        self.trainer_access: TrainerAccess | None = None
        if config.trainer_role_arns:
            self.trainer_access = TrainerAccess(self, "TrainerAccess", cluster=cluster, spec=spec,
                                                role_arns=config.trainer_role_arns,
                                                depends_on=[self.ray_service_account.namespace_manifest])

    @staticmethod
    def _reservation_request(config: PlatformConfig) -> ReservationRequest | None:
        """What the account checks read of the reservations (ray_train_eks/handlers/reservation_checks.py)."""
        choice = config.capacity
        if not choice.reserved:
            return None
        return ReservationRequest(ids=choice.reservation_ids, tags=dict(choice.reservation_tags),
                                  reservation_type=choice.reservation_type, reserved_only=choice.reserved_only,
                                  node_group=config.gpu_capacity != "karpenter",
                                  deadline_seconds=config.active_deadline_seconds or None,
                                  placement_group=config.gpu_placement_group)

    def _run_settings(self, config: PlatformConfig) -> dict[str, str]:
        """What the Ray pods read beyond the bucket and the tracking (the settings ConfigMap), with
        the pods' role's access to it: the topic a run's end, a preemption and a hardware fault are
        published to (the idle-GPU alarm's, so the same subscription; training/telemetry/notify.py),
        and the Capacity Blocks the GPU nodes run on alone, whose end a run stops before."""
        role = self.ray_service_account.role
        settings: dict[str, str] = {}
        if self.idle_gpu_alarm is not None:
            topic = self.idle_gpu_alarm.topic
            settings["notify_topic_arn"] = topic.topic_arn
            # sns:Publish, and a data key of the topic's key: SNS encrypts the message with one on the
            # publisher's behalf (SNS developer guide, "Setting up topic encryption": kms:GenerateDataKey
            # and kms:Decrypt for the publisher), named without CDK's grant_publish wildcard.
            role.add_to_principal_policy(iam.PolicyStatement(actions=["sns:Publish"], resources=[topic.topic_arn]))
            role.add_to_principal_policy(iam.PolicyStatement(actions=["kms:GenerateDataKey", "kms:Decrypt"],
                                                             resources=[self.idle_gpu_alarm.encryption_key.key_arn]))
        # Blocks alone: with a fallback the nodes' drain at the block's end is a preemption, and the
        # run resumes on the fallback's nodes by itself.
        choice = config.capacity
        if choice.capacity_block and choice.reserved_only:
            if choice.reservation_ids:
                settings["capacity_block_ids"] = ",".join(choice.reservation_ids)
            else:
                settings["capacity_block_tags"] = json.dumps(dict(choice.reservation_tags), sort_keys=True)
            settings["capacity_block_nodes"] = "karpenter" if config.gpu_capacity == "karpenter" else "node-group"
            role.add_to_principal_policy(iam.PolicyStatement(actions=["ec2:DescribeCapacityReservations"], resources=["*"]))
        if choice.spot:
            # A run prices a Spot node at EC2's Spot price in its zone (training/telemetry/cost.py); the
            # action has no resource-level permissions (Service Authorization Reference, Amazon EC2).
            role.add_to_principal_policy(iam.PolicyStatement(actions=["ec2:DescribeSpotPriceHistory"], resources=["*"]))
        return settings

    def _tracking(self, config: PlatformConfig) -> str | None:
        """Where the runs log to: a new SageMaker MLflow App (``mlflowTracking=app``, or ``auto`` where the region
        has Apps), or the user's MLflow (``mlflowTrackingUri``), with the Ray pods' access to it; None: no tracking."""
        self.tracking: MlflowTracking | None = None
        if config.mlflow_tracking_uri:
            statement = tracking_access(config.mlflow_tracking_uri)
            if statement is not None:
                self.ray_service_account.role.add_to_principal_policy(statement)
            return config.mlflow_tracking_uri
        if not mlflow_app_made(config.mlflow_tracking, config.region):
            if config.mlflow_tracking == "auto":
                Annotations.of(self).add_warning_v2("ray-train-eks:untracked", untracked_note(config.region))
            return None
        self.tracking = MlflowTracking(self, "Tracking", bucket=self.storage.bucket,
                                       removal_policy=RemovalPolicy.DESTROY if config.destroy_data else RemovalPolicy.RETAIN)
        self.tracking.grant_logging(self.ray_service_account.role)
        return self.tracking.tracking_uri

    def _observability(self, config: PlatformConfig) -> None:
        """Container Insights, the dashboard and the idle-GPU alarm, when asked for."""
        self.observability: CloudWatchObservability | None = None
        self.dashboard: TrainingDashboard | None = None
        self.idle_gpu_alarm: IdleGpuAlarm | None = None
        if config.observability:
            self._add_observability(config, self.training_cluster.cluster)

    def _outputs(self, config: PlatformConfig) -> None:
        """The cost estimate and the stack outputs."""
        cluster = self.training_cluster.cluster
        self.cost = estimate_cost(
            gpu_instance_type=config.gpu_instance_type,
            gpu_node_count=config.gpu_node_count,
            system_instance_type=config.system_instance_type,
            system_node_count=config.system_node_count,
            gpu_on_demand=config.gpu_capacity == "karpenter",
            observability=config.observability,
            gpu_spot=config.capacity.spot,
            gpu_reserved=config.capacity_reservation_type if config.capacity.reserved else None,
            mlflow_app=self.tracking is not None,
            serving_gpu_nodes=config.serving_gpu_nodes,
            serving_idle_minutes=config.serving_idle_minutes,
        )
        CfnOutput(self, "ClusterName", value=cluster.cluster_name)
        CfnOutput(self, "VpcId", value=cluster.vpc.vpc_id, description="the VPC (what a stopped destroy may need: docs/deploying.md)")
        if self.account_checks is not None:
            CfnOutput(self, "QuotaForUpdates", value=self.account_checks.update_needs,
                      description="the account's vCPU quotas against what a node-group update launches (a create needs less)")
            if self.account_checks.reservation_ends is not None:
                CfnOutput(self, "GpuReservationEnds", value=self.account_checks.reservation_ends,
                          description="when the earliest Capacity Block ends (none: no block); EC2 terminates its "
                                      "instances from 30 minutes before, and a run checkpoints and stops before then")
        CfnOutput(
            self,
            "UpdateKubeconfigCommand",
            value=f"aws eks update-kubeconfig --region {self.region} --name {cluster.cluster_name}",
        )
        CfnOutput(self, "BucketName", value=self.storage.bucket.bucket_name)
        CfnOutput(
            self,
            "EstimatedCostUsdPerHour",
            value=f"{self.cost.total_usd:.2f}",
            description=self.cost.describe(),
        )
        CfnOutput(
            self,
            "EstimatedIdleCostUsdPerHour",
            value=f"{self.cost.idle_usd:.2f}",
            description="USD/hour with no job running and no served model answering: "
            + ("GPU nodes removed by Karpenter" if config.gpu_capacity == "karpenter" else "the GPU node group keeps billing")
            + ("; a service's head runs on the system nodes" if config.serving_gpu_nodes else ""),
        )
        if self.cost.serving_usd:
            CfnOutput(self, "EstimatedServingCostUsdPerHour", value=f"{self.cost.serving_usd:.2f}",
                      description=f"USD/hour more, at most, while served models answer (servingGpuNodes="
                                  f"{config.serving_gpu_nodes} GPU nodes of their own); 0 once idle "
                                  f"{config.serving_idle_minutes} min")
        if self.gpu_capacity is not None:
            CfnOutput(self, "WatchGpuNodesCommand", value="kubectl get nodepools,nodeclaims -o wide --watch")
        if self.tracking is not None:
            CfnOutput(self, "MlflowTrackingUri", value=self.tracking.tracking_uri,
                      description="the runs' MLflow (a SageMaker MLflow App; its runs outlive cdk destroy)")
            CfnOutput(self, "MlflowUiCommand",
                      value=Fn.join("", ["aws sagemaker create-presigned-mlflow-app-url --arn ", self.tracking.tracking_uri,
                                         " --query AuthorizedUrl --output text"]),
                      description="prints a URL of the MLflow UI (valid for minutes)")

    def _add_observability(self, config: PlatformConfig, cluster) -> None:
        """Container Insights through the add-on, the idle-GPU alarm and the dashboard; one
        customer managed key for the log groups and the alarm's topic. The key stays as long as
        the logs it encrypts (retained unless destroyData)."""
        removal = RemovalPolicy.DESTROY if config.destroy_data else RemovalPolicy.RETAIN
        self.observability_key = customer_managed_key(
            self, "ObservabilityKey", removal_policy=removal,
            description="Encryption of the Container Insights log groups and the idle-GPU alarm's topic")
        self.observability = CloudWatchObservability(
            self,
            "Observability",
            cluster=cluster,
            addon_version=config.observability_addon_version,
            log_retention_days=config.log_retention_days,
            removal_policy=removal,
            encryption_key=self.observability_key,
        )
        # Its operator and cluster scraper are Deployments: a node must be there to run them.
        self.observability.addon.node.add_dependency(self.training_cluster.system_nodes)
        self.idle_gpu_alarm = IdleGpuAlarm(
            self,
            "IdleGpuAlarm",
            cluster_name=cluster.cluster_name,
            threshold_percent=config.idle_gpu_utilization_percent,
            minutes=config.idle_gpu_minutes,
            email=config.alarm_email,
            encryption_key=self.observability_key,
            instance_types=[config.gpu_instance_type],
            # Serving's NodePool (Karpenter): a replica idles between requests, and goes on its own.
            excluded_node_pools=[self.gpu_capacity.serving_pool["metadata"]["name"]]
            if getattr(self.gpu_capacity, "serving_pool", None) else [],
        )
        self.dashboard = TrainingDashboard(
            self,
            "Dashboard",
            cluster_name=cluster.cluster_name,
            ray_namespace=RAY_NAMESPACE,
            training_namespace=TRAINING_METRICS_NAMESPACE,
            alarms=[self.idle_gpu_alarm.alarm],
            log_group_name=application_log_group_name(cluster.cluster_name),
        )
        CfnOutput(self, "DashboardUrl", value=self.dashboard.url)
        CfnOutput(self, "ApplicationLogGroup", value=application_log_group_name(cluster.cluster_name),
                  description="Container logs of every pod (Fluent Bit); the training lines come from the job submitter")
        CfnOutput(self, "IdleGpuAlarmTopicArn", value=self.idle_gpu_alarm.topic.topic_arn,
                  description="Subscribe here (e-mail, chat) to hear of GPU nodes idling; -c alarmEmail=... does it for you")

    @property
    def availability_zones(self) -> list[str]:
        """The configured AZs when given (no lookup), else CDK's default behaviour."""
        if getattr(self, "_configured_azs", None):
            return list(self._configured_azs)
        return super().availability_zones
