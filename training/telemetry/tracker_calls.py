"""How the tracking code talks to MLflow: MLflow's client with its own HTTP retries off, and the retries
made here instead, bounded by a deadline and never blind.

MLflow 3.17's REST client retries every method, POSTs included (``mlflow/utils/request_utils.py``
``_cached_get_request_session``: urllib3's ``Retry`` with ``allowed_methods=None``), after a read
timeout too, and sleeps whatever a 503's ``Retry-After`` says with no cap
(``MLFLOW_HTTP_RESPECT_RETRY_AFTER_HEADER``, default true). A create that was slow but succeeded is
then made twice (an orphan RUNNING run, a second model version), a batch logged twice, and one call
can hold the run's end for as long as the server asks. So MLflow's own knobs
(``mlflow/environment_variables.py``, read per request in ``mlflow/utils/rest_utils.py``
``http_request``) are set: no retry, ``Retry-After`` not honoured, a 10 s timeout per request. Here
(:class:`Calls`) a call whose answer did not come is tried again while the deadline leaves room for
a whole request; one that changes something and may have taken effect (a create, a batch of steps)
is first looked for (its ``landed`` check), so nothing is made or logged twice.

A refusal (HTTP 403) is said as a permission problem naming the pods' AWS identity and the action
(:func:`describe`), not as a tracker that cannot be used."""

from __future__ import annotations

import logging
import os
import re
import sys
import threading
import time
from typing import Any, Callable

#: MLflow's settings that make a request one try, bounded: forced (the retries made here depend on them).
FORCED_HTTP_SETTINGS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_RESPECT_RETRY_AFTER_HEADER": "false"}
#: sagemaker-mlflow 0.5.0's switch for artifact uploads through presigned URLs the tracker gives
#: (``sagemaker_mlflow/s3_presigned_artifact_repo.py``): for an artifact store the pods' role may not write.
PRESIGNED_UPLOAD_ENV = "SAGEMAKER_PRESIGNED_URL_UPLOAD_ENABLED"
#: And the time one request may take (connect, then each read), unless the environment sets it.
TIMEOUT_ENV, DEFAULT_TIMEOUT_S = "MLFLOW_HTTP_REQUEST_TIMEOUT", 10
#: The most the environment's timeout may be (MLflow's own default, 120 s in ``mlflow/environment_variables.py``,
#: is twice the run's end's whole wait): half the wait to open the run (tracking.py ``OPEN_WAIT_S``, 20 s: a try
#: and a look whether it landed), a sixth of the end's (``FINISH_WAIT_S``, 60 s). No request goes out that could
#: not end within its wait, so a longer one would leave no room for any.
MAX_TIMEOUT_S = 10
#: Seconds between tries of a call whose answer did not come.
BACKOFF_S = 2.0
#: What MLflow's client says when the tracker did not answer (as opposed to answering with a refusal).
_UNREACHABLE = re.compile(r"Max retries exceeded|Connection refused|timed out|timeout|Connection aborted|RemoteDisconnected|"
                          r"Connection reset|\b50[0234]\b|\b408\b|too many (?:50\d|408) error")
#: A refusal: MLflow's PERMISSION_DENIED (HTTP 403 without a JSON body), or the body of an AWS 403.
_DENIED = re.compile(r"PERMISSION_DENIED|error code 403|not authorized to perform|AccessDenied", re.IGNORECASE)
#: IAM's words in a refusal (IAM User Guide, "Troubleshoot access denied error messages").
_IAM_DENIAL = re.compile(r"User: (arn:\S+) is not authorized to perform: (\S+?)(?: on resource: (\S+?))?(?: because|$|\s)")


def request_timeout_s() -> float:
    """What one request may take (:data:`TIMEOUT_ENV`, at most :data:`MAX_TIMEOUT_S`)."""
    return min(float(os.environ.get(TIMEOUT_ENV) or DEFAULT_TIMEOUT_S), MAX_TIMEOUT_S)


def client_for(uri: str, *, presigned_uploads: bool = False):
    """An ``MlflowClient`` for ``uri`` whose requests are one try each (see the module's text);
    ``presigned_uploads``: artifacts go up through URLs the tracker presigns (:data:`PRESIGNED_UPLOAD_ENV`)."""
    os.environ.update(FORCED_HTTP_SETTINGS)
    if presigned_uploads:
        os.environ[PRESIGNED_UPLOAD_ENV] = "true"
    os.environ.setdefault(TIMEOUT_ENV, str(DEFAULT_TIMEOUT_S))
    if float(os.environ[TIMEOUT_ENV]) > MAX_TIMEOUT_S:  # MLflow reads it per request: capped where it reads it
        print(f"[tracking] {TIMEOUT_ENV}={os.environ[TIMEOUT_ENV]} is capped at {MAX_TIMEOUT_S} s (half the wait to open "
              "the run: tracker_calls.MAX_TIMEOUT_S)", file=sys.stderr, flush=True)
        os.environ[TIMEOUT_ENV] = str(MAX_TIMEOUT_S)
    if uri.startswith("file:"):
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps it in maintenance mode
    if not uri.startswith("arn:"):  # the sagemaker-mlflow plugin's header provider warns on every other URI
        logging.getLogger("mlflow.tracking.request_header.registry").setLevel(logging.ERROR)
    import mlflow
    from mlflow.tracking import MlflowClient

    # The sagemaker-mlflow plugin signs for the process's tracking URI, not the client's
    # (auth_provider.py, mlflow_sagemaker_request_header_provider.py: mlflow.get_tracking_uri()).
    mlflow.set_tracking_uri(uri)
    return MlflowClient(tracking_uri=uri)


def unreachable(error: BaseException) -> bool:
    """Whether ``error`` says the tracker did not answer (worth another try), not that it refused."""
    return not denied(error) and bool(_UNREACHABLE.search(str(error)))


#: A request that went out and got no answer (urllib3's read timeout, a connection the server dropped, or a
#: gateway that gave up waiting: a 504, 502 or 408 from the load balancer in front of SageMaker's MLflow or a
#: self-hosted server, whose backend may still be at work): the server may have acted on it, and may still be.
#: (A refused or timed-out connect sent nothing; a 500 or 503 is the server's own answer, its work done.)
#: MLflow 3.17 with its retries off says a status as urllib3 does, "too many 504 error responses"
#: (``mlflow/utils/request_utils.py``: these codes are in its ``_TRANSIENT_FAILURE_RESPONSE_CODES``), else
#: "failed with error code 504" (``rest_utils.py``).
_SENT_UNANSWERED = re.compile(r"Read timed out|ReadTimeout|RemoteDisconnected|Connection aborted|Connection reset|"
                              r"too many (?:502|504|408) error|error code (?:502|504|408)\b")


def sent_unanswered(error: BaseException) -> bool:
    """Whether ``error`` says the request went out and no answer came (see :data:`_SENT_UNANSWERED`)."""
    return bool(_SENT_UNANSWERED.search(str(error)))


def denied(error: BaseException) -> bool:
    """Whether the tracker refused for want of permission (HTTP 403)."""
    return getattr(error, "error_code", None) == "PERMISSION_DENIED" or bool(_DENIED.search(str(error)))


def not_found(error: BaseException) -> bool:
    """Whether the tracker answered that the thing asked for does not exist (deleted, or another store)."""
    return getattr(error, "error_code", None) == "RESOURCE_DOES_NOT_EXIST"


def identity(said: str = "") -> str:
    """The AWS identity the pods call with: the one a refusal names, else ``AWS_ROLE_ARN`` (IRSA), else
    STS's answer (Pod Identity's credentials carry no ARN in the environment), else a word that it is not
    readable here."""
    found = _IAM_DENIAL.search(said)
    if found:
        return found.group(1)
    if os.environ.get("AWS_ROLE_ARN"):
        return os.environ["AWS_ROLE_ARN"]
    try:
        import boto3
        from botocore.config import Config

        sts = boto3.client("sts", config=Config(connect_timeout=2, read_timeout=3, retries={"total_max_attempts": 1}))
        return sts.get_caller_identity()["Arn"]
    except Exception:  # noqa: BLE001 - no credentials, no network: said as not known
        return "the pods' role (its ARN is not readable here)"


def action(uri: str, operation: str, said: str = "") -> str:
    """The IAM action a call needs: the one a refusal names, else for a SageMaker MLflow App its one
    data-plane action, for a tracking server ``sagemaker-mlflow:<operation>`` (the Service Authorization
    Reference's names), else the MLflow operation on that server."""
    found = _IAM_DENIAL.search(said)
    if found:
        return found.group(2)
    if uri.startswith("arn:") and ":mlflow-app/" in uri:
        return "sagemaker:CallMlflowAppApi"
    if uri.startswith("arn:"):
        return f"sagemaker-mlflow:{operation}"
    return operation


def describe(error: BaseException, *, uri: str, operation: str) -> str:
    """One line on a failed call: a refusal as the permission it lacks (who, which action, on what),
    anything else as MLflow said it."""
    said = str(error)
    if denied(error):
        return (f"permission denied: {identity(said)} may not {action(uri, operation, said)} on {uri} ({operation}); "
                "grant it to the pods' role (docs/operations.md, Tracking)")
    return f"{operation}: {type(error).__name__}: {said[:300]}"


class TrackerUnanswered(RuntimeError):
    """The tracker did not answer a call within the time it had."""


class Calls:
    """Calls to one tracker until ``deadline`` (``time.monotonic()``), said with ``log``."""

    def __init__(self, deadline: float, log: Callable[[str], None]) -> None:
        self.deadline, self.log, self.started = deadline, log, time.monotonic()
        #: Whether a call went unanswered; the MLflow operation of the last call (what a refusal names).
        self.unanswered, self.operation = False, ""

    def room_for_a_request(self, *, pause: bool = True) -> bool:
        """Whether a request started now, with the pause before it (``pause``: a try again), ends before the
        deadline."""
        return time.monotonic() + (BACKOFF_S if pause else 0.0) + request_timeout_s() <= self.deadline

    def call(self, operation: str, send: Callable[[], Any], *, landed: tuple[str, Callable[[], Any]] | None = None,
             unbounded: bool = False) -> Any:
        """``send()`` (MLflow's ``operation``) until the tracker answers it, while the deadline leaves room;
        an answer that is a refusal or an error raises at once. ``landed`` (for a call that changes
        something: a create, a batch): the operation and the question whether an unanswered try took
        effect after all (its result, or None), asked before any new try. A request that went out and got
        no answer (a read timeout, a dropped connection) is never sent again: the server may still be
        acting on it, so the question is asked until it says yes or the time is out. Nothing is made
        twice. No request goes out, a first one included, where it could not end before the deadline (a slow
        server's answers count too). ``unbounded``: ``send`` has no timeout of its own (sagemaker-mlflow's
        presigned PUTs through MLflow's ``cloud_storage_http_request``, ``timeout=None`` and 5 retries:
        ``mlflow/utils/request_utils.py``), so it runs in a daemon thread waited for until the deadline.
        Raises :class:`TrackerUnanswered` once out of time."""
        while True:
            self.operation = operation
            if not self.room_for_a_request(pause=False):
                self.unanswered = True
                raise TrackerUnanswered(f"no time left for {operation} (the wait of {self.deadline - self.started:.0f} s "
                                        "is spent: the tracker did not answer, or answered too slowly, in it)")
            try:
                return self._until_deadline(send) if unbounded else send()
            except TrackerUnanswered:
                raise
            except Exception as error:  # noqa: BLE001 - sorted below
                if not unreachable(error):
                    raise
                self._pause_or_give_up(operation, error)
                failure = error  # the except clause's name goes at its end
            while landed is not None:
                found = self.call(*landed)
                if found is not None:
                    return found
                if not sent_unanswered(failure):
                    break
                self._pause_or_give_up(operation, failure)

    def _until_deadline(self, send: Callable[[], Any]) -> Any:
        """``send()`` in a daemon thread, waited for until the deadline; :class:`TrackerUnanswered` after
        (the thread is left to end on its own, or with the process)."""
        outcome: dict = {}

        def run() -> None:
            try:
                outcome["value"] = send()
            except BaseException as error:  # noqa: BLE001 - handed to the caller's thread
                outcome["error"] = error

        thread = threading.Thread(target=run, name=f"tracker-{self.operation}", daemon=True)
        thread.start()
        thread.join(max(0.0, self.deadline - time.monotonic()))
        if thread.is_alive():
            self.unanswered = True
            raise TrackerUnanswered(f"{self.operation} had not ended at the deadline; it is left to end on its own")
        if "error" in outcome:
            raise outcome["error"]
        return outcome.get("value")

    def _pause_or_give_up(self, operation: str, error: BaseException) -> None:
        """The pause before another try, or :class:`TrackerUnanswered` where no room is left for one."""
        if not self.room_for_a_request():
            self.unanswered = True
            raise TrackerUnanswered(f"no answer from the tracker in the time it had ({type(error).__name__}: "
                                    f"{str(error)[:200]})") from error
        if not self.unanswered:
            self.log(f"the tracker did not answer {operation} ({type(error).__name__}); trying again while "
                     f"{self.deadline - time.monotonic():.0f} s are left")
        self.unanswered = True
        time.sleep(BACKOFF_S)
