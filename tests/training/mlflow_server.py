"""A real MLflow tracking server on 127.0.0.1 (``mlflow server``, MLflow 3.17.2 from its own virtual
environment, ``.venv-mlflow``: ``make test`` installs it), with a sqlite backend and an artifact store
in a folder: what the training logs to in the tests, stopped and started again on the same port and
store where a test needs the tracker gone for a while."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from local_s3 import free_port

ROOT = Path(__file__).resolve().parents[2]
MLFLOW = ROOT / ".venv-mlflow" / "bin" / "mlflow"


class MlflowServer:
    def __init__(self, folder: Path) -> None:
        if not MLFLOW.exists():
            pytest.fail(f"{MLFLOW} is missing: the tests' MLflow server is installed by `make test` "
                        "(make .venv-mlflow/.installed)")
        self.folder, self.port = folder, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None
        self.start()

    def start(self, timeout_s: float = 90) -> None:
        """Start it (again: the same port, backend and artifacts) and wait until it answers."""
        log = open(self.folder / "server.log", "ab")
        self.process = subprocess.Popen(
            [str(MLFLOW), "server", "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1",
             "--backend-store-uri", f"sqlite:///{self.folder / 'mlflow.db'}",
             "--artifacts-destination", str(self.folder / "artifacts")],
            # A session of its own: the server's workers (uvicorn, MLflow's huey job consumers) stop with it.
            stdout=log, stderr=subprocess.STDOUT, cwd=self.folder, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.process.poll() is None, (self.folder / "server.log").read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2):
                    return
            except OSError:
                time.sleep(0.25)
        raise AssertionError(f"mlflow server did not answer within {timeout_s} s")

    def stop(self) -> None:
        """Stop the server and every process it started (its group)."""
        if self.process is None:
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.process.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                continue
            time.sleep(0.5)  # the group's others, after the leader
        try:
            os.killpg(self.process.pid, signal.SIGKILL)  # whatever of the group outlived its leader
        except ProcessLookupError:
            pass

    def client(self):
        from training.telemetry.tracking import client_for

        return client_for(self.url)

    def runs(self, experiment: str = "ray-train-eks") -> list:
        """The experiment's runs, any status."""
        client = self.client()
        found = client.get_experiment_by_name(experiment)
        return client.search_runs([found.experiment_id]) if found else []
