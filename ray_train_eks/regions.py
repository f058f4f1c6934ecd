"""Per-region facts: the account of the Amazon EKS ECR registry that serves add-on images
(the EFA device plugin among them). Source: EKS user guide, "Amazon container image
registries" (checked Nov 2026). A region missing here is rejected at synth, because the
EFA plugin image could not be pulled there. And the regions where CloudFormation has a
SageMaker MLflow App (:data:`MLFLOW_APP_REGIONS`).
"""

from __future__ import annotations

_DEFAULT_ACCOUNT = "602401143452"

EKS_REGISTRY_ACCOUNTS: dict[str, str] = {
    **{
        region: _DEFAULT_ACCOUNT
        for region in (
            "us-east-1", "us-east-2", "us-west-1", "us-west-2",
            "ca-central-1", "sa-east-1",
            "eu-central-1", "eu-north-1", "eu-west-1", "eu-west-2", "eu-west-3",
            "ap-northeast-1", "ap-northeast-2", "ap-northeast-3",
            "ap-south-1", "ap-southeast-1", "ap-southeast-2",
        )
    },
    "af-south-1": "877085696533",
    "ap-east-1": "800184023465",
    # The guide's row for ap-east-2 shows host 533267051163.dkr.ecr.ap-east-1 (apparently a
    # typo: ECR registries are regional); eks_registry builds the ap-east-2 host.
    "ap-east-2": "533267051163",
    "ap-south-2": "900889452093",
    "ap-southeast-3": "296578399912",
    "ap-southeast-4": "491585149902",
    "ap-southeast-5": "151610086707",
    "ap-southeast-6": "333609536671",
    "ap-southeast-7": "121268973566",
    "ca-west-1": "761377655185",
    "eu-central-2": "900612956339",
    "eu-south-1": "590381155156",
    "eu-south-2": "455263428931",
    "il-central-1": "066635153087",
    "me-central-1": "759879836304",
    "me-south-1": "558608220178",
    "mx-central-1": "730335286997",
}


def eks_registry(region: str) -> str:
    """Host name of the EKS add-on image registry for ``region``."""
    return f"{EKS_REGISTRY_ACCOUNTS[region]}.dkr.ecr.{region}.amazonaws.com"


#: The regions above where CloudFormation has the resource type ``AWS::SageMaker::MlflowApp``: a template
#: with it is refused outright elsewhere ("Unrecognized resource types"). Source: cfn-lint 1.58.0's
#: region schemas (``cfnlint/data/schemas/providers/<region>.json``, CloudFormation's registry of each
#: region; its E3006), 16 of the 34. cfn-lint has no schema of me-south-1 (it reads us-east-1's there):
#: not known there, so not listed. tests/test_regions.py compares this with cfn-lint's data.
MLFLOW_APP_REGIONS = frozenset({
    "us-east-1", "us-east-2", "us-west-1", "us-west-2", "ca-central-1", "sa-east-1",
    "eu-central-1", "eu-north-1", "eu-west-1", "eu-west-2", "eu-west-3",
    "ap-northeast-1", "ap-northeast-2", "ap-south-1", "ap-southeast-1", "ap-southeast-2",
})
