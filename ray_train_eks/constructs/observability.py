"""Seeing the run: the CloudWatch observability EKS add-on (Container Insights with enhanced
observability, Fluent Bit, the DCGM exporter), one dashboard, and an alarm for idle GPUs.

Metric names and dimensions come from :data:`ray_train_eks.observability.METRICS`, one
table with the page each comes from.
"""

from __future__ import annotations

from typing import Mapping, Sequence

from aws_cdk import Duration, RemovalPolicy, Stack, aws_cloudwatch as cw, aws_cloudwatch_actions as cw_actions
from aws_cdk import aws_eks_v2 as eks, aws_iam as iam, aws_logs as logs, aws_sns as sns, aws_sns_subscriptions as subs
from constructs import Construct

import re

from ray_train_eks.nag import acknowledge, managed_policy_rule
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
from ray_train_eks.validation import Prop, raise_problems

ADDON_NAME = "amazon-cloudwatch-observability"
#: Where the add-on runs, and the service account of the CloudWatch agent and Fluent Bit (chart 6.4.0).
ADDON_NAMESPACE = "amazon-cloudwatch"
AGENT_SERVICE_ACCOUNT = "cloudwatch-agent"
#: An agent belongs on every node: tolerate every taint (the chart's own default, set here
#: so that a new default cannot take the DaemonSets off the GPU nodes).
TOLERATE_EVERYTHING = ({"operator": "Exists"},)
PERIOD = Duration.minutes(1)
_ADDON_VERSION = re.compile(r"^v(\d+)\.(\d+)\.(\d+)-eksbuild\.\d+$")
# Deliberately loose (SNS confirms the address): one @, a dot in the domain, no spaces.
_EMAIL = re.compile(r"^[^@\s]+@[^@\s]+\.[^@\s]+$")
#: The idle-GPU alarm's window, minutes: under 5 it fires between two steps of a job; a day
#: is CloudWatch's longest alarm window.
IDLE_MINUTES = (5, 1440)


def addon_version_problem(version: str, prop: Prop = Prop("addon_version")) -> str | None:
    """Why the add-on release ``version`` cannot be used, or None."""
    match = _ADDON_VERSION.match(version)
    if not match:
        return (f"{prop(version)}: an EKS add-on version looks like {ADDON_VERSION} (list them: aws eks "
                f"describe-addon-versions --addon-name {ADDON_NAME})")
    if tuple(int(part) for part in match.groups()) < MIN_POD_IDENTITY_ADDON_VERSION:
        minimum = ".".join(map(str, MIN_POD_IDENTITY_ADDON_VERSION))
        return (f"{prop(version)}: before v{minimum} the add-on cannot take its credentials from EKS Pod Identity; "
                f"use {ADDON_VERSION}")
    return None


def log_retention_problem(days: int, prop: Prop = Prop("log_retention_days")) -> str | None:
    """Why ``days`` is not a retention CloudWatch Logs accepts, or None."""
    if days not in LOG_RETENTION_DAYS:
        return f"{prop(days)}: not a CloudWatch Logs retention; use one of {', '.join(map(str, LOG_RETENTION_DAYS))}"
    return None


def idle_threshold_problem(percent: float, prop: Prop = Prop("threshold_percent")) -> str | None:
    """Why ``percent`` cannot be the idle-GPU threshold, or None."""
    if not 1 <= percent <= 100:
        return f"{prop(percent)}: a percentage from 1 to 100; e.g. 5"
    return None


def idle_minutes_problem(minutes: int, prop: Prop = Prop("minutes")) -> str | None:
    """Why ``minutes`` cannot be the idle-GPU alarm's window, or None."""
    low, high = IDLE_MINUTES
    if not low <= minutes <= high:
        return (f"{prop(minutes)}: use {low} to {high} minutes (a day, CloudWatch's longest alarm window; under {low} the "
                f"alarm fires between two steps of a job); e.g. 30")
    return None


def alarm_email_problem(email: str | None, prop: Prop = Prop("email")) -> str | None:
    """Why ``email`` is not an e-mail address, or None."""
    if email is not None and not _EMAIL.match(email):
        return f"{prop(email)}: not an e-mail address; e.g. {prop.example('you@example.com')}"
    return None


def application_log_group_name(cluster_name: str) -> str:
    """Where Fluent Bit sends container logs (the chart's ``application-log.conf``)."""
    return f"/aws/containerinsights/{cluster_name}/application"


def performance_log_group_name(cluster_name: str) -> str:
    """Where the agent writes the performance events the metrics come from."""
    return f"/aws/containerinsights/{cluster_name}/performance"


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
    Identity, and the log groups it writes to, created first with a retention.

    :param cluster: the cluster. An ``aws_eks_v2.Cluster`` of the app gets its
        eks-pod-identity-agent add-on here if nothing asked for it yet; an imported cluster
        must run that agent already (the association gives no credentials without it).
    :param addon_version: Default - :data:`ADDON_VERSION`.
    :param tolerations: of every DaemonSet the add-on runs. Default - every taint (so the
        agent, Fluent Bit and the DCGM exporter also run on tainted GPU nodes).
    :param log_retention_days: of the container logs and the performance events. Default - 30.
    :param removal_policy: of the log groups. Default - RETAIN (logs outlive the cluster).
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
    ) -> None:
        super().__init__(scope, id)
        raise_problems("CloudWatchObservability", [addon_version_problem(addon_version), log_retention_problem(log_retention_days)])
        self.configuration = addon_configuration(tolerations)
        self.role = iam.Role(
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
        acknowledge(
            self.role,
            "The CloudWatch agent needs CloudWatchAgentServerPolicy (metrics, logs, EC2 tags); AWS keeps it in step "
            "with the agent, and the trust policy limits the role to this cluster's cloudwatch-agent service account.",
            managed_policy_rule("CloudWatchAgentServerPolicy"),
        )
        retention = _retention(log_retention_days)
        self.application_log_group = logs.LogGroup(
            self, "ApplicationLogs", log_group_name=application_log_group_name(cluster.cluster_name),
            retention=retention, removal_policy=removal_policy,
        )
        self.performance_log_group = logs.LogGroup(
            self, "PerformanceLogs", log_group_name=performance_log_group_name(cluster.cluster_name),
            retention=retention, removal_policy=removal_policy,
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
        self.addon.node.add_dependency(self.application_log_group, self.performance_log_group)
        pod_identity_agent = getattr(cluster, "eks_pod_identity_agent", None)
        if pod_identity_agent is not None:
            self.addon.node.add_dependency(pod_identity_agent)


def _retention(days: int) -> logs.RetentionDays:
    """CDK's enum member for ``days`` (its members list the API's values in this order)."""
    finite = [m for m in logs.RetentionDays if m.name != "INFINITE"]
    return dict(zip(LOG_RETENTION_DAYS, finite, strict=True))[days]


class IdleGpuAlarm(Construct):
    """An alarm when GPU nodes are up and no GPU is busy: the busiest GPU of the cluster under
    ``threshold_percent`` for ``minutes`` minutes in a row, with an SNS topic (and an e-mail
    subscription when ``email`` is given).

    It reads ``node_gpu_utilization`` of the whole cluster, which has data only while GPU
    nodes report: with no GPU node (Karpenter removed them) the alarm stays OK. A GPU no pod
    holds still reports it: the agent's gpuattributes processor drops only the container and
    pod GPU metrics that lack a pod (aws/amazon-cloudwatch-agent, ``filterGpuMetricsWithoutPodName``).
    """

    def __init__(self, scope: Construct, id: str, *, cluster_name: str, threshold_percent: float = 5,
                 minutes: int = 30, email: str | None = None) -> None:
        super().__init__(scope, id)
        raise_problems("IdleGpuAlarm", [idle_threshold_problem(threshold_percent), idle_minutes_problem(minutes),
                                        alarm_email_problem(email)])
        spec = METRICS["cluster_gpu_utilization"]
        self.metric = cw.Metric(
            namespace=spec.namespace, metric_name=spec.name, dimensions_map={"ClusterName": cluster_name},
            statistic="Maximum", period=PERIOD, label="busiest GPU (%)",
        )
        self.topic = sns.Topic(self, "Topic", display_name="ray-train-eks idle GPUs", enforce_ssl=True)
        acknowledge(
            self.topic,
            "The topic carries alarm state changes only (no data); CloudWatch alarms cannot publish to a topic "
            "encrypted with the AWS managed SNS key, and a customer key for this is not worth its monthly fee.",
            "AwsSolutions-SNS2",
        )
        if email:
            self.topic.add_subscription(subs.EmailSubscription(email))
        self.alarm = cw.Alarm(
            self,
            "Resource",
            metric=self.metric,
            threshold=threshold_percent,
            comparison_operator=cw.ComparisonOperator.LESS_THAN_THRESHOLD,
            evaluation_periods=minutes,
            datapoints_to_alarm=minutes,
            # No data = no GPU node reports: nothing idles.
            treat_missing_data=cw.TreatMissingData.NOT_BREACHING,
            alarm_description=(
                f"GPU nodes of cluster {cluster_name} are up and no GPU has been above {threshold_percent}% for "
                f"{minutes} minutes: the job ended or hangs. Scale down (-c gpuNodeCount, gpuCapacity=karpenter) "
                f"or cdk destroy."
            ),
        )
        self.alarm.add_alarm_action(cw_actions.SnsAction(self.topic))
        self.alarm.add_ok_action(cw_actions.SnsAction(self.topic))


class TrainingDashboard(Construct):
    """One CloudWatch dashboard for a training cluster: per GPU node GPU utilisation, memory
    and power; EFA bytes received and sent per node next to the preflight's bus bandwidth and
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

        def node_graph(key: str, title: str, unit: str, statistic: str = "Average") -> cw.GraphWidget:
            return self._graph(title, [self._search(key, statistic, ClusterName=cluster_name)], unit)

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
            node_graph("gpu_utilization", "GPU utilisation per GPU node", "%"),
            node_graph("gpu_memory_utilization", "GPU memory used per GPU node", "%"),
            node_graph("gpu_power_draw", "GPU power per GPU node", "W"),
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
            self._graph("Step time", [self._search("training_step_seconds", "Average")], "s", width=12),
            self._graph("Gradient norm", [self._search("training_grad_norm", "Average")], "norm", width=12),
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
