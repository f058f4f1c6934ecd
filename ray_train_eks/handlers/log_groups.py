"""Custom resource: CloudWatch log groups that another program writes to, kept with a
retention, a KMS key and a removal of ours.

The amazon-cloudwatch-observability add-on writes to fixed names
(``/aws/containerinsights/<cluster>/application``, ``dataplane``, ``host`` and ``performance``)
and its Fluent Bit and agent create a missing group without retention. ``AWS::Logs::LogGroup``
cannot hold them: a group retained by an earlier deploy (``observability=false`` then ``true``
again) makes its create fail with ``ResourceAlreadyExistsException``. This handler adopts a
group that exists, creates one that does not, and sets the retention and the key on both;
on delete it removes them only when told to (``destroyData``).

Properties: ``LogGroupNames`` (list), ``RetentionInDays``, ``KmsKeyArn`` (optional),
``DeleteOnRemoval`` ("true"/"false").
"""

from __future__ import annotations

import logging

LOG = logging.getLogger()
LOG.setLevel(logging.INFO)


def _client():
    import boto3

    return boto3.client("logs")


def ensure(logs, name: str, *, retention_days: int, kms_key_arn: str | None) -> str:
    """Create ``name`` if it is missing, then set its retention and key; returns what it did."""
    try:
        logs.create_log_group(logGroupName=name, **({"kmsKeyId": kms_key_arn} if kms_key_arn else {}))
        done = "created"
    except logs.exceptions.ResourceAlreadyExistsException:
        done = "adopted"
        if kms_key_arn:
            logs.associate_kms_key(logGroupName=name, kmsKeyId=kms_key_arn)
        else:
            logs.disassociate_kms_key(logGroupName=name)
    logs.put_retention_policy(logGroupName=name, retentionInDays=retention_days)
    return done


def remove(logs, name: str) -> str:
    """Delete ``name`` (already gone is fine)."""
    try:
        logs.delete_log_group(logGroupName=name)
        return "deleted"
    except logs.exceptions.ResourceNotFoundException:
        return "already gone"


def on_event(event: dict, context=None, *, logs=None) -> dict:
    """The custom resource's handler (CDK's provider framework calls it; an exception fails the deploy)."""
    props = event["ResourceProperties"]
    names = list(props["LogGroupNames"])
    physical_id = event.get("PhysicalResourceId") or "log-groups:" + ",".join(sorted(names))
    logs = logs or _client()
    if event["RequestType"] in ("Create", "Update"):
        for name in names:
            LOG.info("%s %s", ensure(logs, name, retention_days=int(props["RetentionInDays"]),
                                     kms_key_arn=props.get("KmsKeyArn") or None), name)
        return {"PhysicalResourceId": "log-groups:" + ",".join(sorted(names))}
    if str(props.get("DeleteOnRemoval", "false")).lower() == "true":
        for name in names:
            LOG.info("%s %s", remove(logs, name), name)
    else:
        LOG.info("kept %s (destroyData is off)", ", ".join(names))
    return {"PhysicalResourceId": physical_id}
