"""cdk-nag acknowledgments, each with its reason, next to the resource it concerns."""

from __future__ import annotations

from aws_cdk import Acknowledgment, CfnResource, Stack, Validations
from constructs import IConstruct

#: Managed policies EKS itself requires on every node role.
EKS_NODE_MANAGED_POLICIES = ("AmazonEKSWorkerNodePolicy", "AmazonEKS_CNI_Policy", "AmazonEC2ContainerRegistryReadOnly")


def managed_policy_rule(policy: str, *, service_role: bool = False) -> str:
    """The AwsSolutions-IAM4 finding id of one AWS managed policy."""
    prefix = "service-role/" if service_role else ""
    return f"AwsSolutions-IAM4[Policy::arn:<AWS::Partition>:iam::aws:policy/{prefix}{policy}]"


def acknowledge(scope: IConstruct, reason: str, *rules: str) -> None:
    """Acknowledge cdk-nag findings ``rules`` on ``scope`` and its children, for ``reason``."""
    Validations.of(scope).acknowledge(*(Acknowledgment(id=f"AwsSolutions::{rule}", reason=reason) for rule in rules))


def acknowledge_node_role(nodegroup: IConstruct) -> None:
    """The managed policies of an EKS managed node group's role."""
    acknowledge(
        nodegroup,
        "EKS requires these AWS managed policies on node roles (kubelet registration, VPC CNI, image pulls); "
        "AWS keeps them in step with EKS.",
        *(managed_policy_rule(p) for p in EKS_NODE_MANAGED_POLICIES),
    )


def rendered(scope: IConstruct, value: str) -> str:
    """``value`` (a string that may hold tokens) as cdk-nag writes it in a finding id: a
    reference as ``<LogicalId>``, an attribute as ``<LogicalId.Attr>``, a pseudo parameter as
    ``<AWS::Region>``, joins joined; so an acknowledgment can name exactly one finding."""
    from aws_cdk import Stack

    def render(part) -> str:
        if isinstance(part, str):
            return part
        if "Ref" in part:
            return f"<{part['Ref']}>"
        if "Fn::GetAtt" in part:
            return f"<{'.'.join(part['Fn::GetAtt'])}>"
        if "Fn::Join" in part:
            separator, parts = part["Fn::Join"]
            return separator.join(render(p) for p in parts)
        raise ValueError(f"cannot render {part!r} as cdk-nag does")

    return render(Stack.of(scope).resolve(value))


def wildcard_rule(scope: IConstruct, resource: str) -> str:
    """The AwsSolutions-IAM5 finding id of one wildcard ``resource`` of ``scope``'s stack, rendered
    from the value itself (:func:`rendered`): ``<AWS::AccountId>`` and ``<AWS::Region>`` in an
    account-agnostic stack, the account and region where they are known (``cdk deploy`` with
    credentials sets the account), so that one acknowledgment holds for both forms."""
    return f"AwsSolutions-IAM5[Resource::{rendered(scope, resource)}]"


# ---------------------------------------------------------------------- checkov

def checkov_skip(resource: IConstruct, reason: str, *checks: str) -> None:
    """Tell checkov (3.x, ``--framework cloudformation``) that ``checks`` do not apply to
    ``resource`` (an L1, or an L2 whose default child is one), for ``reason``: the resource's
    ``Metadata.checkov.skip`` (checkov/cloudformation/context_parser.py
    ``collect_skip_comments``), the counterpart of a cdk-nag acknowledgment."""
    cfn = resource if isinstance(resource, CfnResource) else resource.node.default_child
    skips = list((cfn.get_metadata("checkov") or {}).get("skip", []))
    known = {entry["id"] for entry in skips}
    skips += [{"id": check, "comment": reason} for check in checks if check not in known]
    cfn.add_metadata("checkov", {"skip": skips})


#: Why checkov's Lambda checks do not apply to the functions of a deploy-time custom resource,
#: by check: CKV_AWS_115 (function-level concurrency), CKV_AWS_116 (dead-letter queue),
#: CKV_AWS_117 (VPC), CKV_AWS_173 (environment variables encrypted with a customer managed key).
DEPLOY_TIME_FUNCTION = {
    "CKV_AWS_115": "Runs a few times per deploy, one invocation at a time, from CloudFormation; reserved concurrency "
                   "would take from the account's unreserved pool, which a new account (10 in all) cannot spare.",
    "CKV_AWS_116": "Invoked synchronously (by CDK's provider framework or CloudFormation), which reports a failure to "
                   "CloudFormation; a dead-letter queue serves asynchronous invocations only.",
    "CKV_AWS_117": "Calls AWS APIs only; in the VPC it would need a NAT route or an interface endpoint for each, and "
                   "the account checks run before the VPC exists.",
    "CKV_AWS_173": "Its environment holds function names, a cluster name and role ARNs, no secret; Lambda encrypts it "
                   "at rest with an AWS managed key.",
}


def checkov_skip_deploy_time_functions(stack: Stack) -> None:
    """The checkov skips, with their reasons, of every Lambda function of ``stack`` that only
    runs at deploy time: our custom resources' handlers, CDK's provider framework functions
    and its kubectl handler. Only the checks that apply to each (a function in a VPC skips no
    VPC check; one without environment variables no encryption check)."""
    from aws_cdk import aws_lambda as lambda_

    for construct in stack.node.find_all():
        if not isinstance(construct, lambda_.CfnFunction):
            continue
        checks = ["CKV_AWS_115", "CKV_AWS_116"]
        if not stack.resolve(construct.vpc_config):  # L2 functions hand the L1 lazy values
            checks.append("CKV_AWS_117")
        # CDK's provider framework and kubectl functions get their environment (the user function's
        # name, the cluster's) as they are synthesized; ours have none (tests/test_security.py
        # checks this against the template).
        cdk_function = "framework-onEvent" in construct.node.path or "KubectlProvider" in construct.node.path
        if cdk_function and not stack.resolve(construct.kms_key_arn):
            checks.append("CKV_AWS_173")
        for check in checks:
            checkov_skip(construct, DEPLOY_TIME_FUNCTION[check], check)
