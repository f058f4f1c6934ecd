"""The local S3 (moto's server, bench/local_s3.py) of the storage tests: its bucket, and a free port; and
a local SNS topic, read back through SQS (the notification tests)."""

from __future__ import annotations

import contextlib
import os

from bench.local_s3 import free_port

S3_BUCKET = "ray-train-eks-test"

__all__ = ["S3_BUCKET", "LocalTopic", "exported", "free_port"]


@contextlib.contextmanager
def exported(values: dict[str, str]):
    """``values`` in this process's environment (and so in every process it starts) while inside, then as before."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


class LocalTopic:
    """An SNS topic on moto's server with an SQS queue subscribed to it: what the run published, read back."""

    def __init__(self, endpoint: str, name: str) -> None:
        import boto3

        keys = {"endpoint_url": endpoint, "region_name": "us-east-1", "aws_access_key_id": "testing",
                "aws_secret_access_key": "testing"}
        self.sns, self.sqs = boto3.client("sns", **keys), boto3.client("sqs", **keys)
        self.arn = self.sns.create_topic(Name=name)["TopicArn"]
        self.queue = self.sqs.create_queue(QueueName=f"{name}-read")["QueueUrl"]
        queue_arn = self.sqs.get_queue_attributes(QueueUrl=self.queue, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
        self.sns.subscribe(TopicArn=self.arn, Protocol="sqs", Endpoint=queue_arn)

    def messages(self) -> list[dict]:
        """Every message published so far (``Subject``, ``Message``), in the order they came."""
        import json

        found = []
        while True:
            batch = self.sqs.receive_message(QueueUrl=self.queue, MaxNumberOfMessages=10).get("Messages") or []
            if not batch:
                return found
            for message in batch:
                found.append(json.loads(message["Body"]))
                self.sqs.delete_message(QueueUrl=self.queue, ReceiptHandle=message["ReceiptHandle"])
