"""A Ray worker node that runs as in its pod: ``ray start --block`` as the first process of a PID
namespace of its own (``unshare``, an unprivileged user namespace), so that a command run in it
(``nsenter``, as the kubelet runs a preStop hook in the container) sees that node's processes
only: its one raylet, whose command line gives the node id and the GCS address. The network,
the files and the environment are the machine's, as several pods' would be on one host.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from local_s3 import free_port

#: The interpreter's folder first on PATH, as the image's PATH has its Python's ``bin``.
BIN = str(Path(sys.executable).parent)
#: What ``ray start`` prints once its node runs (ray/scripts/scripts.py ``startup_msg``).
STARTED = "Ray runtime started."
#: Attempts at starting a node before the test fails.
STARTS = 3


class PodNode:
    """One worker node of ``num_cpus`` joined to the Ray cluster at ``address``."""

    def __init__(self, address: str | None, *, num_cpus: int = 1, log: Path, env: dict[str, str] | None = None,
                 head_args: list[str] | None = None) -> None:
        """``env``: more of the pod's environment (every Ray worker of the node inherits it).
        ``address`` None and ``head_args``: a head node (``ray start --head`` with those
        arguments), as the head pod runs it; ending it ends every process it started, and no
        other Ray on the machine (``ray stop`` would stop them all)."""
        self.log = log
        # The pod's own scratch volume for staged checkpoints (the worker template's emptyDir at
        # RAY_TRAIN_EKS_SCRATCH): the nodes here share the machine's /tmp, and a writer sweeps its
        # run's folders there, which would take another node's (or test's) checkpoint mid-upload.
        scratch = log.with_suffix(".scratch")
        scratch.mkdir(exist_ok=True)
        env = {**os.environ, "PATH": f"{BIN}:{os.environ.get('PATH', '')}", "RAY_TRAIN_EKS_SCRATCH": str(scratch),
               **(env or {})}
        self.env = env
        role = ["--head", *(head_args or [])] if address is None else [f"--address={address}"]
        for attempt in range(1, STARTS + 1):
            #: The dashboard agent's port, which the liveness probe asks: in a pod, 52365 (KubeRay's), in
            #: the pod's own network namespace; the pods here share the host's, so each has its own.
            self.agent_port = free_port()
            self._log_from = len(log.read_text(errors="replace")) if log.exists() else 0
            with log.open("ab") as out:
                self.process = subprocess.Popen(
                    ["unshare", "--user", "--map-root-user", "--pid", "--fork", "--mount-proc",
                     f"{BIN}/ray", "start", *role, f"--num-cpus={num_cpus}", f"--dashboard-agent-listen-port={self.agent_port}",
                     "--block"],
                    stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
            self.pid = self._ray_start_pid()
            if self._started() or attempt == STARTS:
                break
            # `ray start` gave up: Ray 2.58 waits a fixed 30 s for the raylet to register
            # (ray/_private/node.py, "timed out during startup"), which two loaded cores can miss.
            # A pod whose container failed is replaced; so is this one.
            self.kill()
        try:
            self.node_id = self._wait_for_node_id()
        except BaseException:
            self.kill()  # a node that never started leaves nothing running
            raise

    def _started(self, timeout_s: float = 120) -> bool:
        """Whether ``ray start`` says the node runs (its "Ray runtime started." line) before it exits."""
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            if STARTED in self.log.read_text(errors="replace")[self._log_from:]:
                return True
            if self.process.poll() is not None:
                return False
            time.sleep(0.2)
        return False

    def _ray_start_pid(self) -> int:
        """The namespace's first process (``ray start``), seen from outside: unshare's child."""
        deadline = time.time() + 30
        while time.time() < deadline:
            children = subprocess.run(["pgrep", "-P", str(self.process.pid)], capture_output=True, text=True).stdout.split()
            if children:
                return int(children[0])
            time.sleep(0.1)
        raise AssertionError(f"unshare started no ray start; see {self.log}")

    def _wait_for_node_id(self) -> str:
        """The node id on its raylet's command line (``--node_id=``, what Ray's own
        ``services.find_node_ids`` reads), once the namespace has a raylet: read from ``/proc``
        here rather than by a Python that imports Ray every half second."""
        deadline = time.time() + 60
        while time.time() < deadline:
            for pid in self.processes():
                try:
                    argv = (Path("/proc") / str(pid) / "cmdline").read_bytes().split(b"\0")
                except OSError:
                    continue
                if argv and argv[0].endswith(b"/raylet"):
                    for arg in argv:
                        if arg.startswith(b"--node_id="):
                            return arg.split(b"=", 1)[1].decode()
            time.sleep(0.2)
        raise AssertionError(f"the node never started; see {self.log}")

    def run(self, command: list[str], *, timeout: float) -> subprocess.CompletedProcess:
        """``command`` in the node's namespaces, as the kubelet runs an exec hook in the container."""
        return subprocess.run(
            ["nsenter", f"--target={self.pid}", "--user", "--pid", "--mount", "--preserve-credentials",
             f"--wd={os.getcwd()}", *command],
            capture_output=True, text=True, timeout=timeout, env=self.env)

    def start(self, command: list[str]) -> subprocess.Popen:
        """``command`` in the node's namespaces, in the background."""
        return subprocess.Popen(
            ["nsenter", f"--target={self.pid}", "--user", "--pid", "--mount", "--preserve-credentials",
             f"--wd={os.getcwd()}", *command],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=self.env)

    def stop(self) -> None:
        """What the kubelet does once the preStop hook returned: SIGTERM to the container's first
        process (``ray start``), which drains and stops its node."""
        os.kill(self.pid, signal.SIGTERM)
        self.process.wait(timeout=60)

    def kill(self) -> None:
        """Every process of the node dies at once, with no signal handled."""
        if self.process.poll() is not None:
            return
        for pid in [self.pid, *self.processes()]:  # the namespace's init first: the kernel kills the rest
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()  # unshare itself
            self.process.wait(timeout=30)

    def processes(self) -> list[int]:
        """The node's processes (those in its PID namespace), seen from outside."""
        try:
            namespace = os.readlink(f"/proc/{self.pid}/ns/pid")
        except OSError:
            return []
        found = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    if os.readlink(entry / "ns" / "pid") == namespace:
                        found.append(int(entry.name))
                except OSError:
                    continue
        return found

    def vanish(self) -> None:
        """The instance is taken: every process of the node stops at once, mid-whatever, and no
        connection is closed (as when EC2 takes a Spot instance): Ray learns of it only from
        the GCS's missed health checks. :meth:`kill` cleans up after."""
        for pid in self.processes():
            try:
                os.kill(pid, signal.SIGSTOP)
            except ProcessLookupError:
                pass
