#!/usr/bin/env python3
"""A CDK app of someone else's: its own VPC and EKS cluster (a default node group, no labels
of ray-train-eks), to which it adds EFA GPU nodes, the device plugins, KubeRay and a
RayJob that runs its own training package, with ray-train-eks's constructs. Two stacks:
GPU nodes from a fixed node group, and GPU nodes from Karpenter only while the job runs.

    pip install <path or URL of ray-train-eks>
    cdk synth --app "python app.py"
"""

from pathlib import Path

from aws_cdk import App, Environment, Stack, aws_ec2 as ec2, aws_eks_v2 as eks
from aws_cdk.lambda_layer_kubectl_v36 import KubectlV36Layer
from constructs import Construct

from ray_train_eks.charts import RayWorkloadSpec
from ray_train_eks.constructs import (
    CloudWatchObservability,
    EfaDevicePlugin,
    EfaNodeGroup,
    IdleGpuAlarm,
    KarpenterGpuCapacity,
    KubeRayOperator,
    NvidiaDevicePlugin,
    RayServiceAccount,
    RayServing,
    RayWorkload,
    TrainingBucket,
    TrainingDashboard,
    TrainingNetwork,
)

HERE = Path(__file__).resolve().parent


class ResearchStack(Stack):
    """The consumer's own stack: its VPC and cluster, plus our GPU building blocks.

    :param on_demand: GPU nodes from Karpenter while the job runs, instead of a node group.
    """

    def __init__(self, scope: Construct, id: str, *, on_demand: bool = False, **kwargs) -> None:
        super().__init__(scope, id, **kwargs)
        # What the consumer already had: CDK's default node group (m5.large), no labels of ours.
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
        plugins = [
            NvidiaDevicePlugin(self, "NvidiaDevicePlugin", cluster=cluster),
            EfaDevicePlugin(self, "EfaDevicePlugin", cluster=cluster, region=self.region, instance_types=["p5.48xlarge"]),
        ]
        if on_demand:
            gpus = KarpenterGpuCapacity(self, "H100Capacity", cluster=cluster, subnet=network.gpu_subnet, instance_type="p5.48xlarge", node_count=1)
            # The RayJob goes first on destroy, so the NodePool's nodes are empty when it goes.
            job_after = [gpus.node_pool_manifest, *plugins]
            # No karpenter.sh/do-not-disrupt on the pods: the NodePool's budgets keep drift and
            # consolidation off running nodes, and the preStop hook's checkpoint needs the drain.
            pods = {"pre_running_deadline_seconds": 1800}
        else:
            gpus = EfaNodeGroup(self, "H100Nodes", cluster=cluster, subnet=network.gpu_subnet, instance_type="p5.48xlarge", node_count=1)
            for plugin in plugins:
                plugin.node.add_dependency(gpus.nodegroup)
            job_after, pods = [], {}
        kuberay = KubeRayOperator(self, "KubeRay", cluster=cluster)
        bucket = TrainingBucket(self, "Data")
        service_account = RayServiceAccount(self, "RayPods", cluster=cluster, bucket=bucket.bucket)
        spec = RayWorkloadSpec(
            gpu_instance_type="p5.48xlarge",
            gpu_node_count=1,
            system_instance_type="m5.large",  # not in ray-train-eks's table: sized explicitly
            head_resources=(1, 4),
            entrypoint=("python", "-m", "my_trainer.main", "--epochs", "1"),
            code_package="my_trainer",
            **pods,
        )
        RayWorkload(self, "FineTune", cluster=cluster, bucket=bucket.bucket, spec=spec, training_code_dir=HERE / "my_trainer",
                    depends_on=[kuberay, service_account, *job_after])
        if not on_demand:
            # Last week's runs behind an OpenAI API on the same nodes (checked and staged at deploy).
            RayServing(self, "Chat", cluster=cluster, spec=spec, bucket=bucket.bucket, name="chat",
                       runs=["dolly-lora", "alpaca-lora"], depends_on=[kuberay, service_account])
        # Seeing it: Container Insights on their cluster, an idle-GPU alarm and the dashboard.
        CloudWatchObservability(self, "Observability", cluster=cluster, log_retention_days=14)
        idle = IdleGpuAlarm(self, "IdleGpus", cluster_name=cluster.cluster_name, minutes=60)
        TrainingDashboard(self, "Dashboard", cluster_name=cluster.cluster_name, ray_namespace=service_account.namespace,
                          alarms=[idle.alarm])


def main() -> App:
    """Build and synthesize the consumer app."""
    app = App()
    ResearchStack(app, "ResearchGpuStack", env=Environment(region="us-east-1"))
    ResearchStack(app, "ResearchOnDemandGpuStack", on_demand=True, env=Environment(region="us-east-1"))
    app.synth()
    return app


if __name__ == "__main__":
    main()
