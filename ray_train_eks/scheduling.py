"""Where pods land: the node labels, the GPU taint and the Ray namespace that the node
groups, the Helm values and the Ray pod templates must agree on. One home, so they can't drift."""

NODE_ROLE_LABEL = "ray-train-eks/node-role"
SYSTEM_NODE_SELECTOR = {NODE_ROLE_LABEL: "system"}
GPU_NODE_SELECTOR = {NODE_ROLE_LABEL: "gpu"}
#: Taint on the GPU nodes that keeps every pod without the toleration off them.
GPU_TAINT_KEY = "nvidia.com/gpu"
GPU_TOLERATION = {"key": GPU_TAINT_KEY, "operator": "Exists", "effect": "NoSchedule"}
#: Namespace and service account of the Ray pods (Pod Identity to the training bucket).
RAY_NAMESPACE = "ray-train"
RAY_SERVICE_ACCOUNT = "ray-train"
#: With Karpenter, serving's GPU nodes come from a NodePool of their own (a limit of their own, so a
#: service never takes a training job's nodes): their role label differs from training's, so each
#: side's pods select only their own nodes (the device plugins select ``nvidia.com/gpu.present``).
SERVING_NODE_SELECTOR = {NODE_ROLE_LABEL: "gpu-serving"}
