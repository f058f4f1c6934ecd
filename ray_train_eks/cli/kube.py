"""The cluster as ``ray-train-eks`` reaches it: the ``kubernetes`` client (kubernetes-client/python)
for everything but the EKS token, and every failure said as a sentence with its fix.

The client does what a kubeconfig can ask (``kubernetes/config/kube_config.py``): every file of
``KUBECONFIG`` merged, tokens and ``tokenFile``, client certificates, ``exec`` plugins (a token or a
certificate, refreshed at its ``expirationTimestamp``), ``tls-server-name``, paths relative to the
kubeconfig. Ours is only what ``aws eks get-token`` does (awscli
``customizations/eks/get_token.py``: ``TokenGenerator``, ``STSClientFactory``): a presigned STS
``GetCallerIdentity`` URL that signs the cluster's name in ``x-k8s-aws-id``, base64url-encoded
after ``k8s-aws-v1.``, made with the STS endpoint botocore resolves for the region's partition
(``sts.cn-north-1.amazonaws.com.cn`` in China, GovCloud's in GovCloud); EKS accepts such a token
for 15 minutes, and one is made afresh every 10.

Calls are retried on 429 and 5xx (honouring ``Retry-After``) and on a refused connection; every call
has a connect timeout, so an endpoint that drops packets (the stack's ``endpointAccessCidrs``) is
said in seconds, not after the operating system gives up.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import re
import shutil
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

#: awscli's constants (customizations/eks/get_token.py).
TOKEN_PREFIX = "k8s-aws-v1."
K8S_AWS_ID_HEADER = "x-k8s-aws-id"
TOKEN_EXPIRES_S = 60
#: A fresh EKS token this often (EKS accepts one for 15 minutes; awscli gives it 14).
TOKEN_REFRESH_S = 600
#: Seconds to connect, seconds to wait for a reply (a followed log or a watch sets its own).
CONNECT_TIMEOUT_S = 10
READ_TIMEOUT_S = 60
#: urllib3's exponential backoff between retries: 0.5, 1, 2, 4, 8 s (15.5 s over five). A TLS failure
#: is not retried (``other=0``): a certificate the CA does not sign stays so.
RETRY_BACKOFF_S = 0.5
#: The Kubernetes group our stack binds to the trainers' Role (constructs/trainer_access.py).
TRAINERS_GROUP = "ray-train-eks:trainers"
_ASSUMED_ROLE = re.compile(r"^arn:(aws(?:-cn|-us-gov)?):sts::(\d{12}):assumed-role/([\w+=,.@-]+)/")
_FORBIDDEN = re.compile(r'User "(?P<user>[^"]*)" cannot (?P<verb>\w+) resource "(?P<resource>[^"]+)"'
                        r'(?: in API group "(?P<group>[^"]*)")?(?: in the namespace "(?P<namespace>[^"]+)")?')


class KubeError(RuntimeError):
    """A call the cluster refused or could not be made: what happened and what to do about it."""

    def __init__(self, message: str, *, code: int | None = None, reason: str = "", status: dict | None = None,
                 dropped: bool = False) -> None:
        super().__init__(message)
        self.code, self.reason, self.status, self.dropped = code, reason, status or {}, dropped


def role_arn(identity: str) -> str:
    """The IAM role ARN an access entry takes for an STS assumed-role ARN (EKS refuses the
    ``sts::...:assumed-role/NAME/SESSION`` form); other ARNs as they are. A role with a path
    shows without it here (STS drops it): the entry needs the role's full ARN."""
    match = _ASSUMED_ROLE.match(identity)
    return f"arn:{match.group(1)}:iam::{match.group(2)}:role/{match.group(3)}" if match else identity


@dataclass
class Access:
    """Who the command is, for the messages a 401 or 403 gets."""

    identity: str = ""
    cluster_name: str = ""
    kubeconfig_context: str = ""
    namespace_hint: str = ""

    def unauthorized(self, server: str) -> str:
        if self.kubeconfig_context:
            return (f"the API server {server} does not know the identity of kubeconfig context {self.kubeconfig_context!r} "
                    "(HTTP 401): its token or certificate is wrong or expired; refresh your kubeconfig (for EKS: aws eks "
                    "update-kubeconfig --name CLUSTER), or ask the cluster's admin for access")
        arn = role_arn(self.identity)
        partition = arn.split(":")[1] if arn.startswith("arn:") else "aws"
        return (f"the cluster {self.cluster_name} does not let {self.identity} in (HTTP 401: no EKS access entry for it). "
                f"Deploy the stack with -c trainerRoleArns={arn} (the trainers' least-privilege role), or have an admin run: "
                f"aws eks create-access-entry --cluster-name {self.cluster_name} --principal-arn {arn} "
                f"--kubernetes-groups {TRAINERS_GROUP}; for full access instead, aws eks associate-access-policy "
                f"--cluster-name {self.cluster_name} --principal-arn {arn} --policy-arn "
                f"arn:{partition}:eks::aws:cluster-access-policy/AmazonEKSClusterAdminPolicy --access-scope type=cluster")

    def forbidden(self, message: str) -> str:
        found = _FORBIDDEN.search(message or "")
        if not found:
            return f"the cluster refused the call (HTTP 403: {message}); ask the cluster's admin for access"
        resource = found["resource"] + (f".{found['group']}" if found["group"] else "")
        where = f" in namespace {found['namespace']}" if found["namespace"] else ""
        fix = (f"deploy the stack with -c trainerRoleArns={role_arn(self.identity)} (a Role with every verb ray-train-eks "
               f"uses: docs/security.md)" if self.cluster_name else "ask the cluster's admin for a role that allows it "
               "(docs/security.md lists the verbs ray-train-eks uses)")
        return f"{found['user']} may not {found['verb']} {resource}{where} (HTTP 403, RBAC): {fix}"


@dataclass
class Cluster:
    """The API server, through the ``kubernetes`` client, with JSON in and out (dicts, as the
    objects are built), and failures as :class:`KubeError` sentences."""

    api_client: object
    server: str
    access: Access = field(default_factory=Access)

    # ---------------------------------------------------------------- the calls
    def _api(self, name: str):
        from kubernetes import client

        return getattr(client, name)(self.api_client)

    @contextmanager
    def _said(self) -> Iterator[None]:
        """Every failure of a call as a sentence."""
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError as Urllib3Error, ProtocolError, ReadTimeoutError

        try:
            yield
        except ApiException as error:
            raise self._refused(error) from None
        except (ProtocolError, ReadTimeoutError) as error:  # a stream cut mid-way (an API server replaced, a proxy)
            raise KubeError(f"the connection to {self.server} dropped ({error})", dropped=True) from None
        except Urllib3Error as error:
            raise KubeError(self._unreachable(error)) from None

    def _refused(self, error) -> KubeError:
        try:
            status = json.loads(error.body or "{}")
        except (TypeError, ValueError):
            status = {}
        message = status.get("message") or error.reason or "no message"
        if error.status == 401:
            return KubeError(self.access.unauthorized(self.server), code=401, reason="Unauthorized", status=status)
        if error.status == 403:
            return KubeError(self.access.forbidden(message), code=403, reason="Forbidden", status=status)
        return KubeError(f"HTTP {error.status} {message}", code=error.status, reason=status.get("reason", ""), status=status)

    def _unreachable(self, error) -> str:
        reason = getattr(error, "reason", None) or error
        text = str(reason)
        if "CERTIFICATE_VERIFY_FAILED" in text or "SSLError" in type(reason).__name__:
            detail = next((f"certificate verify failed: {e.verify_message}" for e in (reason, *getattr(reason, "args", ()))
                           if getattr(e, "verify_message", None)), text)
            return (f"the API server {self.server} did not prove who it is ({detail}): the kubeconfig's "
                    "certificate-authority does not sign its certificate (or tls-server-name does not match)")
        return (f"cannot reach the cluster's API server {self.server} ({type(reason).__name__}: {text[:200]}). If you are "
                "online, your address may not be among the stack's endpointAccessCidrs: deploy with "
                "-c endpointAccessCidrs=<your address>/32 (curl -s https://checkip.amazonaws.com), or run from inside the VPC")

    def request(self, api: str, method: str, *args, **kwargs):
        """``kubernetes.client.<api>().<method>(...)``: the JSON reply as a dict."""
        kwargs.setdefault("_request_timeout", (CONNECT_TIMEOUT_S, READ_TIMEOUT_S))
        with self._said():
            reply = getattr(self._api(api), method)(*args, _preload_content=False, **kwargs)
            return json.loads(reply.data or b"{}")

    def ray_object(self, namespace: str, plural: str, name: str) -> dict | None:
        """A ``ray.io/v1`` object (``rayjobs``, ``rayservices``), or None where there is none."""
        try:
            return self.request("CustomObjectsApi", "get_namespaced_custom_object", "ray.io", "v1", namespace, plural, name)
        except KubeError as error:
            if error.code == 404:
                return None
            raise

    def watch(self, api: str, method: str, *args, timeout_s: float, **kwargs) -> Iterator[tuple[str, dict]]:
        """(event type, object) as they come from a ``watch=true`` list, for up to ``timeout_s``. A
        watch the server ends (its timeout, an expired version: 410) or a dropped connection ends
        the iteration: callers read the state again and watch anew."""
        from kubernetes import watch

        left = max(1.0, timeout_s)
        try:
            with self._said():
                for event in watch.Watch().stream(getattr(self._api(api), method), *args, timeout_seconds=max(1, int(left)),
                                                  _request_timeout=(CONNECT_TIMEOUT_S, left + 30), deserialize=False,
                                                  **kwargs):
                    if event.get("type") == "ERROR":
                        return
                    yield event["type"], event["object"]
        except KeyError:  # the client reads an ERROR event's raw_object, which plain JSON events lack
            return
        except KubeError as error:
            if error.dropped:
                return
            raise

    def port_forward(self, namespace: str, pod: str, port: int):
        """A forward to ``pod``'s ``port`` through the API server (one TCP stream on a websocket: the
        client's ``PortForward``), and its socket."""
        from kubernetes.stream import portforward

        with self._said():
            opened = portforward(self._api("CoreV1Api").connect_get_namespaced_pod_portforward, pod, namespace, ports=str(port))
        # What the kubelet says of the pod's port (nothing listening there) comes on the forward's error
        # channel only once bytes are sent: the caller reads ``opened.error(port)`` when its exchange fails.
        return opened, opened.socket(port)

    def log_stream(self, pod: str, namespace: str, *, follow: bool, tail: int | None, previous: bool) -> Iterator[bytes]:
        """A pod's log as it comes (``follow``), its last ``tail`` lines, or its previous container's."""
        kwargs = {"follow": follow, "previous": previous}
        if tail is not None:
            kwargs["tail_lines"] = tail
        with self._said():
            reply = self._api("CoreV1Api").read_namespaced_pod_log(
                pod, namespace, _preload_content=False, _request_timeout=(CONNECT_TIMEOUT_S, None if follow else READ_TIMEOUT_S),
                **kwargs)
            try:
                yield from reply.stream(4096)
            finally:
                reply.release_conn()


def keepalive(configuration) -> None:
    """TCP keepalive on the client's sockets, so a quiet followed log or watch behind a proxy's idle
    timeout is kept open (or found dead) instead of hanging."""
    import socket

    from urllib3.connection import HTTPConnection

    options = list(HTTPConnection.default_socket_options) + [(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)]
    if hasattr(socket, "TCP_KEEPIDLE"):
        options += [(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 60), (socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 20),
                    (socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3)]
    configuration.socket_options = options


def retries():
    """Retry 429 and 5xx (the API server's priority and fairness, a control plane scaling) on every
    method: a create that did arrive answers 409 the second time, which the caller takes as done."""
    from urllib3.util.retry import Retry

    return Retry(total=6, connect=3, read=1, status=5, other=0, backoff_factor=RETRY_BACKOFF_S, status_forcelist=(429, 500, 502, 503, 504),
                 allowed_methods=None, respect_retry_after_header=True, raise_on_status=False)


def eks_token(cluster_name: str, *, session) -> str:
    """A bearer token for EKS cluster ``cluster_name`` from ``session``'s AWS identity (a boto3
    Session), as ``aws eks get-token`` makes it: offline, nothing is sent to STS here."""
    sts = session.client("sts", region_name=session.region_name)  # the partition's regional endpoint

    def keep(params, context, **_):
        if K8S_AWS_ID_HEADER in params:
            context[K8S_AWS_ID_HEADER] = params.pop(K8S_AWS_ID_HEADER)

    def inject(request, **_):
        if K8S_AWS_ID_HEADER in request.context:
            request.headers[K8S_AWS_ID_HEADER] = request.context[K8S_AWS_ID_HEADER]

    sts.meta.events.register("provide-client-params.sts.GetCallerIdentity", keep)
    sts.meta.events.register("before-sign.sts.GetCallerIdentity", inject)
    url = sts.generate_presigned_url("get_caller_identity", Params={K8S_AWS_ID_HEADER: cluster_name},
                                     ExpiresIn=TOKEN_EXPIRES_S, HttpMethod="GET")
    return TOKEN_PREFIX + base64.urlsafe_b64encode(url.encode()).decode().rstrip("=")


def from_eks(cluster_name: str, *, session, identity: str) -> Cluster:
    """The cluster's API server (``eks:DescribeCluster``) with a token of ``session``'s identity."""
    from kubernetes import client

    cluster = session.client("eks").describe_cluster(name=cluster_name)["cluster"]
    ca = tempfile.NamedTemporaryFile("wb", prefix="ray-train-eks-ca-", suffix=".pem", delete=False)
    with ca:
        ca.write(base64.b64decode(cluster["certificateAuthority"]["data"]))
    configuration = client.Configuration()
    configuration.host, configuration.ssl_ca_cert, configuration.retries = cluster["endpoint"], ca.name, retries()
    keepalive(configuration)
    made = [None]  # never 0.0: the monotonic clock starts near 0 at boot, and a young machine made no token

    def refresh(config) -> None:
        if made[0] is None or time.monotonic() - made[0] > TOKEN_REFRESH_S:
            config.api_key["BearerToken"] = "Bearer " + eks_token(cluster_name, session=session)
            made[0] = time.monotonic()

    refresh(configuration)
    configuration.refresh_api_key_hook = refresh
    return Cluster(client.ApiClient(configuration), cluster["endpoint"],
                   Access(identity=identity, cluster_name=cluster_name))


def from_kubeconfig(path: str | None = None, context: str | None = None) -> Cluster:
    """The kubeconfig's context (its current one unless named), as kubectl reads it: ``path``, or
    every file of ``KUBECONFIG``, or ``~/.kube/config``."""
    from kubernetes import client, config
    from kubernetes.config.config_exception import ConfigException
    from kubernetes.config.kube_config import ENV_KUBECONFIG_PATH_SEPARATOR, KubeConfigMerger

    files = path or os.environ.get("KUBECONFIG") or os.path.expanduser("~/.kube/config")
    existing = [f for f in files.split(ENV_KUBECONFIG_PATH_SEPARATOR) if f and os.path.exists(os.path.expanduser(f))]
    if not existing:
        raise KubeError(f"no kubeconfig at {files}: give --kubeconfig PATH, or drop --kubeconfig and --context to reach the "
                        "stack's cluster with your AWS identity (aws eks update-kubeconfig --name CLUSTER writes one)")
    merged = KubeConfigMerger(ENV_KUBECONFIG_PATH_SEPARATOR.join(existing)).config
    if merged is None:
        raise KubeError(f"kubeconfig {files} holds no configuration")
    plain = {key: [getattr(item, "value", item) for item in value] if isinstance(value, list) else value
             for key, value in merged.value.items()}  # the merger's entries are ConfigNodes
    contexts = [c["name"] for c in plain.get("contexts") or []]
    name = context or plain.get("current-context")
    if name not in contexts:
        raise KubeError(f"kubeconfig {files}: no context {name!r}; its contexts: {', '.join(contexts) or 'none'} (--context "
                        "NAME picks one)")
    _check_exec_plugin(plain, name)
    configuration = client.Configuration()
    with _plugin_failures() as failures:
        try:
            config.load_kube_config(config_file=ENV_KUBECONFIG_PATH_SEPARATOR.join(existing), context=name,
                                    client_configuration=configuration, persist_config=False)
        except ConfigException as error:
            raise KubeError(f"kubeconfig {files}, context {name!r}: {error}") from None
    if failures:  # the client logs a failed plugin and goes on without credentials
        raise KubeError(f"kubeconfig context {name!r}: its exec plugin failed: {failures[-1][:500]}")
    configuration.retries = retries()
    keepalive(configuration)
    return Cluster(client.ApiClient(configuration), configuration.host, Access(kubeconfig_context=name))


def _check_exec_plugin(kubeconfig: dict, context: str) -> None:
    chosen = next(c["context"] for c in kubeconfig.get("contexts") or [] if c["name"] == context)
    user = next((u.get("user") or {} for u in kubeconfig.get("users") or [] if u["name"] == chosen.get("user")), {})
    plugin = (user or {}).get("exec")
    if plugin and not shutil.which(plugin.get("command", "")):
        hint = " (install the AWS CLI v2: aws eks get-token is its command)" if plugin.get("command") == "aws" else ""
        raise KubeError(f"kubeconfig context {context!r} runs {plugin.get('command')!r} for its credentials, which is not "
                        f"installed or not on PATH{hint}; or drop --kubeconfig to use your AWS identity directly")


@contextmanager
def _plugin_failures() -> Iterator[list[str]]:
    """What ``kubernetes.config`` logs (and swallows) when an exec plugin fails."""
    failures: list[str] = []

    class Catch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            failures.append(record.getMessage())

    handler, root = Catch(logging.ERROR), logging.getLogger()
    root.addHandler(handler)
    try:
        yield failures
    finally:
        root.removeHandler(handler)
