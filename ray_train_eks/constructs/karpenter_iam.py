"""What Karpenter 1.14.1's controller may do in AWS, and which events reach its interruption queue.

Facts from Karpenter's getting-started reference template: aws/karpenter-provider-aws tag
``v1.14.1``, ``website/content/en/docs/getting-started/getting-started-with-karpenter/cloudformation.yaml``
(resources ``NodeLifecyclePolicy``, ``IAMIntegrationPolicy``, ``EKSIntegrationPolicy``,
``InterruptionPolicy``, ``ZonalShiftPolicy``, ``ResourceDiscoveryPolicy`` and the five
``AWS::Events::Rule``). The statements keep upstream's ``Sid``s, so a reader can put them side by
side; ``tests/test_karpenter.py`` compares them with upstream's file (actions, resources,
conditions) wherever that file can be found (``make upstream``, or the steering repository's
``shared/k8s/reference/``). Bump with the chart: read the new version's file and update this one.

Upstream writes each policy as JSON text through ``Fn::Sub``, because the cluster name is part
of condition *keys* (``aws:ResourceTag/kubernetes.io/cluster/${ClusterName}``), which a
CloudFormation object cannot hold as a token. Ours does the same. Where upstream reads
``${KarpenterNodeRole.Arn}`` and ``${KarpenterInterruptionQueue.Arn}`` (its own resources), ours
has the variables ``${NodeRoleArn}`` and ``${InterruptionQueueArn}``.
"""

from __future__ import annotations

import json

_PARTITION_REGION = "arn:${AWS::Partition}:ec2:${AWS::Region}"
_INSTANCE_PROFILES = "arn:${AWS::Partition}:iam::${AWS::AccountId}:instance-profile/*"
_CLUSTER_ARN = "arn:${AWS::Partition}:eks:${AWS::Region}:${AWS::AccountId}:cluster/${ClusterName}"
_OWNED = "kubernetes.io/cluster/${ClusterName}"


def _ec2(*resources: str, account: str = "*") -> list[str]:
    return [f"{_PARTITION_REGION}:{account}:{r}" for r in resources]


#: What Karpenter creates with RunInstances/CreateFleet, and tags at creation.
_CREATED = _ec2("fleet/*", "instance/*", "volume/*", "network-interface/*", "launch-template/*", "spot-instances-request/*")
#: Tags on a request that this cluster's Karpenter makes (CreateFleet, CreateLaunchTemplate, CreateTags).
_REQUEST_TAGS = {f"aws:RequestTag/{_OWNED}": "owned", "aws:RequestTag/eks:eks-cluster-name": "${ClusterName}"}
_OWNED_BY_A_NODEPOOL = {"StringEquals": {f"aws:ResourceTag/{_OWNED}": "owned"},
                        "StringLike": {"aws:ResourceTag/karpenter.sh/nodepool": "*"}}
_PROFILE_OWNED = {f"aws:ResourceTag/{_OWNED}": "owned", "aws:ResourceTag/topology.kubernetes.io/region": "${AWS::Region}"}
_PROFILE_REQUEST = {**_REQUEST_TAGS, "aws:RequestTag/topology.kubernetes.io/region": "${AWS::Region}"}

#: The controller's six managed policies: name -> statements (upstream's order and Sids).
CONTROLLER_POLICY_STATEMENTS: dict[str, list[dict]] = {
    "NodeLifecyclePolicy": [
        {"Sid": "AllowScopedEC2InstanceAccessActions", "Effect": "Allow",
         "Resource": [*_ec2("image/*", "snapshot/*", account=""),
                      *_ec2("security-group/*", "subnet/*", "capacity-reservation/*", "placement-group/*")],
         "Action": ["ec2:RunInstances", "ec2:CreateFleet"]},
        {"Sid": "AllowScopedEC2LaunchTemplateAccessActions", "Effect": "Allow",
         "Resource": _ec2("launch-template/*")[0],
         "Action": ["ec2:RunInstances", "ec2:CreateFleet"],
         "Condition": _OWNED_BY_A_NODEPOOL},
        {"Sid": "AllowScopedEC2InstanceActionsWithTags", "Effect": "Allow", "Resource": _CREATED,
         "Action": ["ec2:RunInstances", "ec2:CreateFleet", "ec2:CreateLaunchTemplate"],
         "Condition": {"StringEquals": _REQUEST_TAGS, "StringLike": {"aws:RequestTag/karpenter.sh/nodepool": "*"}}},
        {"Sid": "AllowScopedResourceCreationTagging", "Effect": "Allow", "Resource": _CREATED, "Action": "ec2:CreateTags",
         "Condition": {"StringEquals": {**_REQUEST_TAGS,
                                        "ec2:CreateAction": ["RunInstances", "CreateFleet", "CreateLaunchTemplate"]},
                       "StringLike": {"aws:RequestTag/karpenter.sh/nodepool": "*"}}},
        {"Sid": "AllowScopedResourceTagging", "Effect": "Allow", "Resource": _ec2("instance/*")[0], "Action": "ec2:CreateTags",
         "Condition": {**_OWNED_BY_A_NODEPOOL,
                       "StringEqualsIfExists": {"aws:RequestTag/eks:eks-cluster-name": "${ClusterName}"},
                       "ForAllValues:StringEquals": {"aws:TagKeys": ["eks:eks-cluster-name", "karpenter.sh/nodeclaim", "Name"]}}},
        {"Sid": "AllowScopedDeletion", "Effect": "Allow", "Resource": _ec2("instance/*", "launch-template/*"),
         "Action": ["ec2:TerminateInstances", "ec2:DeleteLaunchTemplate"],
         "Condition": _OWNED_BY_A_NODEPOOL},
    ],
    "IAMIntegrationPolicy": [
        {"Sid": "AllowPassingInstanceRole", "Effect": "Allow", "Resource": "${NodeRoleArn}", "Action": "iam:PassRole",
         "Condition": {"StringEquals": {"iam:PassedToService": ["ec2.amazonaws.com", "ec2.amazonaws.com.cn"]}}},
        {"Sid": "AllowScopedInstanceProfileCreationActions", "Effect": "Allow", "Resource": _INSTANCE_PROFILES,
         "Action": ["iam:CreateInstanceProfile"],
         "Condition": {"StringEquals": _PROFILE_REQUEST,
                       "StringLike": {"aws:RequestTag/karpenter.k8s.aws/ec2nodeclass": "*"}}},
        {"Sid": "AllowScopedInstanceProfileTagActions", "Effect": "Allow", "Resource": _INSTANCE_PROFILES,
         "Action": ["iam:TagInstanceProfile"],
         "Condition": {"StringEquals": {**_PROFILE_OWNED, **_PROFILE_REQUEST},
                       "StringLike": {"aws:ResourceTag/karpenter.k8s.aws/ec2nodeclass": "*",
                                      "aws:RequestTag/karpenter.k8s.aws/ec2nodeclass": "*"}}},
        {"Sid": "AllowScopedInstanceProfileActions", "Effect": "Allow", "Resource": _INSTANCE_PROFILES,
         "Action": ["iam:AddRoleToInstanceProfile", "iam:RemoveRoleFromInstanceProfile", "iam:DeleteInstanceProfile"],
         "Condition": {"StringEquals": _PROFILE_OWNED,
                       "StringLike": {"aws:ResourceTag/karpenter.k8s.aws/ec2nodeclass": "*"}}},
    ],
    "EKSIntegrationPolicy": [
        {"Sid": "AllowAPIServerEndpointDiscovery", "Effect": "Allow", "Resource": _CLUSTER_ARN, "Action": "eks:DescribeCluster"},
    ],
    "InterruptionPolicy": [
        {"Sid": "AllowInterruptionQueueActions", "Effect": "Allow", "Resource": "${InterruptionQueueArn}",
         "Action": ["sqs:DeleteMessage", "sqs:GetQueueUrl", "sqs:ReceiveMessage"]},
    ],
    "ZonalShiftPolicy": [
        {"Sid": "AllowZonalShiftStatusReadOnly", "Effect": "Allow", "Resource": "*",
         "Action": ["arc-zonal-shift:GetManagedResource"],
         "Condition": {"StringEquals": {"arc-zonal-shift:ResourceIdentifier": _CLUSTER_ARN}}},
    ],
    "ResourceDiscoveryPolicy": [
        {"Sid": "AllowRegionalReadActions", "Effect": "Allow", "Resource": "*",
         "Action": [f"ec2:Describe{what}" for what in (
             "CapacityReservations", "Images", "Instances", "InstanceStatus", "InstanceTypeOfferings", "InstanceTypes",
             "LaunchTemplates", "PlacementGroups", "SecurityGroups", "SpotPriceHistory", "Subnets")],
         "Condition": {"StringEquals": {"aws:RequestedRegion": "${AWS::Region}"}}},
        {"Sid": "AllowSSMReadActions", "Effect": "Allow",
         "Resource": "arn:${AWS::Partition}:ssm:${AWS::Region}::parameter/aws/service/*", "Action": "ssm:GetParameter"},
        {"Sid": "AllowPricingReadActions", "Effect": "Allow", "Resource": "*", "Action": "pricing:GetProducts"},
        {"Sid": "AllowUnscopedInstanceProfileListAction", "Effect": "Allow", "Resource": "*", "Action": "iam:ListInstanceProfiles"},
        {"Sid": "AllowInstanceProfileReadActions", "Effect": "Allow", "Resource": _INSTANCE_PROFILES,
         "Action": "iam:GetInstanceProfile"},
    ],
}

#: The reference's controller policies (AWS::IAM::ManagedPolicy resources), in its order.
CONTROLLER_POLICIES = tuple(CONTROLLER_POLICY_STATEMENTS)

#: The reference's EventBridge rules, all sent to the interruption queue: name -> (source, detail-type).
INTERRUPTION_RULES: dict[str, tuple[str, str]] = {
    "ScheduledChangeRule": ("aws.health", "AWS Health Event"),
    "SpotInterruptionRule": ("aws.ec2", "EC2 Spot Instance Interruption Warning"),
    "RebalanceRule": ("aws.ec2", "EC2 Instance Rebalance Recommendation"),
    "InstanceStateChangeRule": ("aws.ec2", "EC2 Instance State-change Notification"),
    "CapacityReservationInterruptionRule": ("aws.ec2", "EC2 Capacity Reservation Instance Interruption Warning"),
}


def controller_policy_text(name: str) -> str:
    """One controller policy as the JSON text its ``Fn::Sub`` takes (variables ``${ClusterName}``,
    ``${NodeRoleArn}``, ``${InterruptionQueueArn}`` and CloudFormation's pseudo parameters)."""
    return json.dumps({"Version": "2012-10-17", "Statement": CONTROLLER_POLICY_STATEMENTS[name]}, separators=(",", ":"))
