"""What the stack makes exists in the region it is deployed to: the MLflow App only where CloudFormation
has the type (``mlflowTracking=auto`` makes none elsewhere and says so; ``app`` there is refused at
synth), and an instance type the region does not offer is said at synth. The facts in our code
(ray_train_eks/regions.py ``MLFLOW_APP_REGIONS``, ray_train_eks/instances.py ``NOT_OFFERED_IN``) are
compared with cfn-lint's own region data, the pinned package's. cfn-lint reads the synthesized
templates against every region in tests/test_quality_gates.py."""

from __future__ import annotations

import json
from pathlib import Path

import cfnlint
import pytest

from ray_train_eks.config import ConfigError, PlatformConfig
from ray_train_eks.instances import INSTANCE_TYPES, not_offered_note, offered_in
from ray_train_eks.regions import EKS_REGISTRY_ACCOUNTS, MLFLOW_APP_REGIONS

CFN_LINT_DATA = Path(cfnlint.__file__).parent / "data" / "schemas"


def cloudformation_types(region: str) -> set[str] | None:
    """The resource types cfn-lint knows in ``region`` (None: it has no schema of the region)."""
    schema = CFN_LINT_DATA / "providers" / f"{region}.json"
    return set(json.loads(schema.read_text())) if schema.exists() else None


def test_mlflow_apps_are_made_where_cloudformation_has_the_type_by_cfn_lints_region_schemas():
    known = {region: cloudformation_types(region) for region in EKS_REGISTRY_ACCOUNTS}
    assert {region for region, types in known.items() if types and "AWS::SageMaker::MlflowApp" in types} == MLFLOW_APP_REGIONS
    # A region cfn-lint has no schema of is not taken to have the type.
    assert not {region for region, types in known.items() if types is None} & MLFLOW_APP_REGIONS


def test_the_instance_table_knows_each_region_its_types_are_not_offered_in_by_cfn_lints_ec2_data():
    offered = json.loads((CFN_LINT_DATA / "extensions" / "aws_ec2_instance" / "instancetype_enum.json").read_text())
    wrong = [(name, region) for name in INSTANCE_TYPES for region in EKS_REGISTRY_ACCOUNTS
             if offered_in(name, region) != (name in offered[region]["enum"])]
    assert wrong == []


def _config(**context) -> PlatformConfig:
    return PlatformConfig.from_context(context.get, environ={})


def test_auto_tracking_makes_an_app_only_in_regions_that_have_them():
    assert _config(region="us-west-2").workload_spec().tracking
    assert not _config(region="ap-southeast-3").workload_spec().tracking
    # A URI of the user's is tracking anywhere.
    assert _config(region="ap-southeast-3", mlflowTrackingUri="http://mlflow.internal:5000").workload_spec().tracking


def test_an_app_asked_for_in_a_region_without_them_fails_synth_with_the_ways_out():
    with pytest.raises(ConfigError) as refused:
        _config(region="ap-southeast-3", mlflowTracking="app")
    (problem,) = refused.value.problems
    assert problem.startswith("mlflowTracking=app in ap-southeast-3: CloudFormation has no SageMaker MLflow App "
                              "(AWS::SageMaker::MlflowApp) there and refuses a template with one; use -c mlflowTracking=auto")
    assert "-c mlflowTrackingUri=" in problem and "us-west-2" in problem
    assert _config(region="ap-southeast-3", mlflowTracking="app", mlflowTrackingUri="http://mlflow.internal:5000")


def test_an_instance_type_the_region_does_not_offer_is_said_with_the_types_offered_there():
    note = not_offered_note("gpuInstanceType", "g6.12xlarge", "il-central-1")
    assert note.startswith("gpuInstanceType='g6.12xlarge' is not offered in il-central-1 (EC2's price list as cfn-lint "
                           "1.58.0 has it), so its nodes would not launch; offered there: g5.48xlarge, or deploy to another region")
    assert note.endswith("(the deploy's account checks ask EC2 in their first minute)")
    assert "system node group fails" in not_offered_note("systemInstanceType", "m7i.xlarge", "ca-west-1")
    assert not_offered_note("gpuInstanceType", "g6.12xlarge", "us-west-2") is None


@pytest.mark.synth
def test_without_apps_in_the_region_the_stack_makes_none_and_synth_says_why(reserved_platform, default_platform):
    assert reserved_platform.resources("AWS::SageMaker::MlflowApp") == {}
    (untracked,) = [w for w in reserved_platform.warnings() if w.startswith("mlflowTracking=auto in ap-southeast-3")]
    assert "the runs are not tracked in MLflow" in untracked and "-c mlflowTrackingUri=" in untracked
    # Where the region has Apps, auto makes one, and nothing is said of tracking or of the instance types.
    assert default_platform.resources("AWS::SageMaker::MlflowApp")
    assert not [w for w in default_platform.warnings() if "mlflowTracking" in w or "not offered" in w]
