"""cdk-nag and cfn-lint over every synthesized template, and the nag gate itself."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from aws_cdk import App, Stack, Validations, aws_ec2 as ec2
from cdk_nag import AwsSolutionsChecks

from ray_train_eks.instances import offered_in
from ray_train_eks.regions import EKS_REGISTRY_ACCOUNTS, MLFLOW_APP_REGIONS

pytestmark = pytest.mark.synth


@pytest.mark.parametrize("platform", ["default_platform", "p4d_platform", "karpenter_platform", "queued_platform",
                                      "reserved_platform"])
def test_cdk_nag_passes(platform, request):
    report = json.loads((request.getfixturevalue(platform).outdir / "validation-report.json").read_text())
    (awssolutions,) = [r for r in report["pluginReports"] if r["pluginName"] == "AwsSolutions"]
    assert (awssolutions["conclusion"], awssolutions["violations"]) == ("success", [])
    # CDK's own template check too (it reports only when it finds something): nothing but
    # W3010, hard-coded AZs, which is what -c availabilityZones asks for.
    others = [r for r in report["pluginReports"] if r["pluginName"] != "AwsSolutions"]
    assert all(r["conclusion"] == "success" for r in others), others
    assert {v["ruleName"] for r in others for v in r["violations"]} <= {"W3010"}, others


def test_every_acknowledgment_states_a_reason(default_platform):
    metadata = json.loads((default_platform.outdir / "RayTrainEks.metadata.json").read_text())
    acknowledged = {
        rule: reason
        for entries in metadata.values()
        for entry in entries
        if entry["type"] == "aws:cdk:acknowledged-rules"
        for rule, reason in entry["data"].items()
        if rule.startswith("AwsSolutions::")
    }
    assert len(acknowledged) >= 10
    assert all(len(reason) > 40 for reason in acknowledged.values()), acknowledged


def test_an_unacknowledged_finding_fails_synth(tmp_path):
    app = App(outdir=str(tmp_path))
    stack = Stack(app, "Open")
    vpc = ec2.Vpc(stack, "Vpc", max_azs=1, nat_gateways=0, subnet_configuration=[ec2.SubnetConfiguration(name="p", subnet_type=ec2.SubnetType.PUBLIC)])
    group = ec2.SecurityGroup(stack, "Open", vpc=vpc)
    group.add_ingress_rule(ec2.Peer.any_ipv4(), ec2.Port.tcp(22))
    Validations.of(app).add_plugins(AwsSolutionsChecks(app))
    with pytest.raises(Exception, match=r"(?s)ValidationFailed.*AwsSolutions-EC23"):
        app.synth()


#: The regions a template stands for: synthesized in one region, it is what synth makes in each region where
#: the stack's regional choice (the MLflow App of mlflowTracking=auto) comes out the same; the rest is the
#: same resource types in every region. So cfn-lint reads each against all of those, and together they
#: cover every region the app accepts (ray_train_eks/regions.py).
EVERY_REGION = sorted(EKS_REGISTRY_ACCOUNTS)
WITH_APP, WITHOUT_APP = sorted(MLFLOW_APP_REGIONS), sorted(set(EKS_REGISTRY_ACCOUNTS) - MLFLOW_APP_REGIONS)
IN_REGION = re.compile(r" in '([a-z0-9-]+)'$")


@pytest.mark.parametrize("platform, regions, accepted", [
    ("default_platform", WITH_APP, {"W3005"}),
    # availabilityZones pins the AZs on purpose (the GPU capacity is in one of them); a deploy with
    # credentials and without it pins the ones its lookup gives (conftest.as_deployed).
    ("p4d_platform", WITH_APP, {"W3005", "W3010"}),
    ("karpenter_platform", EVERY_REGION, {"W3005", "W3010"}),  # no tracking
    ("queued_platform", EVERY_REGION, {"W3005", "W3010"}),  # the user's tracking server
    ("reserved_platform", WITHOUT_APP, {"W3005"}),  # auto tracking in a region without MLflow Apps
])
def test_cfn_lint_finds_nothing_but_accepted_warnings_in_every_region_a_template_stands_for(platform, regions, accepted,
                                                                                           request):
    """W3005: CDK's explicit DependsOn next to a Ref (teardown order we rely on, stated twice). No E3006 (a
    resource type the region does not have: CloudFormation refuses the template); E3628 (an instance type
    the region's EC2 does not offer) only where the instance table knows it, which synth says."""
    synthesized = request.getfixturevalue(platform)
    templates = sorted(str(p) for p in synthesized.outdir.glob("*.template.json"))
    assert templates and synthesized.stack.region in regions
    # cfn-lint's exit code is a bit mask of finding levels (2 error, 4 warning, 8 info); 1 is
    # its own failure, which must not pass for "no findings".
    result = subprocess.run(
        [str(Path(sys.executable).parent / "cfn-lint"), "--format", "json", "--regions", *regions, "--", *templates],
        capture_output=True, text=True, check=False
    )
    assert result.returncode in (0, 2, 4, 6, 8, 10, 12, 14), result.stderr
    findings = json.loads(result.stdout or "[]")
    assert (result.returncode == 0) == (findings == []), result.stdout
    said = [(f["Message"].split("'")[1], IN_REGION.search(f["Message"]).group(1)) for f in findings if f["Rule"]["Id"] == "E3628"]
    assert [(name, region) for name, region in said if offered_in(name, region)] == []
    unexpected = [f"{f['Rule']['Id']}: {f['Message']}" for f in findings if f["Rule"]["Id"] not in accepted | {"E3628"}]
    assert unexpected == []
