"""cdk8s charts of the Ray workload (ray_workload_chart.py: the namespace, the training-code and
settings ConfigMaps, the Ray objects as checked plain dicts, ``write_dist``), which the CDK stack
attaches with ``cluster.add_cdk8s_chart``.

The objects themselves are built without cdk8s in ray_train_eks/workload/; their names are
importable from here too, as they were before they moved there (round 9). The charts are
imported when first used (:func:`__getattr__`): cdk8s starts Node.js, which whoever imports this
package for the builders alone need not.
"""

from ray_train_eks.workload import *  # noqa: F401,F403  (the builders' names, as before their move)
from ray_train_eks.workload import __all__ as _WORKLOAD_NAMES

#: The cdk8s charts (ray_workload_chart.py), imported on first use.
_CHARTS = ("NamespaceChart", "ObjectChart", "SettingsChart", "TrainingCodeChart", "write_dist")

__all__ = sorted([*_WORKLOAD_NAMES, *_CHARTS])


def __getattr__(name: str):
    if name in _CHARTS:
        from ray_train_eks.charts import ray_workload_chart

        return getattr(ray_workload_chart, name)
    raise AttributeError(f"module 'ray_train_eks.charts' has no attribute {name!r}")
