"""How long a run's end waits on a tracker that accepts and never answers, with the defaults (the
driver's wait, training/telemetry/tracking.py ``FINISH_WAIT_S``, and MLflow's request timeout):
the backfill, the artifacts, the registered model and the status, all of them.

    python -m bench.tracker_end

A socket on 127.0.0.1 that accepts every connection and never answers stands in for the hung
server; the run's folder has three steps, a summary and a model to register."""

from __future__ import annotations

import json
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path


def stalled_server() -> tuple[str, socket.socket]:
    """A server that accepts connections and never answers (nor closes them)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    held = []

    def accept() -> None:
        while True:
            try:
                held.append(listener.accept()[0])
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    return f"http://127.0.0.1:{listener.getsockname()[1]}", listener


def main() -> int:
    import argparse

    from training.telemetry import tracking

    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()

    url, listener = stalled_server()
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0 / s, "time": 1.0}) + "\n"
                                                            for s in (1, 2, 3)))
        run = tracking.RunTracking(tracking.client_for(url), url, "1", "0" * 32, continued=False)
        said: list[str] = []
        started = time.monotonic()
        run.finish("FINISHED", run_folder=folder, summary={"final_model": "s3://bucket/runs/r/final", "steps": 3},
                   register_as="model", log=said.append)
        took = time.monotonic() - started
    listener.close()
    for line in said:
        print(f"  {line[:200]}")
    print(f"the run's end against a tracker that never answers: {took:.1f} s (wait {tracking.FINISH_WAIT_S} s in all, "
          f"requests {tracking.request_timeout_s():.0f} s each)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
