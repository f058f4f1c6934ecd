"""Seeing the run: the CloudWatch observability add-on, its Pod Identity role, the log
groups, the dashboard (against the one metric table, and that table against AWS's metric
reference), the idle-GPU alarm, the picture in docs/operations.md and the cost arithmetic."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

from ray_train_eks.constructs.observability import IDLE_LATE_MINUTES

from ray_train_eks.constructs.efa_node_group import GPU_TAINT
from ray_train_eks.instances import INSTANCE_TYPES, estimate_cost
from ray_train_eks.observability import (
    ADDON_VERSION,
    CONTAINER_INSIGHTS,
    METRICS,
    OBSERVATIONS_PER_MINUTE,
    ObservabilityCost,
    observations_per_minute,
    search_expression,
)
from ray_train_eks.training_code.telemetry.cloudwatch import PREFLIGHT_METRIC, STEP_METRICS
from upstream import chart_values

pytestmark = pytest.mark.synth

ROOT = Path(__file__).resolve().parents[1]
TRAINING_NAMESPACE = "RayTrainEks/Training"
SEARCH = re.compile(r"SEARCH\('\{([^}]*)\} ([^']*)', '(\w+)', (\d+)\)")


def _render_module():
    spec = importlib.util.spec_from_file_location("render_dashboard", ROOT / "scripts" / "render_dashboard.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


render = _render_module()


def addon_of(platform):
    (addon,) = [r for r in platform.resources("AWS::EKS::Addon").values()
                if r["Properties"]["AddonName"] == "amazon-cloudwatch-observability"]
    return addon


def tolerates(tolerations: list[dict], key: str, value: str, effect: str) -> bool:
    """Kubernetes' rule: does one of ``tolerations`` tolerate the taint key=value:effect?"""
    for t in tolerations:
        if t.get("effect") not in (None, "", effect):
            continue
        if t.get("operator", "Equal") == "Exists":
            if t.get("key") in (None, "", key):
                return True
        elif t.get("key") == key and t.get("value") == value:
            return True
    return False


def test_the_toleration_rule_itself():
    assert tolerates([{"operator": "Exists"}], "nvidia.com/gpu", "true", "NoSchedule")
    assert tolerates([{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}], "nvidia.com/gpu", "true", "NoSchedule")
    assert not tolerates([{"key": "other", "operator": "Exists"}], "nvidia.com/gpu", "true", "NoSchedule")
    assert not tolerates([], "nvidia.com/gpu", "true", "NoSchedule")
    assert not tolerates([{"operator": "Exists", "effect": "NoExecute"}], "nvidia.com/gpu", "true", "NoSchedule")


# ---------------------------------------------------------------- the add-on


def test_addon_is_pinned_and_configured_for_logs_gpu_and_efa_metrics_on_tainted_gpu_nodes(default_platform):
    props = addon_of(default_platform)["Properties"]
    assert props["AddonVersion"] == ADDON_VERSION == "v6.4.0-eksbuild.1"
    config = json.loads(props["ConfigurationValues"])
    assert config["containerLogs"] == {"enabled": True}
    assert config["agent"]["config"]["logs"]["metrics_collected"]["kubernetes"] == {
        "enhanced_container_insights": True, "accelerated_compute_metrics": True,
    }
    from aws_cdk import aws_eks_v2 as eks

    key, value, effect = GPU_TAINT.key, GPU_TAINT.value, "NoSchedule"
    assert GPU_TAINT.effect == eks.TaintEffect.NO_SCHEDULE
    # The agent, Fluent Bit and the DCGM exporter all take the root tolerations (no component overrides them).
    assert tolerates(config["tolerations"], key, value, effect)
    assert not any("tolerations" in v for v in config.values() if isinstance(v, dict))


def test_addon_configuration_keys_exist_in_the_chart_it_installs():
    """EKS validates the configuration against the add-on's schema (the chart's values): a
    key the chart does not have fails the deploy. And the root tolerations we set replace
    the chart's, which tolerated everything too."""
    from ray_train_eks.constructs.observability import TOLERATE_EVERYTHING, addon_configuration

    values = chart_values("amazon-cloudwatch-observability")
    config = addon_configuration(TOLERATE_EVERYTHING)
    assert values["tolerations"] == [{"operator": "Exists"}] == config["tolerations"]
    assert "enabled" in values["containerLogs"] and "config" in values["agent"]
    assert set(config) <= set(values)


def test_dcgm_exporter_runs_on_every_gpu_type_the_app_offers():
    """The chart schedules its DCGM exporter by an instance-type list; a GPU type missing
    there would silently have no GPU metrics."""
    values = chart_values("amazon-cloudwatch-observability")
    terms = values["dcgmExporter"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    allowed = {v for term in terms for e in term["matchExpressions"] if e["key"] == "node.kubernetes.io/instance-type"
               for v in e["values"]}
    gpu_types = {name for name, spec in INSTANCE_TYPES.items() if spec.gpus}
    assert gpu_types <= allowed, sorted(gpu_types - allowed)


def test_addon_credentials_come_from_pod_identity_scoped_to_its_service_account(default_platform):
    addon = addon_of(default_platform)
    (association,) = addon["Properties"]["PodIdentityAssociations"]
    assert association["ServiceAccount"] == "cloudwatch-agent"
    role_id = association["RoleArn"]["Fn::GetAtt"][0]
    role = default_platform.template["Resources"][role_id]["Properties"]
    (statement,) = role["AssumeRolePolicyDocument"]["Statement"]
    assert statement["Principal"] == {"Service": "pods.eks.amazonaws.com"}
    assert sorted(statement["Action"]) == ["sts:AssumeRole", "sts:TagSession"]
    cluster_ref = {"Ref": default_platform.logical_id(default_platform.stack.training_cluster.cluster)}
    assert statement["Condition"] == {"StringEquals": {
        "aws:RequestTag/eks-cluster-name": cluster_ref,
        "aws:RequestTag/kubernetes-namespace": "amazon-cloudwatch",
        "aws:RequestTag/kubernetes-service-account": "cloudwatch-agent",
    }}
    (policy,) = role["ManagedPolicyArns"]
    assert policy["Fn::Join"][1][-1] == ":iam::aws:policy/CloudWatchAgentServerPolicy"
    # The association needs the Pod Identity agent; the operator needs a node.
    depends = addon["DependsOn"]
    assert any(d.startswith("ClusterEksPodIdentityAgent") for d in depends)
    assert any(d.startswith("ClusterNodegroupSystemNodes") for d in depends)


def _log_groups_resource(platform) -> dict:
    (resource,) = [r for r in platform.resources("AWS::CloudFormation::CustomResource").values()
                   if "LogGroupNames" in r["Properties"]]
    return resource


def test_every_log_group_the_addon_writes_is_made_or_adopted_before_it_with_retention_key_and_removal(
        default_platform, p4d_platform):
    addon = addon_of(default_platform)
    resource = _log_groups_resource(default_platform)
    props = resource["Properties"]
    cluster = {"Ref": default_platform.logical_id(default_platform.stack.training_cluster.cluster)}
    assert props["LogGroupNames"] == [{"Fn::Join": ["", ["/aws/containerinsights/", cluster, f"/{kind}"]]}
                                      for kind in ("application", "dataplane", "host", "performance")]
    assert (props["RetentionInDays"], props["DeleteOnRemoval"]) == ("30", "false")
    key_id = props["KmsKeyArn"]["Fn::GetAtt"][0]
    assert key_id == default_platform.logical_id(default_platform.stack.observability_key)
    custom_resource_id = next(k for k, v in default_platform.template["Resources"].items() if v is resource)
    assert custom_resource_id in addon["DependsOn"]
    # destroyData: the groups go with the stack, and their key with them; the retention follows the key.
    p4d_props = _log_groups_resource(p4d_platform)["Properties"]
    assert (p4d_props["RetentionInDays"], p4d_props["DeleteOnRemoval"]) == ("90", "true")
    assert not [g for g in default_platform.resources("AWS::Logs::LogGroup").values()
                if "containerinsights" in json.dumps(g["Properties"].get("LogGroupName", ""))]
    assert default_platform.template["Outputs"]["ApplicationLogGroup"]["Value"] == props["LogGroupNames"][0]


def test_the_log_groups_function_may_manage_the_clusters_container_insights_groups_only(default_platform):
    (policy,) = [p for k, p in default_platform.resources("AWS::IAM::Policy").items() if k.startswith("ObservabilityLogGroupsFunction")]
    (statement,) = policy["Properties"]["PolicyDocument"]["Statement"]
    assert sorted(statement["Action"]) == ["logs:AssociateKmsKey", "logs:CreateLogGroup", "logs:DeleteLogGroup",
                                           "logs:DisassociateKmsKey", "logs:PutRetentionPolicy"]
    resource = json.dumps(statement["Resource"])
    assert ":log-group:/aws/containerinsights/" in resource and resource.endswith('"/*"]]}')


def test_the_key_lets_cloudwatch_logs_and_alarms_use_it_and_the_agent_through_logs_only(default_platform, p4d_platform):
    key = default_platform.template["Resources"][default_platform.logical_id(default_platform.stack.observability_key)]
    assert key["Properties"]["EnableKeyRotation"] is True
    assert key["DeletionPolicy"] == "Retain"  # as long as the logs it encrypts
    statements = key["Properties"]["KeyPolicy"]["Statement"]
    logs_statement = next(s for s in statements if s.get("Principal", {}).get("Service") == "logs.us-west-2.amazonaws.com")
    assert sorted(logs_statement["Action"]) == ["kms:Decrypt*", "kms:Describe*", "kms:Encrypt*", "kms:GenerateDataKey*",
                                                "kms:ReEncrypt*"]
    context = logs_statement["Condition"]["ArnLike"]["kms:EncryptionContext:aws:logs:arn"]
    assert context["Fn::Join"][1][-1] == ":log-group:*"
    alarms_statement = next(s for s in statements if s.get("Principal", {}).get("Service") == "cloudwatch.amazonaws.com")
    assert sorted(alarms_statement["Action"]) == ["kms:Decrypt", "kms:GenerateDataKey*"]
    assert "Condition" not in alarms_statement
    # The agent writes to the encrypted groups: the key through CloudWatch Logs only.
    role_id = addon_of(default_platform)["Properties"]["PodIdentityAssociations"][0]["RoleArn"]["Fn::GetAtt"][0]
    (policy,) = [p for p in default_platform.resources("AWS::IAM::Policy").values()
                 if {"Ref": role_id} in p["Properties"]["Roles"]]
    (statement,) = policy["Properties"]["PolicyDocument"]["Statement"]
    assert statement["Condition"] == {"StringEquals": {"kms:ViaService": "logs.us-west-2.amazonaws.com"}}
    p4d_key = p4d_platform.template["Resources"][p4d_platform.logical_id(p4d_platform.stack.observability_key)]
    assert (p4d_key["DeletionPolicy"], p4d_key["Properties"]["PendingWindowInDays"]) == ("Delete", 7)


def test_observability_false_builds_none_of_it_and_costs_nothing(queued_platform):
    types = {r["Type"] for r in queued_platform.template["Resources"].values()}
    assert not types & {"AWS::CloudWatch::Dashboard", "AWS::CloudWatch::Alarm", "AWS::SNS::Topic"}
    assert not [r for r in queued_platform.resources("AWS::EKS::Addon").values()
                if r["Properties"]["AddonName"] == "amazon-cloudwatch-observability"]
    assert "DashboardUrl" not in queued_platform.template["Outputs"]
    assert queued_platform.stack.cost.observability is None
    assert "Container Insights" not in queued_platform.stack.cost.describe()


# ---------------------------------------------------------------- the metric table


def test_training_rows_of_the_table_are_what_rank_0_publishes():
    training = {spec.name: spec.dimensions for spec in METRICS.values() if spec.namespace == "<training>"}
    assert training == {**{name: ("Run",) for name, _, _ in STEP_METRICS}, PREFLIGHT_METRIC: ("Run", "Transport")}


def test_search_expression_rejects_a_dimension_the_metric_lacks():
    with pytest.raises(ValueError, match="node_gpu_utilization has no dimension Namespace"):
        search_expression(METRICS["gpu_utilization"], "Average", 60, Namespace="ray-train")


# ---------------------------------------------------------------- the dashboard


def metrics_read(body: dict) -> list[tuple[str, str, tuple[str, ...], dict]]:
    """(namespace, metric name, dimension names, dimension values) of every metric the
    dashboard reads, from SEARCH expressions and plain metric rows."""
    found = []
    for widget in body["widgets"]:
        for row in widget.get("properties", {}).get("metrics", []):
            options = row[-1] if isinstance(row[-1], dict) else {}
            expression = options.get("expression", "")
            for schema, terms, _statistic, period in SEARCH.findall(expression):
                namespace, *dimensions = [part.strip('"') for part in schema.split(",")]
                filters = dict(re.findall(r'(\w+)="([^"]*)"', terms))
                assert int(period) == 60
                found.append((namespace, filters.pop("MetricName"), tuple(dimensions), filters))
            if not expression and isinstance(row[0], str):
                namespace, name, *pairs = [part for part in row if not isinstance(part, dict)]
                found.append((namespace, name, tuple(sorted(pairs[0::2])), dict(zip(pairs[0::2], pairs[1::2]))))
    return found


def test_every_metric_on_the_dashboard_comes_from_the_table(default_platform):
    body = render.dashboard_body(default_platform.template)
    cluster = "<" + default_platform.logical_id(default_platform.stack.training_cluster.cluster) + ">"
    table = {(s.namespace.replace("<training>", TRAINING_NAMESPACE), s.name, s.dimensions) for s in METRICS.values()}
    read = metrics_read(body)
    for namespace, name, dimensions, filters in read:
        assert (namespace, name, dimensions) in table, f"{namespace} {name} {dimensions} is not in the metric table"
        if namespace == CONTAINER_INSIGHTS:
            assert filters["ClusterName"] == cluster
        if "Namespace" in filters:
            assert filters["Namespace"] == "ray-train"
    # And every row of the table is on the dashboard, but the alarm's cluster-wide series.
    shown = {(n, m, d) for n, m, d, _ in read}
    assert table - shown == {(CONTAINER_INSIGHTS, "node_gpu_tensor_core_utilization", ("ClusterName",)),
                             (CONTAINER_INSIGHTS, "node_gpu_limit", ("ClusterName",))}


def test_dashboard_has_the_widgets_the_issue_asks_for(default_platform):
    body = render.dashboard_body(default_platform.template)
    titles = {w["properties"].get("title"): render.widget_metrics(w) for w in body["widgets"] if w["type"] == "metric"}
    assert titles["GPU utilisation per GPU node"] == ["node_gpu_utilization"]
    assert titles["GPU tensor-core activity per GPU node"] == ["node_gpu_tensor_core_utilization"]
    assert titles["GPU memory used per GPU node"] == ["node_gpu_memory_utilization"]
    assert titles["GPU power per GPU node"] == ["node_gpu_power_draw"]
    assert titles["EFA received per node"] == ["node_efa_rx_bytes"]
    assert titles["EFA sent per node"] == ["node_efa_tx_bytes"]
    assert titles["Preflight all-reduce bus bandwidth, by NCCL transport"] == [PREFLIGHT_METRIC]
    assert titles["Nodes by role"] == ["cluster_node_count", "node_gpu_utilization"]
    assert titles["CPU of the Ray pods (namespace ray-train)"] == ["pod_cpu_utilization"]
    assert titles["Memory of the Ray pods (namespace ray-train)"] == ["pod_memory_utilization"]
    assert [titles["Training and eval loss"], titles["Tokens per second (whole run)"], titles["Model FLOPs utilisation"]] == [
        ["Loss", "EvalLoss"], ["TokensPerSecond"], ["MFU"]]
    (alarm_widget,) = [w for w in body["widgets"] if w["type"] == "alarm"]
    assert alarm_widget["properties"]["alarms"] == ["<" + default_platform.logical_id(default_platform.stack.idle_gpu_alarm.alarm) + ">"]
    # Widgets tile the 24-column grid without overlapping.
    cells = [(w["x"] + dx, w["y"] + dy) for w in body["widgets"] for dx in range(w["width"]) for dy in range(w["height"])]
    assert len(cells) == len(set(cells)) and max(x for x, _ in cells) == 23
    url = default_platform.template["Outputs"]["DashboardUrl"]["Value"]["Fn::Join"][1]
    assert url[0] == "https://us-west-2.console.aws.amazon.com/cloudwatch/home?region=us-west-2#dashboards/dashboard/"


def test_the_operations_page_picture_is_the_dashboard_the_stack_builds(default_platform):
    committed = (ROOT / "docs" / "dashboard.svg").read_text()
    assert render.render_svg(render.dashboard_body(default_platform.template)) == committed, (
        "docs/dashboard.svg is stale: run python scripts/render_dashboard.py"
    )
    assert "](dashboard.svg)" in (ROOT / "docs" / "operations.md").read_text()


# ---------------------------------------------------------------- the alarm


def alarm_of(platform):
    return platform.one("AWS::CloudWatch::Alarm")["Properties"]


def test_idle_gpu_alarm_reads_tensor_work_and_tells_no_gpu_nodes_from_missing_gpu_metrics(default_platform):
    alarm = alarm_of(default_platform)
    queries = {q["Id"]: q for q in alarm["Metrics"]}
    (expression,) = [q for q in alarm["Metrics"] if "Expression" in q]
    assert expression["Expression"] == "IF(MAX([FILL(instances, 0), FILL(gpus, 0)]) > 0, FILL(tensor, 0), 1)"
    assert expression["ReturnData"] is True
    # The running GPU instances, counted from EC2 by the stack's own function each minute.
    stat = queries["instances"]["MetricStat"]
    assert (stat["Metric"]["Namespace"], stat["Metric"]["MetricName"], stat["Stat"]) == (
        "RayTrainEks/Training", "GpuInstancesRunning", "Maximum")
    (rule,) = [r for r in default_platform.resources("AWS::Events::Rule").values() if "ScheduleExpression" in r["Properties"]]
    assert rule["Properties"]["ScheduleExpression"] == "rate(1 minute)"
    for query_id, name in (("tensor", "node_gpu_tensor_core_utilization"), ("gpus", "node_gpu_limit")):
        stat = queries[query_id]["MetricStat"]
        assert (stat["Metric"]["Namespace"], stat["Metric"]["MetricName"]) == (CONTAINER_INSIGHTS, name)
        assert [d["Name"] for d in stat["Metric"]["Dimensions"]] == ["ClusterName"]
        assert (stat["Stat"], stat["Period"], queries[query_id]["ReturnData"]) == ("Maximum", 60, False)
    # 5% of cycles, as the ratio DCGM reports; 30 idle minutes among 33 (the newest arrive late);
    # no data at all = no GPU node.
    assert (alarm["Threshold"], alarm["ComparisonOperator"]) == (0.05, "LessThanThreshold")
    assert (alarm["EvaluationPeriods"], alarm["DatapointsToAlarm"]) == (33, 30)
    assert alarm["TreatMissingData"] == "notBreaching"
    assert "hangs (a collective that never completes keeps GPU utilisation at 100% with the tensor cores idle)" in \
        json.dumps(alarm["AlarmDescription"])
    topic = default_platform.logical_id(default_platform.stack.idle_gpu_alarm.topic)
    assert alarm["AlarmActions"] == alarm["OKActions"] == [{"Ref": topic}]
    assert not default_platform.resources("AWS::SNS::Subscription")


def _alarm_state(gpus: list, tensor: list, *, periods: int, to_alarm: int, threshold: float = 0.05,
                 instances: list | None = None) -> str:
    """The alarm's decision at the newest minute, as CloudWatch makes it: the expression
    ``IF(MAX([FILL(instances, 0), FILL(gpus, 0)]) > 0, FILL(tensor, 0), 1)`` per minute (FILL gives
    0 where another series has a point, and at every minute of the range), over the newest
    ``periods`` minutes, ALARM when ``to_alarm`` of them breach (< threshold); a minute where no
    series has a point is missing, treated as not breaching. ``None`` in a series: no point (not
    arrived, or a gap). ``instances``: EC2's count (None: the agent's inputs alone, as before)."""
    instances = instances if instances is not None else [None] * len(gpus)
    values = []
    for i, g, t in list(zip(instances, gpus, tensor))[-periods:]:
        if i is None and g is None and t is None:
            values.append(None)
            continue
        values.append((0 if t is None else t) if max(i or 0, g or 0) > 0 else 1)
    breaching = sum(1 for v in values if v is not None and v < threshold)
    return "ALARM" if breaching >= to_alarm else "OK"


#: Recorded shapes, a minute per entry: (GPU instances EC2 counts, GPUs the agent reports, tensor
#: activity): 2 instances of 8 GPUs idle (0) or training (0.42); LATE: nothing of the agent has
#: arrived; NOTHING: not even EC2's count (no GPU instance).
IDLE, BUSY, LATE, NOTHING = (2, 8, 0.0), (2, 8, 0.42), (2, None, None), (0, None, None)
#: The agent not running on the GPU nodes, or the device plugin never advertising their GPUs: the
#: agent sends neither the GPUs nor their activity; EC2 still counts the instances.
SILENT = (2, None, None)


def _series(*minutes):
    return [m[0] for m in minutes], [m[1] for m in minutes], [m[2] for m in minutes]


@pytest.mark.parametrize(("name", "minutes", "expected"), [
    # 30 idle minutes that have arrived, and the newest one not yet: the old 30-of-30 never fired.
    ("idle, the newest minute late", [BUSY] * 5 + [IDLE] * 30 + [LATE], "ALARM"),
    ("idle, the two newest minutes late", [BUSY] * 5 + [IDLE] * 30 + [LATE] * 2, "ALARM"),
    # Container Insights drops a minute now and then: two gaps in a 32-minute idle spell.
    ("idle with gaps", [BUSY] * 5 + [IDLE] * 10 + [LATE] + [IDLE] * 10 + [LATE] + [IDLE] * 10, "ALARM"),
    # A training node: busy every minute, the newest late: never.
    ("busy", [BUSY] * 40 + [LATE], "OK"),
    # A training node whose metrics arrive five minutes late: still never (5 of 33 read idle).
    ("busy, metrics five minutes late", [BUSY] * 40 + [LATE] * 5, "OK"),
    # Idle, with the agent's metrics five minutes late: late minutes read idle, so they never keep it OK.
    ("idle, metrics five minutes late", [BUSY] * 5 + [IDLE] * 28 + [LATE] * 5, "ALARM"),
    # Evaluating every few minutes keeps the tensor pipe busy that minute: not idle.
    ("a busy minute every ten", ([IDLE] * 9 + [BUSY]) * 4, "OK"),
    # Idle for 25 minutes only: not yet.
    ("idle 25 minutes", [BUSY] * 10 + [IDLE] * 25, "OK"),
    # GPU nodes whose DCGM exporter crashed: their GPUs are idle as far as anyone can tell.
    ("no GPU metrics", [(2, 8, None)] * 31, "ALARM"),
    # The agent is not running on the GPU nodes, or the plugin never advertises their GPUs.
    ("agent absent or plugin not advertising", [SILENT] * 40, "ALARM"),
    # No GPU node at all (Karpenter removed them): nothing to alarm on.
    ("no GPU node", [NOTHING] * 40, "OK"),
])
def test_the_idle_gpu_alarm_on_recorded_series(default_platform, name, minutes, expected):
    alarm = alarm_of(default_platform)
    periods, to_alarm = alarm["EvaluationPeriods"], alarm["DatapointsToAlarm"]
    assert (periods, to_alarm) == (30 + IDLE_LATE_MINUTES, 30)
    instances, gpus, tensor = _series(*minutes)
    assert _alarm_state(gpus, tensor, instances=instances, periods=periods, to_alarm=to_alarm) == expected, name
    if name.startswith("idle, the newest"):  # the first defect: 30 of 30 on the agent alone, the newest minute late
        assert _alarm_state(gpus, tensor, periods=30, to_alarm=30) == "OK"
    if name == "agent absent or plugin not advertising":  # the defect: judged on the agent alone
        assert _alarm_state(gpus, tensor, periods=periods, to_alarm=to_alarm) == "OK"
    if name == "idle, metrics five minutes late":  # late minutes as busy (the old FILL) kept it OK
        assert _alarm_state(gpus, tensor, periods=periods, to_alarm=to_alarm) == "OK"


def test_the_instance_count_comes_from_ec2_by_the_clusters_tags_and_gpu_types(monkeypatch):
    """Against botocore's Stubber: both clusters' tags (a managed node group's, Karpenter's), the
    GPU type, running only; the count published under the cluster's name."""
    import boto3
    from botocore.stub import Stubber

    from ray_train_eks.handlers import gpu_instances

    monkeypatch.setenv("CLUSTER_NAME", "ray-train-eks")
    monkeypatch.setenv("INSTANCE_TYPES", "g6.12xlarge")
    monkeypatch.setenv("NAMESPACE", "RayTrainEks/Training")
    monkeypatch.setenv("METRIC", "GpuInstancesRunning")
    kwargs = dict(region_name="us-west-2", aws_access_key_id="x", aws_secret_access_key="x")
    ec2, cloudwatch = boto3.client("ec2", **kwargs), boto3.client("cloudwatch", **kwargs)
    with Stubber(ec2) as ec2_stub, Stubber(cloudwatch) as cw_stub:
        for tag, ids in (("eks:cluster-name", ["i-1"]), ("eks:eks-cluster-name", ["i-2", "i-1"])):
            ec2_stub.add_response("describe_instances", {"Reservations": [{"Instances": [{"InstanceId": i} for i in ids]}]},
                                  {"Filters": [{"Name": f"tag:{tag}", "Values": ["ray-train-eks"]},
                                               {"Name": "instance-type", "Values": ["g6.12xlarge"]},
                                               {"Name": "instance-state-name", "Values": ["running"]}]})
        cw_stub.add_response("put_metric_data", {}, {"Namespace": "RayTrainEks/Training", "MetricData": [{
            "MetricName": "GpuInstancesRunning", "Dimensions": [{"Name": "ClusterName", "Value": "ray-train-eks"}],
            "Value": 2.0, "Unit": "Count"}]})
        assert gpu_instances.handler(ec2=ec2, cloudwatch=cloudwatch) == 2
        ec2_stub.assert_no_pending_responses()
        cw_stub.assert_no_pending_responses()


def test_the_topic_is_encrypted_and_lets_this_alarm_publish(default_platform):
    topic = default_platform.template["Resources"][default_platform.logical_id(default_platform.stack.idle_gpu_alarm.topic)]
    assert topic["Properties"]["KmsMasterKeyId"]["Fn::GetAtt"][0] == default_platform.logical_id(
        default_platform.stack.observability_key)
    (policy,) = default_platform.resources("AWS::SNS::TopicPolicy").values()
    deny_plain_http, allow_alarm = policy["Properties"]["PolicyDocument"]["Statement"]
    assert deny_plain_http["Effect"] == "Deny" and deny_plain_http["Condition"] == {"Bool": {"aws:SecureTransport": "false"}}
    assert (allow_alarm["Effect"], allow_alarm["Action"], allow_alarm["Principal"]) == (
        "Allow", "sns:Publish", {"Service": "cloudwatch.amazonaws.com"})
    alarm_id = default_platform.logical_id(default_platform.stack.idle_gpu_alarm.alarm)
    assert allow_alarm["Condition"] == {"ArnLike": {"aws:SourceArn": {"Fn::GetAtt": [alarm_id, "Arn"]}},
                                        "StringEquals": {"aws:SourceAccount": {"Ref": "AWS::AccountId"}}}
    assert allow_alarm["Resource"] == {"Ref": default_platform.logical_id(default_platform.stack.idle_gpu_alarm.topic)}


def test_alarm_keys_and_email_subscription(p4d_platform):
    alarm = alarm_of(p4d_platform)
    assert (alarm["Threshold"], alarm["EvaluationPeriods"], alarm["DatapointsToAlarm"]) == (0.1, 63, 60)
    (subscription,) = p4d_platform.resources("AWS::SNS::Subscription").values()
    assert (subscription["Properties"]["Protocol"], subscription["Properties"]["Endpoint"]) == ("email", "ml-team@example.com")


def test_karpenter_mode_keeps_the_alarm_for_a_standing_cluster(karpenter_platform, default_platform):
    """The same inputs; with serving's NodePool (servingGpuNodes) whether GPU nodes are up is the EC2
    count of training's alone (test_serving_nodes_are_not_counted_...)."""
    karpenter, default = alarm_of(karpenter_platform)["Metrics"], alarm_of(default_platform)["Metrics"]
    assert [q for q in karpenter if "Expression" not in q] == [q for q in default if "Expression" not in q]


# ---------------------------------------------------------------- the cost (an estimate)


def test_observation_arithmetic_of_the_default_cluster():
    per = OBSERVATIONS_PER_MINUTE
    # What the agent declares per GPU: node_gpu_* 7 metrics x 3 sets; while a pod holds it,
    # pod_gpu_* 7 x 5 and container_gpu_* 7 x 4. node_gpu_request/total are no metrics.
    assert (per["gpu"], per["gpu_idle"], per["gpu_node"], per["gpu_pod"]) == (84, 21, 10, 16)
    assert (per["efa_node"], per["efa_interface"], per["efa_pod"]) == (32, 11, 110)
    # 3 nodes, 2 of them g6.12xlarge (4 GPUs, 1 EFA interface); pods while a job runs:
    # 5 x 3 DaemonSet pods + 3 x 2 on the GPU nodes + 4 cluster pods + head, submitter, 2 workers = 29.
    by_hand = (per["cluster"] + 3 * per["node"] + 29 * (per["pod"] + per["container"]) + 8 * per["gpu"] + 2 * per["gpu_pod"]
               + 2 * per["gpu_node"] + 2 * (per["efa_node"] + per["efa_interface"]) + 2 * per["efa_pod"])
    assert observations_per_minute(system_nodes=1, gpu_nodes=2, gpus_per_node=4, efa_per_node=1, job_running=True) == by_hand == 6432
    cost = ObservabilityCost(observations_per_minute=6432, observations_per_minute_idle=1818)
    # Dashboard 3.00, the alarm's two metrics 0.20, the key 1.00 a month.
    assert cost.usd_per_hour == pytest.approx(6432 * 60 * 0.21 / 1e6 + 4.20 / 730)


def test_cost_line_includes_container_insights(default_platform, karpenter_platform):
    cost = default_platform.stack.cost
    plain = estimate_cost(gpu_instance_type="g6.12xlarge", gpu_node_count=2, system_instance_type="m7i.xlarge", system_node_count=1)
    assert cost.total_usd == pytest.approx(plain.total_usd + cost.observability.usd_per_hour)
    assert "+ Container Insights 0.09 (estimate: about 6,432 observations/minute" in cost.describe()
    # Karpenter: no GPU node, no worker pod idle.
    idle = karpenter_platform.stack.cost
    assert idle.observability.observations_per_minute_idle == observations_per_minute(
        system_nodes=1, gpu_nodes=0, gpus_per_node=4, efa_per_node=1, job_running=False)


def test_make_demo_names_the_dashboard_and_its_cost(default_platform):
    from ray_train_eks.demo import describe_assembly

    text = describe_assembly(default_platform.outdir)
    assert " 1 x AWS::CloudWatch::Dashboard" in text and " 1 x AWS::CloudWatch::Alarm" in text
    assert "stack output DashboardUrl" in text and "+ Container Insights 0.09 (estimate" in text


def test_every_log_group_of_the_stack_is_encrypted_with_a_customer_managed_key(default_platform):
    """The GPU instance counter's function log group included (it was left to AWS's key); the only
    exceptions are the deploy-time functions' (the account checks run before any key exists), each
    with its reason; the observability key's policy says each thing once."""
    groups = default_platform.resources("AWS::Logs::LogGroup")
    plain = {key for key, group in groups.items() if "KmsKeyId" not in group["Properties"]}
    assert all("CKV_AWS_158" in json.dumps(groups[key].get("Metadata", {})) for key in plain), plain
    assert not [key for key in plain if "Instances" in key or "IdleGpu" in key]
    assert any("Instances" in key and "KmsKeyId" in group["Properties"] for key, group in groups.items())
    for key in default_platform.resources("AWS::KMS::Key").values():
        statements = [json.dumps(s, sort_keys=True) for s in key["Properties"]["KeyPolicy"]["Statement"]]
        assert len(statements) == len(set(statements))


def test_serving_nodes_are_not_counted_and_the_karpenter_alarm_reads_the_training_instances_alone(monkeypatch, karpenter_platform):
    """A served model's replica idles between requests by design (and goes on its own): the count leaves
    out the instances Karpenter's serving NodePool launched (their karpenter.sh/nodepool tag), and with
    such a pool the alarm says GPU nodes are up from that count alone (the agent's GPU count has them)."""
    import boto3
    from botocore.stub import Stubber

    from ray_train_eks.handlers import gpu_instances

    for key, value in (("CLUSTER_NAME", "c"), ("INSTANCE_TYPES", "g6.12xlarge"), ("NAMESPACE", "N"), ("METRIC", "M"),
                       ("EXCLUDED_NODE_POOLS", "gpu-efa-serving")):
        monkeypatch.setenv(key, value)
    kwargs = dict(region_name="us-west-2", aws_access_key_id="x", aws_secret_access_key="x")
    ec2, cloudwatch = boto3.client("ec2", **kwargs), boto3.client("cloudwatch", **kwargs)
    pool = lambda name: [{"Key": "karpenter.sh/nodepool", "Value": name}]  # noqa: E731
    with Stubber(ec2) as ec2_stub, Stubber(cloudwatch) as cw_stub:
        ec2_stub.add_response("describe_instances", {"Reservations": []})
        ec2_stub.add_response("describe_instances", {"Reservations": [{"Instances": [
            {"InstanceId": "i-train", "Tags": pool("gpu-efa")}, {"InstanceId": "i-serve", "Tags": pool("gpu-efa-serving")}]}]})
        cw_stub.add_response("put_metric_data", {}, None)
        assert gpu_instances.handler(ec2=ec2, cloudwatch=cloudwatch) == 1
    alarm = karpenter_platform.template["Resources"][karpenter_platform.logical_id(karpenter_platform.stack.idle_gpu_alarm.alarm)]
    (expression,) = [q for q in alarm["Properties"]["Metrics"] if "Expression" in q]
    assert expression["Expression"] == "IF(FILL(instances, 0) > 0, FILL(tensor, 0), 1)"
    function = karpenter_platform.stack.idle_gpu_alarm.counter.function
    variables = karpenter_platform.template["Resources"][karpenter_platform.logical_id(function)]["Properties"]["Environment"]["Variables"]
    assert variables["EXCLUDED_NODE_POOLS"] == "gpu-efa-serving"
