"""Scheduled each minute: how many GPU instances of the cluster are running, from EC2 itself,
published as a CloudWatch metric for the idle-GPU alarm.

The alarm's other inputs come from the CloudWatch agent on the GPU nodes: when the agent does not
run there, or the NVIDIA device plugin never advertises the GPUs (a broken node, a misconfigured
one), it sends nothing, not even that GPUs exist (aws/amazon-cloudwatch-agent
``podstore.go`` ``decorateNode`` sends ``node_gpu_limit`` only for a node with GPUs in its
capacity), and an alarm judged on the agent alone stays OK while the nodes bill. EC2 knows.

An instance is the cluster's by the tags EKS and Karpenter give it: ``eks:cluster-name`` (a
managed node group's) or ``eks:eks-cluster-name`` (Karpenter 1.14's), of one of the GPU types;
one a Karpenter NodePool of ``EXCLUDED_NODE_POOLS`` launched (its ``karpenter.sh/nodepool`` tag) is
not counted: serving's nodes, whose replicas idle between requests by design.

Environment: ``CLUSTER_NAME``, ``INSTANCE_TYPES`` (comma-separated), ``NAMESPACE``, ``METRIC``,
``EXCLUDED_NODE_POOLS`` (comma-separated, optional).
"""

from __future__ import annotations

import logging
import os

LOG = logging.getLogger()
LOG.setLevel(logging.INFO)

#: The tags that name an instance's cluster: a managed node group's, Karpenter's.
CLUSTER_TAGS = ("eks:cluster-name", "eks:eks-cluster-name")
#: The tag Karpenter gives an instance, naming the NodePool that launched it.
NODE_POOL_TAG = "karpenter.sh/nodepool"


def running_gpu_instances(ec2, *, cluster: str, instance_types: list[str], excluded_pools: frozenset[str] = frozenset()) -> list[str]:
    """Ids of the cluster's running instances of ``instance_types``, but those of ``excluded_pools``."""
    found = set()
    for tag in CLUSTER_TAGS:
        for page in ec2.get_paginator("describe_instances").paginate(Filters=[
                {"Name": f"tag:{tag}", "Values": [cluster]}, {"Name": "instance-type", "Values": instance_types},
                {"Name": "instance-state-name", "Values": ["running"]}]):
            found.update(i["InstanceId"] for r in page["Reservations"] for i in r["Instances"]
                         if {t["Key"]: t["Value"] for t in i.get("Tags") or []}.get(NODE_POOL_TAG) not in excluded_pools)
    return sorted(found)


def handler(event=None, context=None, *, ec2=None, cloudwatch=None) -> int:
    """Count and publish; returns the count."""
    cluster, types = os.environ["CLUSTER_NAME"], os.environ["INSTANCE_TYPES"].split(",")
    if ec2 is None or cloudwatch is None:
        import boto3

        ec2, cloudwatch = boto3.client("ec2"), boto3.client("cloudwatch")
    excluded = frozenset(filter(None, os.environ.get("EXCLUDED_NODE_POOLS", "").split(",")))
    ids = running_gpu_instances(ec2, cluster=cluster, instance_types=types, excluded_pools=excluded)
    cloudwatch.put_metric_data(Namespace=os.environ["NAMESPACE"], MetricData=[{
        "MetricName": os.environ["METRIC"], "Dimensions": [{"Name": "ClusterName", "Value": cluster}],
        "Value": float(len(ids)), "Unit": "Count"}])
    LOG.info("%d GPU instance(s) running: %s", len(ids), ", ".join(ids) or "none")
    return len(ids)
