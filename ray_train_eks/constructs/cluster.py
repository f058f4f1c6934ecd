"""The EKS cluster and its CPU system node group."""

from __future__ import annotations

import ipaddress
import json
import re
from typing import Mapping, Sequence

from aws_cdk import Annotations, RemovalPolicy, Stack, Token, aws_ec2 as ec2, aws_eks_v2 as eks
from aws_cdk.lambda_layer_kubectl_v36 import KubectlV36Layer
from constructs import Construct

from ray_train_eks.constructs.keys import customer_managed_key
from ray_train_eks.constructs.launch_templates import (
    PULL_IOPS,
    gp3_iops_problem,
    gp3_throughput_problem,
    PULL_THROUGHPUT_MIBPS,
    launch_template_storage,
    node_disks,
    node_metadata_options,
    root_volume_problem,
)
from ray_train_eks.nag import acknowledge, acknowledge_node_role, managed_policy_rule
from ray_train_eks.validation import Prop, raise_problems

#: EKS-managed add-ons the cluster runs. eks-pod-identity-agent comes from
#: ``cluster.eks_pod_identity_agent`` (the same add-on a Pod Identity service account uses).
MANAGED_ADDONS = ("vpc-cni", "kube-proxy", "coredns")
#: The vpc-cni add-on's configuration that turns on its NetworkPolicy enforcement (its network
#: policy agent in the aws-node DaemonSet; the value is a string in the add-on's schema).
VPC_CNI_NETWORK_POLICY = {"enableNetworkPolicy": "true"}

#: Kubernetes versions this construct can deploy: each needs a kubectl Lambda layer of the same
#: minor version (a mismatched layer fails late with "error retrieving RESTMappings to prune").
KUBECTL_LAYERS: dict[str, str] = {"1.36": "aws-cdk.lambda-layer-kubectl-v36"}
_KUBECTL_LAYERS = {"1.36": (eks.KubernetesVersion.V1_36, KubectlV36Layer)}
#: Versions EKS still creates on 2026-11-30 (standard or extended support).
EKS_SUPPORTED_VERSIONS = ("1.32", "1.33", "1.34", "1.35", "1.36")
#: The system nodes pull the Ray Train DLC image for the Ray head and the submitter.
MIN_SYSTEM_ROOT_VOLUME_GIB = 80
#: A system node's root volume without instance storage: the DLC image the head and the
#: submitter run (tens of GB unpacked, plus the compressed layers while pulling).
SYSTEM_ROOT_GIB_WITHOUT_INSTANCE_STORE = 100
MAX_SYSTEM_NODES = 10
_ARN = re.compile(r"^arn:aws(?:-cn|-us-gov)?:iam::(\d{12}):(role|user)/[\w+=,.@/-]{1,512}$")
_ASSUMED_ROLE = re.compile(r"^arn:aws(?:-cn|-us-gov)?:sts::(\d{12}):assumed-role/([\w+=,.@-]+)/")


def kubernetes_version_problem(version: str, prop: Prop = Prop("kubernetes_version")) -> str | None:
    """Why the cluster cannot run Kubernetes ``version``, or None."""
    if not re.fullmatch(r"1\.\d{2}", version):
        return f"{prop(version)}: not a Kubernetes minor version; use 1.36"
    if version not in EKS_SUPPORTED_VERSIONS:
        return f"{prop(version)}: outside EKS support on 2026-11-30 (EKS cannot create it); use 1.36"
    if version not in KUBECTL_LAYERS:
        pinned = ", ".join(f"{v} with {layer}" for v, layer in KUBECTL_LAYERS.items())
        return f"{prop(version)}: no matching kubectl layer in this app (pinned: {pinned}); use 1.36"
    return None


def endpoint_cidrs_problems(cidrs: Sequence[str], prop: Prop = Prop("endpoint_access_cidrs")) -> list[str]:
    """What is wrong with the public endpoint's CIDRs (IPv4 networks, at least one)."""
    if not cidrs:
        return [f"{prop.name}: empty; give at least one CIDR, e.g. {prop.example('203.0.113.0/24')}"]
    problems = []
    for cidr in cidrs:
        try:
            network = ipaddress.ip_network(cidr, strict=True)
        except ValueError as error:
            try:
                fix = f"; did you mean {ipaddress.ip_network(cidr, strict=False)}?"
            except ValueError:
                fix = "; use the form 203.0.113.0/24"
            problems.append(f"{prop.name}: {cidr!r} is not a valid CIDR ({error}){fix}")
            continue
        if network.version != 4:
            problems.append(f"{prop.name}: {cidr!r} is IPv6; the EKS public endpoint accepts IPv4 CIDRs only")
    return problems


def admin_principal_problem(arn: str | None, prop: Prop = Prop("admin_role_arn"), *, account: str | None = None) -> str | None:
    """Why ``arn`` cannot get cluster-admin through an access entry (of ``account``, when known), or None."""
    if arn is None:
        return None
    assumed = _ASSUMED_ROLE.match(arn)
    if assumed:
        return (f"{prop(arn)}: an assumed-role session ARN; use the role's ARN, "
                f"arn:aws:iam::{assumed.group(1)}:role/{assumed.group(2)}")
    match = _ARN.match(arn)
    if not match:
        return f"{prop(arn)}: not an IAM role or user ARN; use the form arn:aws:iam::123456789012:role/NAME"
    if account and match.group(1) != account:
        return (f"{prop(arn)}: belongs to account {match.group(1)}, not the stack's account {account}; "
                f"use a principal of {account}")
    return None


def system_root_volume_problem(size_gib: int | None, prop: Prop = Prop("system_root_volume_gib"), *,
                               instance_type: str = "m7i.xlarge") -> str | None:
    """Why a system node's root volume of ``size_gib`` is too small for ``instance_type``, or None."""
    return root_volume_problem(size_gib, instance_type, minimum_without_instance_store=MIN_SYSTEM_ROOT_VOLUME_GIB,
                               default_without_instance_store=SYSTEM_ROOT_GIB_WITHOUT_INSTANCE_STORE, prop=prop,
                               what="the Ray head and the job submitter, which run the Ray Train DLC image")


def system_node_count_problem(count: int, prop: Prop = Prop("system_node_count")) -> str | None:
    """Why ``count`` system nodes cannot be, or None."""
    if not 1 <= count <= MAX_SYSTEM_NODES:
        return f"{prop(count)}: use 1 to {MAX_SYSTEM_NODES} system nodes (default 1)"
    return None


class TrainingCluster(Construct):
    """An ``aws_eks_v2`` cluster with managed node groups, ready for Helm charts.

    Control-plane logging (api, audit, authenticator), envelope encryption of secrets
    with a rotating KMS key, a private endpoint plus a public one limited to
    ``endpoint_access_cidrs``, a kubectl handler whose layer matches the version, the
    EKS add-ons vpc-cni, kube-proxy, coredns and eks-pod-identity-agent, and an
    on-demand AL2023 system node group.

    :param vpc: the VPC; the control plane and system nodes use its private subnets.
    :param kubernetes_version: minor version; only versions with a kubectl layer here. Default - 1.36.
    :param system_instance_type: CPU type of the system nodes. Default - m7i.xlarge.
    :param system_node_count: system nodes. Default - 1.
    :param system_root_volume_gib: root volume of each system node. Default - 100 (50 on a type
        with local NVMe, which then holds containerd and kubelet): the Ray head and the job
        submitter run the full CUDA DLC image there (tens of GB unpacked, plus the compressed
        layers while pulling), and kubelet starts evicting at 10% free.
    :param root_volume_throughput_mibps: gp3 throughput of a system node's root volume that holds
        containerd (a type without NVMe): the DLC pull. Default - 400.
    :param root_volume_iops: likewise. Default - 4000.
    :param system_node_labels: labels of the system nodes. Default - none.
    :param network_policy_enforcement: the VPC CNI enforces Kubernetes NetworkPolicies (its add-on
        configuration ``enableNetworkPolicy``; exposed as :attr:`network_policy_enforced`). Default - true.
    :param endpoint_access_cidrs: CIDRs allowed on the public endpoint. Default - 0.0.0.0/0, with a synth warning.
    :param admin_role_arn: IAM principal given cluster-admin through an access entry. Default - none, with a synth warning.
    :param cluster_name: Default - generated by CloudFormation.
    """

    def __init__(
        self,
        scope: Construct,
        id: str,
        *,
        vpc: ec2.IVpc,
        kubernetes_version: str = "1.36",
        system_instance_type: str = "m7i.xlarge",
        system_node_count: int = 1,
        system_root_volume_gib: int | None = None,
        root_volume_throughput_mibps: int = PULL_THROUGHPUT_MIBPS,
        root_volume_iops: int = PULL_IOPS,
        system_node_labels: Mapping[str, str] | None = None,
        network_policy_enforcement: bool = True,
        endpoint_access_cidrs: Sequence[str] = ("0.0.0.0/0",),
        admin_role_arn: str | None = None,
        cluster_name: str | None = None,
    ) -> None:
        super().__init__(scope, id)
        raise_problems("TrainingCluster", [
            kubernetes_version_problem(kubernetes_version), *endpoint_cidrs_problems(endpoint_access_cidrs),
            admin_principal_problem(None if Token.is_unresolved(admin_role_arn or "") else admin_role_arn),
            system_root_volume_problem(system_root_volume_gib, instance_type=system_instance_type),
            system_node_count_problem(system_node_count),
            gp3_throughput_problem(root_volume_throughput_mibps, iops=root_volume_iops), gp3_iops_problem(root_volume_iops),
        ])
        self._cluster(vpc, kubernetes_version=kubernetes_version, cluster_name=cluster_name,
                      endpoint_access_cidrs=endpoint_access_cidrs)
        self._access(endpoint_access_cidrs=endpoint_access_cidrs, admin_role_arn=admin_role_arn)
        self.system_disks = node_disks(system_instance_type, root_volume_gib=system_root_volume_gib, without_instance_store_gib=SYSTEM_ROOT_GIB_WITHOUT_INSTANCE_STORE,
                                       throughput_mibps=root_volume_throughput_mibps, iops=root_volume_iops)
        self._system_nodes(system_instance_type=system_instance_type, system_node_count=system_node_count,
                           system_node_labels=system_node_labels)
        self.network_policy_enforced = network_policy_enforcement
        self._managed_addons()

    def _cluster(self, vpc: ec2.IVpc, *, kubernetes_version: str, cluster_name: str | None,
                 endpoint_access_cidrs: Sequence[str]) -> None:
        """The cluster: native ``AWS::EKS::Cluster`` with node groups (not Auto Mode), control-plane
        logs, secrets encrypted with a rotating key, private and public endpoints, a kubectl
        handler whose layer matches the version."""
        version, layer_class = _KUBECTL_LAYERS[kubernetes_version]
        # It encrypts only this cluster's Kubernetes secrets, which die with the cluster: its
        # deletion is scheduled with the stack's (kms.Key defaults to Retain), after the
        # shortest waiting period KMS allows.
        self.secrets_key = customer_managed_key(self, "SecretsKey", description="Envelope encryption of EKS secrets",
                                                removal_policy=RemovalPolicy.DESTROY)
        self.cluster = eks.Cluster(
            self,
            "Resource",
            version=version,
            cluster_name=cluster_name,
            vpc=vpc,
            vpc_subnets=[ec2.SubnetSelection(subnet_type=ec2.SubnetType.PRIVATE_WITH_EGRESS)],
            # Managed node groups, not Auto Mode: the GPU nodes need an EFA launch template.
            default_capacity_type=eks.DefaultCapacityType.NODEGROUP,
            default_capacity=0,
            endpoint_access=eks.EndpointAccess.PUBLIC_AND_PRIVATE.only_from(*endpoint_access_cidrs),
            cluster_logging=[
                eks.ClusterLoggingTypes.API,
                eks.ClusterLoggingTypes.AUDIT,
                eks.ClusterLoggingTypes.AUTHENTICATOR,
            ],
            secrets_encryption_key=self.secrets_key,
            # Without a kubectl provider, aws_eks_v2 cannot apply Helm charts or manifests.
            # It runs inside the VPC (private endpoint + private subnets), so a narrow
            # public CIDR list does not cut CDK off from the cluster.
            kubectl_provider_options=eks.KubectlProviderOptions(kubectl_layer=layer_class(self, "KubectlLayer")),
        )
        acknowledge(
            self.cluster.role,
            "EKS requires AmazonEKSClusterPolicy on the cluster role.",
            managed_policy_rule("AmazonEKSClusterPolicy"),
        )
        self._acknowledge_kubectl_provider()

    def _access(self, *, endpoint_access_cidrs: Sequence[str], admin_role_arn: str | None) -> None:
        """Who reaches the API: a warning for an endpoint open to the world, and cluster-admin
        for ``admin_role_arn`` through an access entry (a warning without one)."""
        if any(cidr.endswith("/0") for cidr in endpoint_access_cidrs):
            Annotations.of(self).add_warning_v2(
                "ray-train-eks:endpoint-open",
                "The EKS public endpoint accepts any address (endpointAccessCidrs=0.0.0.0/0); "
                "limit it with -c endpointAccessCidrs=<your CIDR>",
            )
        if admin_role_arn:
            self.cluster.grant_access(
                "AdminAccess",
                admin_role_arn,
                [
                    eks.AccessPolicy.from_access_policy_name(
                        "AmazonEKSClusterAdminPolicy", access_scope_type=eks.AccessScopeType.CLUSTER
                    )
                ],
            )
        else:
            Annotations.of(self).add_warning_v2(
                "ray-train-eks:no-admin",
                "No adminRoleArn: nobody but CDK's kubectl handler can use kubectl on this cluster; "
                "set -c adminRoleArn=arn:aws:iam::<account>:role/<your role>",
            )

    def _system_nodes(self, *, system_instance_type: str, system_node_count: int,
                      system_node_labels: Mapping[str, str] | None) -> None:
        """The on-demand AL2023 system node group: IMDSv2 with one hop, containerd on NVMe (a type
        with instance storage) or an encrypted gp3 root volume with throughput for the DLC pull."""
        system_template = ec2.CfnLaunchTemplate(
            self,
            "SystemLaunchTemplate",
            launch_template_data=ec2.CfnLaunchTemplate.LaunchTemplateDataProperty(
                metadata_options=node_metadata_options(),
                **launch_template_storage(self.system_disks),
            ),
        )
        self.system_nodes = self.cluster.add_nodegroup_capacity(
            "SystemNodes",
            instance_types=[ec2.InstanceType(system_instance_type)],
            ami_type=eks.NodegroupAmiType.AL2023_X86_64_STANDARD,
            capacity_type=eks.CapacityType.ON_DEMAND,
            min_size=system_node_count,
            desired_size=system_node_count,
            max_size=system_node_count,
            labels=dict(system_node_labels) if system_node_labels else None,
            launch_template_spec=eks.LaunchTemplateSpec(
                id=system_template.ref, version=system_template.attr_latest_version_number
            ),
        )
        acknowledge_node_role(self.system_nodes)

    def _managed_addons(self) -> None:
        """The EKS add-ons vpc-cni, kube-proxy, coredns and eks-pod-identity-agent.

        ``preserve_on_delete``: when CloudFormation deletes one, EKS leaves its pods running
        (AWS::EKS::Addon PreserveOnDelete), so DNS, pod networking and credentials keep working
        for whatever is still being deleted, until the cluster itself goes. (Unset, the
        property is absent from the template and EKS's default removes them.)"""
        self.addons: dict[str, eks.IAddon] = {}
        for name in MANAGED_ADDONS:
            configuration = VPC_CNI_NETWORK_POLICY if name == "vpc-cni" and self.network_policy_enforced else None
            addon = eks.Addon(self, f"Addon-{name}", cluster=self.cluster, addon_name=name, preserve_on_delete=True,
                              configuration_values=configuration)
            # EKS bootstraps self-managed copies of these three; take them over instead of failing.
            addon.node.default_child.resolve_conflicts = "OVERWRITE"
            self.addons[name] = addon
        # coredns only turns ACTIVE once a node can run it.
        self.addons["coredns"].node.add_dependency(self.system_nodes)
        self.addons["eks-pod-identity-agent"] = self.cluster.eks_pod_identity_agent
        self.cluster.eks_pod_identity_agent.node.default_child.preserve_on_delete = True

    def outlive_kubernetes_objects(self, scope: Construct) -> None:
        """Make every Helm release and Kubernetes manifest under ``scope`` depend on the core
        add-ons, so that CloudFormation deletes them all (and the controllers among them finish
        cleaning up AWS resources: Karpenter's instances, KubeRay's pods) before the add-ons
        they need: coredns, vpc-cni, kube-proxy and the Pod Identity agent have no dependents
        otherwise, and CloudFormation deletes those first, in parallel with the rest."""
        addons = list(self.addons.values())
        for child in scope.node.find_all():
            if isinstance(child, (eks.HelmChart, eks.KubernetesManifest)):
                child.node.add_dependency(*addons)

    def _acknowledge_kubectl_provider(self) -> None:
        provider = self.cluster.kubectl_provider
        # The handler adds the ECR Public policy under a condition; cdk-nag names it by the whole Fn::If.
        condition = provider.node.find_child("Handler").node.find_child("HasEcrPublic")
        ecr_public = {
            "Fn::If": [
                Stack.of(self).resolve(condition.logical_id),
                {"Fn::Join": ["", ["arn:", {"Ref": "AWS::Partition"}, ":iam::aws:policy/AmazonElasticContainerRegistryPublicReadOnly"]]},
                {"Ref": "AWS::NoValue"},
            ]
        }
        acknowledge(
            provider,
            "The kubectl handler and its provider framework are CDK's own Lambda functions: CDK chooses their "
            "runtime and their managed policies (logs, VPC ENIs, image pulls); the framework may invoke only "
            "versions of the handler.",
            "AwsSolutions-L1",
            managed_policy_rule("AWSLambdaBasicExecutionRole", service_role=True),
            managed_policy_rule("AWSLambdaVPCAccessExecutionRole", service_role=True),
            managed_policy_rule("AmazonEC2ContainerRegistryReadOnly"),
            f"AwsSolutions-IAM4[Policy::{json.dumps(ecr_public, separators=(',', ':'))}]",
            f"AwsSolutions-IAM5[Resource::<{Stack.of(self).resolve(provider.node.find_child('Handler').node.default_child.logical_id)}.Arn>:*]",
        )
