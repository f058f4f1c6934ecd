"""Reusable constructs of the training platform; import them into any CDK app.

>>> from ray_train_eks.constructs import TrainingNetwork, TrainingCluster, EfaNodeGroup, KarpenterGpuCapacity, RayWorkload
>>> from ray_train_eks.constructs import CloudWatchObservability, TrainingDashboard, IdleGpuAlarm, AccountChecks
>>> from ray_train_eks.constructs import NodeMonitoringAgent, TrainerAccess, RayServing
"""

from ray_train_eks.constructs.account_checks import AccountChecks
from ray_train_eks.constructs.addons import EfaDevicePlugin, KubeRayOperator, NvidiaDevicePlugin
from ray_train_eks.constructs.cluster import TrainingCluster
from ray_train_eks.constructs.efa_node_group import EfaNodeGroup
from ray_train_eks.constructs.karpenter import KarpenterGpuCapacity
from ray_train_eks.constructs.network import TrainingNetwork
from ray_train_eks.constructs.node_health import NodeMonitoringAgent
from ray_train_eks.constructs.observability import CloudWatchObservability, IdleGpuAlarm, TrainingDashboard
from ray_train_eks.constructs.queueing import KueueQueueing
from ray_train_eks.constructs.ray_serving import RayServing
from ray_train_eks.constructs.ray_workload import RayWorkload
from ray_train_eks.constructs.storage import RayServiceAccount, TrainingBucket
from ray_train_eks.constructs.trainer_access import TrainerAccess
from ray_train_eks.constructs.tracking import MlflowTracking

__all__ = [
    "AccountChecks",
    "CloudWatchObservability",
    "EfaDevicePlugin",
    "EfaNodeGroup",
    "IdleGpuAlarm",
    "KarpenterGpuCapacity",
    "KubeRayOperator",
    "KueueQueueing",
    "NodeMonitoringAgent",
    "NvidiaDevicePlugin",
    "RayServiceAccount",
    "RayServing",
    "RayWorkload",
    "TrainerAccess",
    "MlflowTracking",
    "TrainingBucket",
    "TrainingCluster",
    "TrainingDashboard",
    "TrainingNetwork",
]
