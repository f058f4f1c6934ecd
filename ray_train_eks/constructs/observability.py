"""Seeing the run: the CloudWatch observability EKS add-on (Container Insights with enhanced
observability, Fluent Bit, the DCGM exporter), one dashboard, and an alarm for idle GPUs.

Metric names and dimensions come from :data:`ray_train_eks.observability.METRICS`, one
table with the page each comes from.
"""

from __future__ import annotations

from typing import Mapping, Sequence

from aws_cdk import ArnFormat, Duration, RemovalPolicy, Stack, aws_cloudwatch as cw, aws_cloudwatch_actions as cw_actions
from aws_cdk import aws_eks_v2 as eks, aws_iam as iam, aws_kms as kms, aws_sns as sns, aws_sns_subscriptions as subs
from constructs import Construct

from ray_train_eks.constructs.custom_resource import PythonCustomResource
from ray_train_eks.constructs.gpu_instance_counter import GpuInstanceCounter
from ray_train_eks.constructs.keys import allow_logs_to_use, customer_managed_key
from ray_train_eks.nag import acknowledge, managed_policy_rule, wildcard_rule
from ray_train_eks.observability import (
    ADDON_VERSION,
    CLUSTER,
    LOG_RETENTION_DAYS,
    METRICS,
    MIN_POD_IDENTITY_ADDON_VERSION,
    TRAINING_METRICS_NAMESPACE,
    MetricSpec,
    search_expression,
    with_namespace,
)
# The add-on's and the alarm's rules live in ray_train_eks/rules/observability.py (no CDK
# import); imported back so that they stay importable from here.
from ray_train_eks.rules.observability import (
    ADDON_NAME,
    IDLE_LATE_MINUTES,
    IDLE_MINUTES,
    addon_version_problem,
    alarm_email_problem,
    idle_minutes_problem,
    idle_threshold_problem,
    log_retention_problem,
)
from ray_train_eks.validation import raise_problems

#: Where the add-on runs, and the service account of the CloudWatch agent and Fluent Bit (chart 6.4.0).
ADDON_NAMESPACE = "amazon-cloudwatch"
AGENT_SERVICE_ACCOUNT = "cloudwatch-agent"
#: An agent belongs on every node: tolerate every taint (the chart's own default, set here
#: so that a new default cannot take the DaemonSets off the GPU nodes).
TOLERATE_EVERYTHING = ({"operator": "Exists"},)
PERIOD = Duration.minutes(1)


#: The log groups the add-on writes to, under /aws/containerinsights/<cluster>/: Fluent Bit's
#: application, dataplane and host logs (chart 6.4.0, containerLogs.fluentBit.config.extraFiles)
#: and the agent's performance events.
ADDON_LOG_GROUPS = ("application", "dataplane", "host", "performance")


def addon_log_group_name(cluster_name: str, kind: str) -> str:
    """Where the add-on writes ``kind`` (one of :data:`ADDON_LOG_GROUPS`)."""
    return f"/aws/containerinsights/{cluster_name}/{kind}"


def application_log_group_name(cluster_name: str) -> str:
    """Where Fluent Bit sends container logs (the chart's ``application-log.conf``)."""
    return addon_log_group_name(cluster_name, "application")


def addon_configuration(tolerations: Sequence[Mapping[str, str]]) -> dict:
    """The add-on's configuration values: container logs on, enhanced Container Insights with
    the accelerated-compute (NVIDIA GPU, EFA) metrics, and ``tolerations`` on every component.

    Giving ``agent.config`` replaces the add-on's default agent configuration: Application
    Signals (traces, APM) stays off, since nothing here is instrumented for it."""
    return {
        "tolerations": [dict(t) for t in tolerations],
        "containerLogs": {"enabled": True},
        "agent": {
            "config": {
                "logs": {
                    "metrics_collected": {
                        "kubernetes": {"enhanced_container_insights": True, "accelerated_compute_metrics": True}
                    }
                }
            }
        },
    }


class CloudWatchObservability(Construct):
    """The ``amazon-cloudwatch-observability`` EKS add-on with its credentials through EKS Pod
    Identity, and every log group it writes to, kept with a retention, a KMS key and a removal
    of ours.

    The add-on writes to fixed names and creates a missing group without retention; a
    ``AWS::Logs::LogGroup`` of that name fails once a retained group exists (observability
    switched off, then on). So the groups (application, dataplane, host, performance) are
    created, or adopted, by a custom resource (``ray_train_eks/handlers/log_groups.py``) before
    the add-on starts, with the retention and the key set either way, and deleted on removal
    only when ``removal_policy`` is DESTROY.

    :param cluster: the cluster. An ``aws_eks_v2.Cluster`` of the app gets its
        eks-pod-identity-agent add-on here if nothing asked for it yet; an imported cluster
        must run that agent already (the association gives no credentials without it).
    :param addon_version: Default - :data:`ADDON_VERSION`.
    :param tolerations: of every DaemonSet the add-on runs. Default - every taint (so the
        agent, Fluent Bit and the DCGM exporter also run on tainted GPU nodes).
    :param log_retention_days: of every log group the add-on writes. Default - 30.
    :param removal_policy: of the log groups (and of the key made here). Default - RETAIN (logs outlive the cluster).
    :param encryption_key: the customer managed key of the log groups; its policy gets a
        statement for CloudWatch Logs (an imported key must have one already). Default - a new key.
    """

    def __init__(
        self,
        scope: Construct,
        id: str,
        *,
        cluster: eks.ICluster,
        addon_version: str = ADDON_VERSION,
        tolerations: Sequence[Mapping[str, str]] = TOLERATE_EVERYTHING,
        log_retention_days: int = 30,
        removal_policy: RemovalPolicy = RemovalPolicy.RETAIN,
        encryption_key: kms.IKey | None = None,
    ) -> None:
        super().__init__(scope, id)
        raise_problems("CloudWatchObservability", [addon_version_problem(addon_version), log_retention_problem(log_retention_days)])
        self.configuration = addon_configuration(tolerations)
        stack = Stack.of(self)
        self.encryption_key = encryption_key or customer_managed_key(
            self, "LogsKey", description="Encryption of the Container Insights log groups", removal_policy=removal_policy)
        groups_arn = stack.format_arn(service="logs", resource="log-group",
                                      resource_name=addon_log_group_name(cluster.cluster_name, "*"),
                                      arn_format=ArnFormat.COLON_RESOURCE_NAME)
        allow_logs_to_use(self.encryption_key)
        self.role = self._agent_role(cluster)
        self.log_group_names = [addon_log_group_name(cluster.cluster_name, kind) for kind in ADDON_LOG_GROUPS]
        self.log_groups = PythonCustomResource(
            self,
            "LogGroups",
            handler="log_groups.on_event",
            description="Creates or adopts the Container Insights log groups with a retention and a KMS key",
            properties={
                "LogGroupNames": self.log_group_names,
                "RetentionInDays": str(log_retention_days),
                "KmsKeyArn": self.encryption_key.key_arn,
                "DeleteOnRemoval": "true" if removal_policy == RemovalPolicy.DESTROY else "false",
            },
            statements=[iam.PolicyStatement(
                actions=["logs:CreateLogGroup", "logs:PutRetentionPolicy", "logs:AssociateKmsKey",
                         "logs:DisassociateKmsKey", "logs:DeleteLogGroup"],
                resources=[groups_arn],
            )],
            log_encryption_key=self.encryption_key,
        )
        self.log_groups.node.add_dependency(self.encryption_key)
        acknowledge(
            self.log_groups,
            "The function manages the add-on's log groups, whose names end in /application, /dataplane, /host and "
            "/performance under the cluster's /aws/containerinsights/<cluster>/ prefix: one wildcard after that prefix.",
            wildcard_rule(self, groups_arn),
        )
        self.addon = eks.Addon(
            self,
            "Resource",
            cluster=cluster,
            addon_name=ADDON_NAME,
            addon_version=addon_version,
            configuration_values=self.configuration,
        )
        cfn_addon = self.addon.node.default_child
        # aws_eks_v2.Addon has no prop for it yet; CloudFormation creates the association with the add-on.
        cfn_addon.pod_identity_associations = [{"serviceAccount": AGENT_SERVICE_ACCOUNT, "roleArn": self.role.role_arn}]
        # Fluent Bit and the agent would create these groups themselves, without retention.
        self.addon.node.add_dependency(self.log_groups)
        pod_identity_agent = getattr(cluster, "eks_pod_identity_agent", None)
        if pod_identity_agent is not None:
            self.addon.node.add_dependency(pod_identity_agent)

    def _agent_role(self, cluster: eks.ICluster) -> iam.Role:
        """The role of the agent and Fluent Bit: CloudWatchAgentServerPolicy, assumable through
        Pod Identity by this cluster's agent service account only, and the key through CloudWatch
        Logs (kms:ViaService), which the CloudWatch Logs guide now asks of writers to encrypted groups."""
        role = iam.Role(
            self,
            "AgentRole",
            description="CloudWatch agent and Fluent Bit of the amazon-cloudwatch-observability add-on (EKS Pod Identity)",
            assumed_by=iam.SessionTagsPrincipal(
                iam.PrincipalWithConditions(
                    iam.ServicePrincipal("pods.eks.amazonaws.com"),
                    {
                        # Session tags EKS Pod Identity sets (EKS user guide, "pod-id-role" and
                        # "pod-id-abac"): only this cluster's agent service account.
                        "StringEquals": {
                            "aws:RequestTag/eks-cluster-name": cluster.cluster_name,
                            "aws:RequestTag/kubernetes-namespace": ADDON_NAMESPACE,
                            "aws:RequestTag/kubernetes-service-account": AGENT_SERVICE_ACCOUNT,
                        }
                    },
                )
            ),
            managed_policies=[iam.ManagedPolicy.from_aws_managed_policy_name("CloudWatchAgentServerPolicy")],
        )
        role.add_to_policy(iam.PolicyStatement(
            actions=["kms:GenerateDataKey", "kms:Decrypt", "kms:DescribeKey"],
            resources=[self.encryption_key.key_arn],
            conditions={"StringEquals": {"kms:ViaService": f"logs.{Stack.of(self).region}.amazonaws.com"}},
        ))
        acknowledge(
            role,
            "The CloudWatch agent needs CloudWatchAgentServerPolicy (metrics, logs, EC2 tags); AWS keeps it in step "
            "with the agent, and the trust policy limits the role to this cluster's cloudwatch-agent service account.",
            managed_policy_rule("CloudWatchAgentServerPolicy"),
        )
        return role


class IdleGpuAlarm(Construct):
    """An alarm when GPU nodes are up and no GPU does tensor work: idle, or hung. It reaches
    someone: an SNS topic encrypted with a customer managed key that CloudWatch may use, whose
    policy lets this alarm publish (and an e-mail subscription when ``email`` is given).

    What it reads, for the whole cluster, each minute (metric math, as alarms cannot SEARCH):

    - ``tensor``: the busiest GPU's tensor-core activity (``node_gpu_tensor_core_utilization``,
      DCGM's ``PROF_PIPE_TENSOR_ACTIVE``, statistic Maximum). GPU utilisation cannot tell a hang
      from work: a GPU spinning in an NCCL kernel shows 100%; its tensor pipe is idle.
    - ``gpus``: the GPUs of the nodes (``node_gpu_limit``, from the nodes' capacity through the
      API server, not from DCGM), sent by the same agent, and only for a node whose GPUs the
      device plugin advertises.
    - ``instances`` (with ``instance_types``): the cluster's running GPU instances, counted from
      EC2 each minute by a function of this construct (ray_train_eks/handlers/gpu_instances.py):
      what bills, whatever the agent says. Without it an agent that is not running on the GPU
      nodes, or a plugin that never advertises their GPUs, silences both inputs above and the
      alarm stays OK while the nodes bill.

    ``IF(MAX([FILL(instances, 0), FILL(gpus, 0)]) > 0, FILL(tensor, 0), 1)``: no GPU instance and
    no GPU node, nothing to alarm on (1 is busy, and no data at all is not breaching); GPU
    instances whose GPU metrics are missing (an absent agent, a crashed DCGM exporter, a plugin
    not advertising, metrics not yet arrived) count as idle. A late minute therefore reads idle,
    never busy, so late metrics cannot keep the alarm OK; a busy job's few late minutes stay
    under the ``minutes`` of ``minutes`` + :data:`IDLE_LATE_MINUTES` it takes. The agent forwards DCGM's ratio of busy cycles
    (0 to 1) under the unit Percent, unscaled (aws/amazon-cloudwatch-agent v1.300070.0,
    metricstransformprocessor/translator.go scales GPU memory utilisation only), so the
    threshold is ``threshold_percent`` / 100 of that ratio: were it ever sent as a percentage,
    the zeros of idle and hung GPUs would still alarm.

    :param cluster_name: the EKS cluster (Container Insights' ``ClusterName``).
    :param threshold_percent: Default - 5 (% of cycles with the tensor pipe busy).
    :param minutes: idle minutes among the last ``minutes`` + :data:`IDLE_LATE_MINUTES` (the
        newest minutes arrive late). Default - 30.
    :param email: an address to subscribe. Default - none.
    :param encryption_key: the topic's customer managed key; its policy gets a statement for
        CloudWatch (an imported key must have one already). Default - a new key.
    :param instance_types: the GPU instance types of the cluster, counted from EC2 (``instances``).
        Default - none: the alarm judges on the agent's inputs alone.
    :param metrics_namespace: where the count is published. Default - ``RayTrainEks/Training``.
    :param excluded_node_pools: Karpenter NodePools whose instances the alarm does not count (serving's:
        a replica idles between requests by design). Then the instances counted from EC2 alone say
        whether GPU nodes are up (the agent's GPU count includes the excluded nodes); the tensor
        activity is still the cluster's busiest GPU, so a busy serving replica hides idle training
        GPUs beside it. Needs ``instance_types``. Default - none.
    """

    def __init__(self, scope: Construct, id: str, *, cluster_name: str, threshold_percent: float = 5,
                 minutes: int = 30, email: str | None = None, encryption_key: kms.IKey | None = None,
                 instance_types: Sequence[str] = (), metrics_namespace: str = TRAINING_METRICS_NAMESPACE,
                 excluded_node_pools: Sequence[str] = ()) -> None:
        super().__init__(scope, id)
        raise_problems("IdleGpuAlarm", [idle_threshold_problem(threshold_percent), idle_minutes_problem(minutes),
                                        alarm_email_problem(email)])
        self.encryption_key = encryption_key or customer_managed_key(
            self, "TopicKey", description="Encryption of the idle-GPU alarm's topic", removal_policy=RemovalPolicy.DESTROY)
        # CloudWatch alarms publish to an encrypted topic only with a customer managed key whose
        # policy lets them (SNS guide, "Enable compatibility between event sources from AWS
        # services and encrypted topics"); AWS's examples carry no condition here.
        self.encryption_key.add_to_resource_policy(iam.PolicyStatement(
            actions=["kms:GenerateDataKey*", "kms:Decrypt"],
            principals=[iam.ServicePrincipal("cloudwatch.amazonaws.com")],
            resources=["*"],
        ))
        self.topic = sns.Topic(self, "Topic", display_name="ray-train-eks idle GPUs", enforce_ssl=True,
                               master_key=self.encryption_key)
        if email:
            self.topic.add_subscription(subs.EmailSubscription(email))

        def cluster_metric(key: str, label: str) -> cw.Metric:
            spec = METRICS[key]
            return cw.Metric(namespace=spec.namespace, metric_name=spec.name, dimensions_map={"ClusterName": cluster_name},
                             statistic="Maximum", period=PERIOD, label=label)

        using = {"tensor": cluster_metric("cluster_gpu_tensor_core_utilization", "busiest GPU's tensor-core activity"),
                 "gpus": cluster_metric("cluster_gpu_limit", "GPUs of the nodes")}
        present = "FILL(gpus, 0)"
        self.counter: GpuInstanceCounter | None = None
        if instance_types:
            self.counter = GpuInstanceCounter(self, "Instances", cluster_name=cluster_name, instance_types=instance_types,
                                              namespace=metrics_namespace, log_encryption_key=self.encryption_key,
                                              excluded_node_pools=excluded_node_pools)
            using["instances"] = self.counter.metric
            present = "FILL(instances, 0)" if excluded_node_pools else "MAX([FILL(instances, 0), FILL(gpus, 0)])"
        self.metric = cw.MathExpression(
            expression=f"IF({present} > 0, FILL(tensor, 0), 1)",
            using_metrics=using,
            label="busiest GPU's tensor-core activity (0 with GPU instances but no GPU metrics)",
            period=PERIOD,
        )
        self.alarm = cw.Alarm(
            self,
            "Resource",
            metric=self.metric,
            threshold=threshold_percent / 100,
            comparison_operator=cw.ComparisonOperator.LESS_THAN_THRESHOLD,
            # M out of N: ``minutes`` idle datapoints among the newest ``minutes`` + IDLE_LATE_MINUTES,
            # so the newest minutes, which arrive late and are filled as busy, do not hold it off.
            evaluation_periods=minutes + IDLE_LATE_MINUTES,
            datapoints_to_alarm=minutes,
            # No data at all = no GPU node reports = nothing idles (GPU nodes without GPU
            # metrics are data: the expression gives 0 for them).
            treat_missing_data=cw.TreatMissingData.NOT_BREACHING,
            alarm_description=(
                f"GPU nodes of cluster {cluster_name} are up and no GPU has done tensor work (above {threshold_percent}% "
                f"of cycles) for {minutes} minutes: the job ended, or hangs (a collective that never completes keeps GPU "
                f"utilisation at 100% with the tensor cores idle), or the GPU metrics stopped. Scale down "
                f"(-c gpuNodeCount, gpuCapacity=karpenter) or cdk destroy."
            ),
        )
        self.alarm.add_alarm_action(cw_actions.SnsAction(self.topic))
        self.alarm.add_ok_action(cw_actions.SnsAction(self.topic))
        # A topic policy replaces SNS's default one, which let the account's principals publish:
        # CloudWatch needs its own allow, for this alarm of this account only.
        self.topic.add_to_resource_policy(iam.PolicyStatement(
            sid="AllowTheIdleGpuAlarmToPublish",
            actions=["sns:Publish"],
            principals=[iam.ServicePrincipal("cloudwatch.amazonaws.com")],
            resources=[self.topic.topic_arn],
            conditions={"ArnLike": {"aws:SourceArn": self.alarm.alarm_arn},
                        "StringEquals": {"aws:SourceAccount": Stack.of(self).account}},
        ))


class TrainingDashboard(Construct):
    """One CloudWatch dashboard for a training cluster: per GPU node GPU utilisation, tensor-core
    activity, memory and power; EFA bytes received and sent per node next to the preflight's bus bandwidth and
    transport; node count by role; CPU and memory of the Ray pods; and the training curves.

    Every series is a SEARCH over the :data:`~ray_train_eks.observability.METRICS` table, so
    nodes, pods and runs appear as they come.

    :param cluster_name: the EKS cluster (Container Insights' ``ClusterName``).
    :param ray_namespace: Kubernetes namespace of the Ray pods. Default - default.
    :param training_namespace: CloudWatch namespace of the training metrics (the pods'
        ``RAY_TRAIN_EKS_METRICS_NAMESPACE``). Default - RayTrainEks/Training.
    :param alarms: shown at the top. Default - none.
    :param log_group_name: named in the header. Default - none.
    """

    def __init__(self, scope: Construct, id: str, *, cluster_name: str, ray_namespace: str = "default",
                 training_namespace: str = TRAINING_METRICS_NAMESPACE, alarms: Sequence[cw.IAlarm] = (),
                 log_group_name: str | None = None) -> None:
        super().__init__(scope, id)
        self.cluster_name = cluster_name
        self.training_namespace = training_namespace
        self.dashboard = cw.Dashboard(self, "Resource", default_interval=Duration.hours(6))

        def node_graph(key: str, title: str, unit: str, statistic: str = "Average", width: int = 8) -> cw.GraphWidget:
            return self._graph(title, [self._search(key, statistic, ClusterName=cluster_name)], unit, width=width)

        header = cw.TextWidget(
            markdown=(
                "## Fine-tune on " + cluster_name + "\n"
                "GPU, EFA, node and pod metrics: Container Insights (enhanced observability); training curves: "
                f"namespace `{training_namespace}`, one line per run. "
                + (f"Container logs: log group `{log_group_name}`." if log_group_name else "")
            ),
            width=16 if alarms else 24, height=4,
        )
        top: list[cw.IWidget] = [header]
        if alarms:
            top.append(cw.AlarmStatusWidget(alarms=list(alarms), title="Idle GPUs", width=8, height=4))
        self.dashboard.add_widgets(*top)
        self.dashboard.add_widgets(
            node_graph("gpu_utilization", "GPU utilisation per GPU node", "%", width=6),
            # Busy with tensor work, or only spinning (a hang keeps utilisation at 100%).
            node_graph("gpu_tensor_core_utilization", "GPU tensor-core activity per GPU node", "ratio of cycles", width=6),
            node_graph("gpu_memory_utilization", "GPU memory used per GPU node", "%", width=6),
            node_graph("gpu_power_draw", "GPU power per GPU node", "W", width=6),
        )
        self.dashboard.add_widgets(
            node_graph("efa_rx_bytes", "EFA received per node", "bytes/s", "Sum"),
            node_graph("efa_tx_bytes", "EFA sent per node", "bytes/s", "Sum"),
            self._graph("Preflight all-reduce bus bandwidth, by NCCL transport",
                        [self._search("training_preflight_bus_bandwidth", "Maximum")], "GB/s"),
        )
        nodes = self._metric("node_count", "Maximum", label="all nodes")
        gpu_nodes = cw.MathExpression(
            # One series per GPU node that reports GPU metrics: count them.
            expression="SUM(gpu * 0 + 1)",
            using_metrics={"gpu": self._search("gpu_utilization", "Average", ClusterName=cluster_name)},
            label="GPU nodes", period=PERIOD,
        )
        system_nodes = cw.MathExpression(
            expression="nodes - FILL(gpus, 0)", using_metrics={"nodes": nodes, "gpus": gpu_nodes},
            label="other (system) nodes", period=PERIOD,
        )
        self.dashboard.add_widgets(
            self._graph("Nodes by role", [nodes, gpu_nodes, system_nodes], "nodes"),
            self._graph(f"CPU of the Ray pods (namespace {ray_namespace})",
                        [self._search("pod_cpu_utilization", "Average", ClusterName=cluster_name, Namespace=ray_namespace)],
                        "% of node"),
            self._graph(f"Memory of the Ray pods (namespace {ray_namespace})",
                        [self._search("pod_memory_utilization", "Average", ClusterName=cluster_name, Namespace=ray_namespace)],
                        "% of node"),
        )
        self.dashboard.add_widgets(
            self._graph("Training and eval loss", [self._search("training_loss", "Average"),
                                                   self._search("training_eval_loss", "Average")], "loss"),
            self._graph("Tokens per second (whole run)", [self._search("training_tokens_per_s", "Average")], "tokens/s"),
            self._graph("Model FLOPs utilisation", [self._search("training_mfu_percent", "Average")], "%"),
        )
        self.dashboard.add_widgets(
            self._graph("Step time", [self._search("training_step_seconds", "Average")], "s", width=8),
            self._graph("Gradient norm", [self._search("training_grad_norm", "Average")], "norm", width=8),
            # training/resilience/health.py: the slowest GPU's matmul against the median, every --health-check-every
            # steps; below 85% the log names it as a straggler with its node and GPU.
            self._graph("Slowest GPU, % of the median GPU's speed", [self._search("training_slowest_gpu_percent", "Minimum")],
                        "%", width=8),
        )
        stack = Stack.of(self)
        self.url = (
            f"https://{stack.region}.console.aws.amazon.com/cloudwatch/home?region={stack.region}"
            f"#dashboards/dashboard/{self.dashboard.dashboard_name}"
        )

    def _spec(self, key: str) -> MetricSpec:
        return with_namespace(METRICS[key], self.training_namespace)

    def _search(self, key: str, statistic: str, **equals: str) -> cw.MathExpression:
        spec = self._spec(key)
        # A dynamic label per series: the node, pod or run (and transport) it is of.
        shown = [d for d in ("NodeName", "FullPodName", "Run", "Transport") if d in spec.dimensions]
        return cw.MathExpression(expression=search_expression(spec, statistic, int(PERIOD.to_seconds()), **equals),
                                 using_metrics={}, period=PERIOD, label=" ".join(f"${{PROP('Dim.{d}')}}" for d in shown))

    def _metric(self, key: str, statistic: str, *, label: str) -> cw.Metric:
        spec = self._spec(key)
        if spec.dimensions != CLUSTER:
            raise ValueError(f"TrainingDashboard: {spec.name} is read per {spec.dimensions}; use a SEARCH")
        return cw.Metric(namespace=spec.namespace, metric_name=spec.name, dimensions_map={"ClusterName": self.cluster_name},
                         statistic=statistic, period=PERIOD, label=label)

    @staticmethod
    def _graph(title: str, metrics: Sequence[cw.IMetric], unit: str, width: int = 8, height: int = 6) -> cw.GraphWidget:
        return cw.GraphWidget(title=title, left=list(metrics), width=width, height=height,
                              left_y_axis=cw.YAxisProps(label=unit, show_units=False, min=0))
