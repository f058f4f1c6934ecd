#!/usr/bin/env python3
"""A CDK app of someone else's that adds EFA GPU nodes, the device plugins and KubeRay
to the VPC and EKS cluster it already has, with ray-train-eks's constructs.

    pip install <path or URL of ray-train-eks>
    cdk synth --app "python examples/consumer_app/app.py"
"""

from aws_cdk import App, Environment, Stack, aws_ec2 as ec2, aws_eks_v2 as eks
from aws_cdk.lambda_layer_kubectl_v36 import KubectlV36Layer
from constructs import Construct

from ray_train_eks.constructs import (
    EfaDevicePlugin,
    EfaNodeGroup,
    KubeRayOperator,
    NvidiaDevicePlugin,
    RayServiceAccount,
    TrainingBucket,
    TrainingNetwork,
)


class ResearchStack(Stack):
    """The consumer's own stack: its VPC and cluster, plus our GPU building blocks."""

    def __init__(self, scope: Construct, id: str, **kwargs) -> None:
        super().__init__(scope, id, **kwargs)
        # What the consumer already had.
        vpc = ec2.Vpc(self, "TeamVpc", max_azs=2, nat_gateways=1)
        cluster = eks.Cluster(
            self,
            "TeamCluster",
            version=eks.KubernetesVersion.V1_36,
            vpc=vpc,
            default_capacity_type=eks.DefaultCapacityType.NODEGROUP,
            default_capacity=1,
            kubectl_provider_options=eks.KubectlProviderOptions(kubectl_layer=KubectlV36Layer(self, "Kubectl")),
        )
        # What ray-train-eks adds.
        network = TrainingNetwork(self, "Network", existing_vpc=vpc)
        gpus = EfaNodeGroup(self, "H100Nodes", cluster=cluster, subnet=network.gpu_subnet, instance_type="p5.48xlarge", node_count=1)
        for plugin in (
            NvidiaDevicePlugin(self, "NvidiaDevicePlugin", cluster=cluster),
            EfaDevicePlugin(self, "EfaDevicePlugin", cluster=cluster, region=self.region, instance_types=["p5.48xlarge"]),
        ):
            plugin.node.add_dependency(gpus.nodegroup)
        KubeRayOperator(self, "KubeRay", cluster=cluster)
        bucket = TrainingBucket(self, "Data")
        RayServiceAccount(self, "RayPods", cluster=cluster, bucket=bucket.bucket)


def main() -> App:
    """Build and synthesize the consumer app."""
    app = App()
    ResearchStack(app, "ResearchGpuStack", env=Environment(region="us-east-1"))
    app.synth()
    return app


if __name__ == "__main__":
    main()
