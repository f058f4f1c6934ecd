"""Every configuration rule, with its exact message; no synthesis needed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ray_train_eks.config import ConfigError, PlatformConfig

ROOT = Path(__file__).resolve().parents[1]


def problems_of(context: dict, environ: dict | None = None) -> list[str]:
    try:
        PlatformConfig.from_context(context, environ=environ or {})
    except ConfigError as error:
        return error.problems
    return []


def test_defaults_are_valid_and_match_cdk_json():
    config = PlatformConfig.from_context({}.get, environ={})
    context = json.loads((ROOT / "cdk.json").read_text())["context"]
    from_cdk_json = PlatformConfig.from_context(context.get, environ={})
    assert from_cdk_json == config
    assert (config.gpu_instance_type, config.gpu_node_count, config.system_instance_type) == ("g6.12xlarge", 2, "m7i.xlarge")


def test_context_strings_are_parsed():
    config = PlatformConfig.from_context(
        {"gpuNodeCount": "4", "destroyData": "true", "availabilityZones": "us-west-2a, us-west-2c", "endpointAccessCidrs": '["10.0.0.0/8"]'}.get,
        environ={},
    )
    assert config.gpu_node_count == 4
    assert config.destroy_data is True
    assert config.availability_zones == ("us-west-2a", "us-west-2c")
    assert config.endpoint_access_cidrs == ("10.0.0.0/8",)


def test_region_comes_from_context_then_aws_region():
    assert PlatformConfig.from_context({}.get, environ={"AWS_REGION": "eu-west-1"}).region == "eu-west-1"
    assert PlatformConfig.from_context({"region": "us-east-2"}.get, environ={"AWS_REGION": "eu-west-1"}).region == "us-east-2"


def test_instance_type_without_efa_is_rejected():
    assert problems_of({"gpuInstanceType": "g6.xlarge"}) == [
        "gpuInstanceType='g6.xlarge': does not support EFA (multi-node NCCL would fall back to TCP); use an EFA-capable "
        "GPU type: g5.48xlarge, g6.12xlarge, g6.16xlarge, g6.24xlarge, g6.48xlarge, g6.8xlarge, gr6.8xlarge, p4d.24xlarge, "
        "p5.48xlarge, p5en.48xlarge"
    ]


def test_unknown_instance_type_is_rejected():
    assert problems_of({"gpuInstanceType": "g6.13xlarge"})[0].startswith(
        "gpuInstanceType='g6.13xlarge': unknown instance type; use an EFA-capable GPU type: g5.48xlarge"
    )


def test_cpu_type_as_gpu_type_is_rejected():
    assert problems_of({"gpuInstanceType": "m7i.xlarge"})[0].startswith("gpuInstanceType='m7i.xlarge': has no GPU;")


@pytest.mark.parametrize(
    "count, message",
    [
        ("0", "gpuNodeCount=0: at least 1 GPU node is needed; e.g. -c gpuNodeCount=2"),
        ("500", "gpuNodeCount=500: above 64, the most this app places in one cluster placement group; check for a typo, or split the run"),
        ("two", "gpuNodeCount='two': expected a whole number, e.g. -c gpuNodeCount=2"),
    ],
)
def test_gpu_node_count_bounds(count, message):
    assert problems_of({"gpuNodeCount": count}) == [message]


def test_azs_of_another_region_are_rejected():
    assert problems_of({"availabilityZones": "us-east-1a,us-east-1b"}) == [
        "availabilityZones: us-east-1a, us-east-1b not of region us-west-2; use AZ names like us-west-2a, us-west-2b"
    ]


def test_exactly_two_azs_are_required():
    assert problems_of({"availabilityZones": "us-west-2a"}) == [
        "availabilityZones='us-west-2a': give exactly two AZs (EKS needs two for the control plane; the GPU nodes use "
        "the first), e.g. -c availabilityZones=us-west-2a,us-west-2b"
    ]


def test_duplicate_azs_are_rejected():
    assert problems_of({"availabilityZones": "us-west-2a,us-west-2a"}) == [
        "availabilityZones='us-west-2a,us-west-2a': the two AZs must differ"
    ]


def test_unknown_region_is_rejected():
    assert problems_of({"region": "us-west-9"})[0].startswith(
        "region='us-west-9': not a region this app supports (no known EKS add-on image registry); use one of af-south-1,"
    )


@pytest.mark.parametrize(
    "version, message",
    [
        ("1.30", "kubernetesVersion='1.30': outside EKS support on 2026-11-30 (EKS cannot create it); use 1.36"),
        ("1.35", "kubernetesVersion='1.35': no matching kubectl layer in this app (pinned: 1.36 with aws-cdk.lambda-layer-kubectl-v36); use 1.36"),
        ("v1.36", "kubernetesVersion='v1.36': not a Kubernetes minor version; use 1.36"),
    ],
)
def test_kubernetes_version_rules(version, message):
    assert problems_of({"kubernetesVersion": version}) == [message]


def test_cidr_with_host_bits_suggests_the_network():
    assert problems_of({"endpointAccessCidrs": "203.0.113.7/24"}) == [
        "endpointAccessCidrs: '203.0.113.7/24' is not a valid CIDR (203.0.113.7/24 has host bits set); did you mean 203.0.113.0/24?"
    ]


def test_malformed_cidr_is_rejected():
    assert problems_of({"endpointAccessCidrs": "10.0.0/33"}) == [
        "endpointAccessCidrs: '10.0.0/33' is not a valid CIDR ('10.0.0/33' does not appear to be an IPv4 or IPv6 network); use the form 203.0.113.0/24"
    ]


def test_ipv6_cidr_is_rejected():
    assert problems_of({"endpointAccessCidrs": "2001:db8::/32"}) == [
        "endpointAccessCidrs: '2001:db8::/32' is IPv6; the EKS public endpoint accepts IPv4 CIDRs only"
    ]


def test_malformed_admin_arn_is_rejected():
    assert problems_of({"adminRoleArn": "Admin"}) == [
        "adminRoleArn='Admin': not an IAM role or user ARN; use the form arn:aws:iam::123456789012:role/NAME"
    ]


def test_assumed_role_arn_gets_the_role_arn_as_fix():
    arn = "arn:aws:sts::123456789012:assumed-role/Admin/alice"
    assert problems_of({"adminRoleArn": arn}) == [
        f"adminRoleArn='{arn}': an assumed-role session ARN; use the role's ARN, arn:aws:iam::123456789012:role/Admin"
    ]


def test_admin_arn_of_another_account_is_rejected():
    assert problems_of({"adminRoleArn": "arn:aws:iam::111111111111:role/Admin", "account": "123456789012"}) == [
        "adminRoleArn='arn:aws:iam::111111111111:role/Admin': belongs to account 111111111111, not the stack's account "
        "123456789012; use a principal of 123456789012"
    ]


def test_trainer_roles_are_role_arns_each_once_and_not_the_admin():
    """EKS takes one access entry per principal: a repeated trainer, or the admin as a trainer, would
    fail the deploy with ResourceInUse twenty minutes in."""
    admin, trainer = "arn:aws:iam::123456789012:role/Admin", "arn:aws:iam::123456789012:role/Trainer"
    assert problems_of({"trainerRoleArns": f"{trainer},{trainer},Bob", "adminRoleArn": admin}) == [
        "trainerRoleArns='Bob': not an IAM role or user ARN; use the form arn:aws:iam::123456789012:role/NAME",
        f"trainerRoleArns lists {trainer} more than once; EKS takes one access entry per principal",
    ]
    assert problems_of({"trainerRoleArns": f"{admin},{trainer}", "adminRoleArn": admin}) == [
        f"trainerRoleArns='{admin}' is the adminRoleArn too; EKS takes one access entry per principal, and the admin can "
        "already do what a trainer does: drop it from trainerRoleArns"
    ]
    assert problems_of({"trainerRoleArns": trainer, "adminRoleArn": admin}) == []


def test_malformed_account_is_rejected():
    assert problems_of({"account": "1234"}) == ["account='1234': an AWS account id is 12 digits, e.g. -c account=123456789012"]


def test_malformed_capacity_reservation_is_rejected():
    assert problems_of({"capacityReservationId": "cr-123"}) == [
        "capacityReservationId='cr-123': not a capacity reservation id; use the form cr-0123456789abcdef0 (17 hex digits)"
    ]


def test_small_system_type_and_root_volume_are_rejected():
    # g6.12xlarge keeps containerd and kubelet on its NVMe: its root holds the OS only.
    assert problems_of({"systemInstanceType": "m7i.large", "gpuRootVolumeGiB": "10"}) == [
        "gpuRootVolumeGiB=10: below 20, too small for the OS and its logs (containerd and kubelet are on g6.12xlarge's "
        "NVMe); use 50",
        "systemInstanceType='m7i.large': 2 vCPUs cannot hold the KubeRay operator, the Ray head and the cluster add-ons; use m7i.xlarge or larger",
    ]
    assert problems_of({"gpuRootVolumeGiB": "50"}) == []


def test_a_root_volume_that_holds_containerd_must_hold_the_image():
    from ray_train_eks.constructs.efa_node_group import gpu_root_volume_problem
    from ray_train_eks.validation import context_key

    # A type without instance storage keeps the image on its root volume (no EFA GPU type of the table lacks NVMe).
    assert gpu_root_volume_problem(50, context_key("gpuRootVolumeGiB"), instance_type="m7i.xlarge") == (
        "gpuRootVolumeGiB=50: below 100, too small for the Ray Train DLC image and the model cache; use 200")


def test_root_volume_throughput_and_iops_are_gp3s():
    assert problems_of({"rootVolumeThroughputMiBps": "3000", "rootVolumeIops": "100"}) == [
        "rootVolumeThroughputMiBps=3000: gp3 takes 125 to 2000 MiB/s; e.g. 400",
        "rootVolumeIops=100: gp3 takes 3000 to 80000 IOPS; e.g. 4000",
    ]
    assert problems_of({"rootVolumeThroughputMiBps": "1200"}) == [
        "rootVolumeThroughputMiBps=1200 with rootVolumeIops=4000: gp3 allows 0.25 MiB/s per IOPS; use rootVolumeIops=4800 or more"]
    # The same rules are the constructs' own (TrainingCluster, EfaNodeGroup), in their props' names.
    from ray_train_eks.constructs.launch_templates import gp3_iops_problem, gp3_throughput_problem

    assert gp3_throughput_problem(1200, iops=4000) == (
        "root_volume_throughput_mibps=1200 with root_volume_iops=4000: gp3 allows 0.25 MiB/s per IOPS; use "
        "root_volume_iops=4800 or more")
    assert gp3_iops_problem(100) == "root_volume_iops=100: gp3 takes 3000 to 80000 IOPS; e.g. 4000"


def test_bad_boolean_is_rejected():
    assert problems_of({"destroyData": "maybe"}) == ["destroyData='maybe': expected true or false"]


def test_every_problem_is_reported_at_once():
    with pytest.raises(ConfigError) as raised:
        PlatformConfig.from_context(
            {"gpuInstanceType": "g6.xlarge", "gpuNodeCount": "0", "kubernetesVersion": "1.30", "adminRoleArn": "x"}.get,
            environ={},
        )
    message = str(raised.value)
    assert message.startswith("4 problem(s) in the ray-train-eks configuration (cdk.json context, or -c key=value):\n  - ")
    for key in ("gpuInstanceType=", "gpuNodeCount=", "kubernetesVersion=", "adminRoleArn="):
        assert key in message


def test_small_system_root_volume_is_rejected():
    assert problems_of({"systemRootVolumeGiB": "50"}) == [
        "systemRootVolumeGiB=50: below 80, too small for the Ray head and the job submitter, which run the Ray Train DLC image; use 100"
    ]


def test_newer_regions_have_their_eks_registry():
    from ray_train_eks.regions import eks_registry

    assert eks_registry("ap-east-2") == "533267051163.dkr.ecr.ap-east-2.amazonaws.com"
    assert eks_registry("ap-southeast-6") == "333609536671.dkr.ecr.ap-southeast-6.amazonaws.com"


def test_gpu_capacity_must_be_one_of_the_two_modes():
    assert problems_of({"gpuCapacity": "autoscaling"}) == [
        "gpuCapacity='autoscaling': use nodegroup (GPU nodes always up, the default) or karpenter (GPU nodes only while a job runs)"
    ]
    assert PlatformConfig.from_context({"gpuCapacity": "karpenter"}.get, environ={}).gpu_capacity == "karpenter"


def test_ami_version_and_pre_running_deadline_are_checked():
    assert problems_of({"gpuAmiVersion": "20260714", "preRunningDeadlineSeconds": "0"}) == [
        "gpuAmiVersion='20260714': an AL2023 EKS AMI release is v + 8 digits, e.g. -c gpuAmiVersion=v20260714 "
        "(https://github.com/awslabs/amazon-eks-ami/releases)",
        "preRunningDeadlineSeconds=0: KubeRay takes a positive number of seconds; use e.g. 1800, or leave it unset for no deadline",
    ]


def test_observability_keys_are_parsed():
    config = PlatformConfig.from_context(
        {"observability": "false", "logRetentionDays": "90", "observabilityAddonVersion": "v6.5.0-eksbuild.2"}.get, environ={})
    assert (config.observability, config.log_retention_days, config.observability_addon_version) == (False, 90, "v6.5.0-eksbuild.2")
    config = PlatformConfig.from_context(
        {"alarmEmail": "ml@example.com", "idleGpuUtilizationPercent": "10", "idleGpuMinutes": "60"}.get, environ={})
    assert (config.alarm_email, config.idle_gpu_utilization_percent, config.idle_gpu_minutes) == ("ml@example.com", 10, 60)


def test_observability_keys_are_checked():
    assert problems_of({
        "observabilityAddonVersion": "6.4.0", "logRetentionDays": "31", "idleGpuUtilizationPercent": "0",
        "idleGpuMinutes": "2", "alarmEmail": "ml-team",
    }) == [
        "observabilityAddonVersion='6.4.0': an EKS add-on version looks like v6.4.0-eksbuild.1 (list them: aws eks "
        "describe-addon-versions --addon-name amazon-cloudwatch-observability)",
        "logRetentionDays=31: not a CloudWatch Logs retention; use one of 1, 3, 5, 7, 14, 30, 60, 90, 120, 150, 180, 365, "
        "400, 545, 731, 1096, 1827, 2192, 2557, 2922, 3288, 3653",
        "idleGpuUtilizationPercent=0: a percentage from 1 to 100; e.g. 5",
        "idleGpuMinutes=2: use 5 to 1437 minutes (a day, CloudWatch's longest alarm window, less the minutes for late "
        "data; under 5 the alarm fires "
        "between two steps of a job); e.g. 30",
        "alarmEmail='ml-team': not an e-mail address; e.g. -c alarmEmail=you@example.com",
    ]


def test_addon_before_pod_identity_support_is_rejected():
    assert problems_of({"observabilityAddonVersion": "v3.0.1-eksbuild.1"}) == [
        "observabilityAddonVersion='v3.0.1-eksbuild.1': before v3.1.0 the add-on cannot take its credentials from EKS "
        "Pod Identity; use v6.4.0-eksbuild.1"
    ]
    assert problems_of({"observabilityAddonVersion": "v3.1.0-eksbuild.1"}) == []


def test_alarm_keys_without_observability_are_rejected():
    assert problems_of({"observability": "false", "alarmEmail": "ml@example.com", "idleGpuMinutes": "60"}) == [
        "alarmEmail, idleGpuMinutes with observability=false: the idle-GPU alarm reads Container Insights' GPU metrics, "
        "which observability=false turns off; drop them, or use observability=true"
    ]


# ---------------------------------------------------------------- one declaration per setting


def test_a_key_no_setting_declares_names_the_closest_one():
    assert problems_of({"gpuNodeCont": "3"}) == ["gpuNodeCont: not a setting of ray-train-eks; did you mean gpuNodeCount?"]
    assert problems_of({"destroydata": "true"}) == ["destroydata: not a setting of ray-train-eks; did you mean destroyData?"]
    assert problems_of({"spotPlease": "yes"}) == [
        "spotPlease: not a setting of ray-train-eks; see the configuration table in docs/configuration.md for the settings "
        "there are"]


def test_keys_of_cdk_itself_pass():
    assert problems_of({"@aws-cdk/core:newStyleStackSynthesis": True, "aws:cdk:enable-path-metadata": True,
                        "availability-zones:account=123456789012:region=us-west-2": ["us-west-2a"]}) == []


def test_a_typo_in_a_key_fails_synth_through_the_cli_context(tmp_path):
    import os
    import subprocess
    import sys

    env = {**os.environ, "CDK_OUTDIR": str(tmp_path),
           "CDK_CONTEXT_JSON": json.dumps({"gpuNodeCont": "3", "region": "us-west-2", "aws:cdk:enable-path-metadata": True})}
    result = subprocess.run([sys.executable, "app.py"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert result.returncode == 1
    assert "gpuNodeCont: not a setting of ray-train-eks; did you mean gpuNodeCount?" in result.stderr


def test_the_configuration_page_table_is_the_declarations():
    import importlib.util

    from ray_train_eks.config import configuration_table, declared_settings

    spec = importlib.util.spec_from_file_location("render_config_table", ROOT / "scripts" / "render_config_table.py")
    render = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(render)
    table = render.page_table((ROOT / "docs" / "configuration.md").read_text())
    assert table == configuration_table(), (
        "docs/configuration.md's configuration table is stale: run python scripts/render_config_table.py")
    keys = [line.split("|")[1].strip().strip("`") for line in table.splitlines()[2:]]
    assert keys == [s.key for s in declared_settings()]
    assert len(set(keys)) == len(keys)
    # And the training options' table of docs/fine-tuning.md, every option of python -m training.train.
    from training.config import options_table

    options = render.page_table((ROOT / "docs" / "fine-tuning.md").read_text(), render.OPTIONS_BEGIN, render.OPTIONS_END)
    assert options == options_table(), "docs/fine-tuning.md's training options table is stale: run python scripts/render_config_table.py"
    assert "| `--lora-rank` | `8` |" in options and "| `--peft` | `none` |" in options


def test_every_cdk_json_key_is_declared():
    from ray_train_eks.config import declared_settings

    context = json.loads((ROOT / "cdk.json").read_text())["context"]
    assert set(context) <= {s.key for s in declared_settings()}


@pytest.mark.parametrize("construct_call, context, tail", [
    ("efa", {"gpuInstanceType": "g6.xlarge"},
     "'g6.xlarge': does not support EFA (multi-node NCCL would fall back to TCP); use an EFA-capable GPU type: g5.48xlarge"),
    ("efa-count", {"gpuNodeCount": "65"}, "=65: above 64, the most this app places in one cluster placement group"),
    ("cluster", {"kubernetesVersion": "1.35"}, "='1.35': no matching kubectl layer in this app"),
    ("retention", {"logRetentionDays": "31"}, "=31: not a CloudWatch Logs retention; use one of 1, 3, 5"),
    ("alarm", {"idleGpuMinutes": "2"}, "=2: use 5 to 1437 minutes"),
])
def test_a_construct_and_cdk_synth_say_the_same_of_the_same_value(construct_call, context, tail):
    """The rule lives with the construct; the configuration calls it for its context key."""
    from aws_cdk import App, Stack, aws_ec2 as ec2

    (synth_message,) = problems_of(context)
    key = next(iter(context))
    assert synth_message.startswith(key) and tail in synth_message

    stack = Stack(App(), "S")
    vpc = ec2.Vpc(stack, "Vpc", max_azs=2, nat_gateways=0)
    with pytest.raises(ValueError) as raised:
        if construct_call.startswith("efa"):
            from ray_train_eks.constructs import EfaNodeGroup
            from aws_cdk import aws_eks_v2 as eks

            cluster = eks.Cluster.from_cluster_attributes(stack, "C", cluster_name="c", vpc=vpc)
            EfaNodeGroup(stack, "G", cluster=cluster, subnet=vpc.isolated_subnets[0],
                         **({"instance_type": "g6.xlarge"} if construct_call == "efa" else {"node_count": 65}))
        elif construct_call == "cluster":
            from ray_train_eks.constructs import TrainingCluster

            TrainingCluster(stack, "Cluster", vpc=vpc, kubernetes_version="1.35")
        elif construct_call == "retention":
            from aws_cdk import aws_eks_v2 as eks

            from ray_train_eks.constructs import CloudWatchObservability

            CloudWatchObservability(stack, "O", cluster=eks.Cluster.from_cluster_attributes(stack, "C", cluster_name="c"),
                                    log_retention_days=31)
        else:
            from ray_train_eks.constructs import IdleGpuAlarm

            IdleGpuAlarm(stack, "A", cluster_name="c", minutes=2)
    construct_message = str(raised.value)
    assert tail in construct_message
    # Same rule, same words after the name: only the name differs (the prop's, or the context key's).
    assert construct_message.split(": ", 1)[1].split("=", 1)[1] == synth_message.split("=", 1)[1]


# ---------------------------------------------------------------- chartPackages


def test_chart_packages_auto_uses_the_make_upstream_cache_only_where_it_is(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert PlatformConfig.from_context({}.get, environ={}).chart_packages_dir is None
    (tmp_path / ".cache" / "upstream" / "packages").mkdir(parents=True)
    assert PlatformConfig.from_context({}.get, environ={}).chart_packages_dir == Path(".cache/upstream/packages")
    assert PlatformConfig.from_context({"chartPackages": "none"}.get, environ={}).chart_packages_dir is None


def test_chart_packages_folder_must_exist_and_hold_the_pinned_packages(tmp_path):
    with pytest.raises(ConfigError, match=r"chartPackages='/no/such/folder': no such folder; use auto"):
        PlatformConfig.from_context({"chartPackages": "/no/such/folder"}.get, environ={})
    with pytest.raises(ConfigError, match=r"nvidia-device-plugin-0\.20\.0\.tgz is not there; run `make upstream`"):
        PlatformConfig.from_context({"chartPackages": str(tmp_path)}.get, environ={})


def test_a_cached_package_that_is_not_the_pinned_one_stops_synth(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    packages = tmp_path / ".cache" / "upstream" / "packages"
    packages.mkdir(parents=True)
    (packages / "aws-efa-k8s-device-plugin-v0.5.30.tgz").write_bytes(b"not the chart")
    with pytest.raises(ConfigError, match=r"chartPackages='auto': .*aws-efa-k8s-device-plugin-v0\.5\.30\.tgz: sha256 "
                                          r"[0-9a-f]{64} is not the pinned 43b3d666"):
        PlatformConfig.from_context({}.get, environ={})
