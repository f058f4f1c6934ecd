"""A run that survives what real clusters do: checks before the first step (:mod:`.preflight`),
preemptions with notice (:mod:`.preemption`), broken GPUs and nodes (:mod:`.health`, which
taints a node through :mod:`.kube`), and NCCL's warnings in the job log (:mod:`.nccl_log`)."""
