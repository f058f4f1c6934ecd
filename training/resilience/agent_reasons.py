"""The reasons the EKS node monitoring agent writes into a node's ``AcceleratedHardwareReady``
condition, for the pinned agent (aws/eks-node-monitoring-agent v1.7.0), and which of them are the
GPU's faults. Pure data: the training's probe reads it (training/resilience/health.py), and the
stack's node-repair overrides are generated from it (ray_train_eks/constructs/node_health.py).

From the agent's sources at v1.7.0:

- ``pkg/reasons/reasons.yaml``: each reason's template and default severity; ``Fatal`` sets the
  condition false, ``Warning`` only emits an event (``pkg/manager/manager.go`` ``SendCondition``).
- ``monitors/nvidia/dcgm/dcgm_policies.go`` ``WellKnownXidCodes``: an XID of that list is
  ``NvidiaXID<n>Error`` (Fatal), any other ``NvidiaXID<n>Warning`` (an event: XIDs 13, 31, 43,
  45, 94 among them, which NVIDIA's catalog gives to the application).
- ``monitors/nvidia/dcgm/dcgm_reconcile.go``: any failure to reach DCGM's host engine, after a
  one-minute grace, is ``DCGMError`` (Fatal): the agent's own health, not the GPU's.
- ``pkg/manager/node_exporter.go`` ``Fatal``: sets the condition false, the reason the latest
  Fatal one, the messages joined with "; "; nothing sets it true again until the agent restarts.
- ``DCGMHealthCode<n>`` is Fatal only when DCGM's health check fails (``dcgm_healthcheck.go``).
"""

from __future__ import annotations

import re

AGENT_VERSION = "v1.7.0"
CONDITION = "AcceleratedHardwareReady"
#: dcgm_policies.go ``WellKnownXidCodes``.
WELL_KNOWN_XIDS = (46, 48, 54, 62, 63, 64, 74, 79, 95, 109, 110, 119, 120, 136, 140, 142, 143, 151, 155, 156, 158)
#: The Fatal reasons of the GPU, its memory, its links and its fabric (reasons.yaml).
FATAL_GPU_REASONS = (
    *(f"NvidiaXID{code}Error" for code in WELL_KNOWN_XIDS),
    "NvidiaDoubleBitError", "NvidiaNVLinkError", "NvidiaDeviceCountMismatch", "DCGMDiagnosticFailure",
    "FabricManagerNotRunning", "NvidiaFabricError",
)
#: ``DCGMHealthCode<n>``: Fatal when DCGM's health check fails (the code is DCGM's error code).
FATAL_HEALTH_CODE = re.compile(r"^DCGMHealthCode\d+$")
#: The agent's own health: it cannot reach DCGM. Reported, never acted on.
AGENT_HEALTH_REASONS = ("DCGMError",)
#: Every reason the agent may write for the condition (reasons.yaml), Warning ones as templates.
EMITTED = re.compile(r"^(NvidiaXID\d+(Error|Warning)|DCGMHealthCode\d+|DCGMFieldError\d+|DCGMError|DCGMDiagnosticFailure|"
                     r"NvidiaDeviceCountMismatch|NvidiaDoubleBitError|NvidiaNCCLError|NvidiaNVLinkError|NvidiaPCIeError|"
                     r"NvidiaPageRetirement|NvidiaPowerError|NvidiaThermalError|FabricManagerNotRunning|NvidiaFabricError|"
                     r"NvidiaGPUIsReady)$")
#: The message the agent writes for a well-known XID (dcgm_policies.go).
XID_MESSAGE = re.compile(r"detected XID-(\d+) on the instance")
#: Words of the messages of the other Fatal GPU reasons (dcgm_policies.go, dcgm_devices.go, the fabric
#: fields), found in a condition whose reason a later ``DCGMError`` overwrote.
MESSAGE_FAULTS = ((re.compile(r"double bit", re.IGNORECASE), "NvidiaDoubleBitError"),
                  (re.compile(r"nvlink", re.IGNORECASE), "NvidiaNVLinkError"),
                  (re.compile(r"device count", re.IGNORECASE), "NvidiaDeviceCountMismatch"),
                  (re.compile(r"fabric", re.IGNORECASE), "NvidiaFabricError"))


def gpu_fault(reason: str, message: str = "") -> str | None:
    """The GPU fault a false ``AcceleratedHardwareReady`` condition reports, or None when it reports
    none (the agent cannot reach DCGM: ``DCGMError``). The reason is the latest Fatal one and the
    messages accumulate, so a fault that came before a ``DCGMError`` is found in the message (an XID's
    number, or the words of a double-bit, NVLink, device-count or fabric fault)."""
    if reason in FATAL_GPU_REASONS or FATAL_HEALTH_CODE.match(reason or ""):
        return reason
    for code in XID_MESSAGE.findall(message or ""):
        if int(code) in WELL_KNOWN_XIDS:
            return f"NvidiaXID{code}Error"
    for pattern, fault in MESSAGE_FAULTS:
        if pattern.search(message or ""):
            return fault
    return None
