"""Node health without a person: the EKS node monitoring agent finds a broken GPU, network,
disk, kernel or container runtime and sets a node condition; node repair acts on it, the managed
node group's ``nodeRepairConfig`` or Karpenter's ``NodeRepair`` feature.

What each part does, from the sources:

- The ``eks-node-monitoring-agent`` add-on runs two DaemonSets (aws/eks-node-monitoring-agent
  v1.7.0, ``charts/eks-node-monitoring-agent/values.yaml``): the agent, which tolerates every
  taint (``nodeAgent.tolerations: [{operator: Exists}]``) and sets the conditions
  ``AcceleratedHardwareReady``, ``NetworkingReady``, ``StorageReady``, ``KernelReady`` and
  ``ContainerRuntimeReady``; and ``dcgm-server`` (NVIDIA DCGM's host engine, through which the
  agent reads XID errors), which tolerates *nothing* by default (``dcgmAgent.tolerations: []``), so
  on GPU nodes tainted ``nvidia.com/gpu`` it never runs and the agent reports ``DCGMError``
  instead of the GPU's faults. Its tolerations are set here. The add-on needs no IAM permissions
  (EKS User Guide, "AWS add-ons": "This add-on doesn't require additional permissions").
- A managed node group's repair (EKS User Guide, "node-repair"): ``AcceleratedHardwareReady``
  false is repaired after 10 minutes (reboot or replace by the fault's default), every other
  condition and ``Ready`` after 30; repairs stop when "the node group has more than five nodes
  and more than 20% of the nodes in the node group are unhealthy". :func:`node_group_repair_config`
  sets the threshold explicitly, so that it holds at every size: half the group, at least one.
  Only a managed node group *reboots* (the same page: "only EKS managed node groups support Reboot
  as a repair action"), and a reboot keeps the Node object, with the taint the training put on it
  (training/resilience/faults.py): the next worker pod could never land there, in a group with no
  spare node. So the node group's repair replaces instead, for every reason of
  ``AcceleratedHardwareReady`` the agent calls fatal (:data:`REPLACE_ON`; the agent's
  ``pkg/reasons/reasons.yaml``): ``NodeRepairConfigOverrides`` (EKS API ``NodeRepairConfigOverrides``:
  condition, reason, wait, action ``Replace | Reboot | NoAction``, "you must specify all the values").
  A fault the agent does not report (a straggler) is never repaired: the run stops then, with what
  to do (training/resilience/replacement.py ``NoReplacement``).
- Karpenter 1.14.1's repair (kubernetes-sigs/karpenter v1.14.1
  ``pkg/controllers/node/health/controller.go``; aws/karpenter-provider-aws v1.14.1
  ``pkg/cloudprovider/cloudprovider.go`` ``RepairPolicies``): behind the ``NodeRepair`` feature
  gate (alpha, off by default; chart value ``settings.featureGates.nodeRepair``); the same
  conditions and waits (``AcceleratedHardwareReady`` 10 minutes, the others and ``Ready`` 30); it
  deletes the NodeClaim, and the node's pods are deleted without waiting for budgets or
  ``do-not-disrupt``. It repairs unless more than ``ceil(20% x nodes)`` of the NodePool are
  unhealthy (``allowedUnhealthyPercent``, not configurable): 1 of 2 nodes is repaired, 2 of 2 not.
"""

from __future__ import annotations

from typing import Mapping, Sequence

from aws_cdk import aws_eks_v2 as eks
from constructs import Construct

from ray_train_eks.scheduling import GPU_TOLERATION

ADDON_NAME = "eks-node-monitoring-agent"


def monitoring_agent_configuration(dcgm_tolerations: Sequence[Mapping[str, str]]) -> dict:
    """The add-on's configuration values (schema: ``charts/configuration.schema.json``, keys
    ``nodeAgent``, ``dcgmAgent``): DCGM's host engine tolerates the GPU nodes' taints."""
    return {"dcgmAgent": {"tolerations": [dict(t) for t in dcgm_tolerations]}}


def unhealthy_nodes_repaired(node_count: int) -> int:
    """How many unhealthy nodes of ``node_count`` the node group still repairs: half, at least one.
    Above it a fault is likely not the nodes' (a bad AMI, a zone's trouble) and replacing them all
    would only cost more."""
    return max(1, node_count // 2)


def _agent_reasons():
    """training/resilience/agent_reasons.py as the wheel ships it: the one table of the agent's reasons."""
    from ray_train_eks.training_code.resilience import agent_reasons

    return agent_reasons


#: Every reason the node monitoring agent (v1.7.0) writes as Fatal for a fault of the GPU, its memory,
#: links or fabric (training/resilience/agent_reasons.py ``FATAL_GPU_REASONS``): the node group
#: replaces the node for each, never reboots it (a reboot keeps the training's taint).
#: ``DCGMHealthCode<n>`` (a reason per DCGM error code) keeps EKS's default action.
REPLACE_ON = _agent_reasons().FATAL_GPU_REASONS
#: The agent's own health (``DCGMError``: it cannot reach DCGM, latched until it restarts): no repair.
NO_ACTION_ON = _agent_reasons().AGENT_HEALTH_REASONS
#: The wait before a repair, as the default for the condition (EKS User Guide, "node-repair").
ACCELERATED_REPAIR_WAIT_MINUTES = 10


def node_group_repair_config(node_count: int) -> dict:
    """The managed node group's ``NodeRepairConfig`` (CloudFormation ``AWS::EKS::Nodegroup``):
    repair on, up to :func:`unhealthy_nodes_repaired` unhealthy nodes, as many at once; each
    fault's default wait and action (the EKS User Guide's table), except that a GPU fault the
    agent calls fatal replaces the node rather than rebooting it (:data:`REPLACE_ON`), and the
    agent's own ``DCGMError`` repairs nothing (:data:`NO_ACTION_ON`): one DCGM restart latches it on
    every GPU node at once."""
    repaired = unhealthy_nodes_repaired(node_count)
    overrides = [{"NodeMonitoringCondition": "AcceleratedHardwareReady", "NodeUnhealthyReason": reason,
                  "MinRepairWaitTimeMins": ACCELERATED_REPAIR_WAIT_MINUTES, "RepairAction": action}
                 for action, reasons in (("Replace", REPLACE_ON), ("NoAction", NO_ACTION_ON)) for reason in reasons]
    return {"Enabled": True, "MaxUnhealthyNodeThresholdCount": repaired, "MaxParallelNodesRepairedCount": repaired,
            "NodeRepairConfigOverrides": overrides}


class NodeMonitoringAgent(Construct):
    """The ``eks-node-monitoring-agent`` EKS add-on: node conditions for GPU (NVIDIA XID and DCGM
    health), network, storage, kernel and container runtime faults, for node repair to act on.

    :param cluster: the cluster.
    :param addon_version: Default - the version EKS gives the cluster's Kubernetes version.
    :param dcgm_tolerations: of the DCGM host engine's DaemonSet (the agent's own tolerates every
        taint). Default - the ``nvidia.com/gpu`` taint.
    """

    def __init__(self, scope: Construct, id: str, *, cluster: eks.ICluster, addon_version: str | None = None,
                 dcgm_tolerations: Sequence[Mapping[str, str]] = (GPU_TOLERATION,)) -> None:
        super().__init__(scope, id)
        self.configuration = monitoring_agent_configuration(dcgm_tolerations)
        self.addon = eks.Addon(self, "Resource", cluster=cluster, addon_name=ADDON_NAME, addon_version=addon_version,
                               configuration_values=self.configuration)
