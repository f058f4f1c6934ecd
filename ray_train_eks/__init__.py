"""ray-train-eks: an EKS platform with EFA GPU nodes and KubeRay for Ray Train fine-tunes."""

__version__ = "0.1.0"
