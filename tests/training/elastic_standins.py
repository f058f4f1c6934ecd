"""Stand-ins of the tests of an elastic run (tests/training/test_elastic.py, test_elastic_policy.py):
Ray's internal key-value store as the growth's handshake uses it, and a started worker group as Ray
Train's callbacks see it."""

from __future__ import annotations

import json


class FakeKV:
    """Ray's internal key-value store (``ray.experimental.internal_kv``) as the handshake uses it."""

    def __init__(self) -> None:
        self.values: dict[tuple[str, str], str] = {}
        self.events: list = []

    def _internal_kv_put(self, key, value, overwrite=True, namespace=None):
        self.values[(namespace, key)] = value
        self.events.append(("put", key, json.loads(value)))

    def _internal_kv_get(self, key, namespace=None):
        return self.values.get((namespace, key))

    def _internal_kv_del(self, key, namespace=None):
        self.values.pop((namespace, key), None)


class Group(list):
    """A started worker group as Ray Train's callbacks see it: one entry a rank, ``execute`` run here."""

    def execute(self, fn, *args, **kwargs):
        return [fn(*args, **kwargs)]
