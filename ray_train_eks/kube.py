"""The few Kubernetes API calls ``ray-train-eks`` makes, and the credentials they carry, with no
client library: the API server and a bearer token, from the user's kubeconfig or from their AWS
identity (what ``aws eks get-token`` does).

- **AWS identity**: the cluster's endpoint and CA from ``eks:DescribeCluster``, and a token that is
  a presigned STS ``GetCallerIdentity`` URL carrying the cluster's name in the signed header
  ``x-k8s-aws-id``, base64url-encoded after ``k8s-aws-v1.``: awscli's
  ``awscli/customizations/eks/get_token.py`` (``TokenGenerator``, ``STSClientFactory``: 60 s).
  EKS answers it with the IAM identity, mapped by an access entry.
- **kubeconfig**: the current (or named) context's server and CA, and its user's token, or the
  token its ``exec`` plugin prints (an ``ExecCredential``: ``aws eks get-token`` itself, say).
"""

from __future__ import annotations

import base64
import json
import os
import ssl
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass

import yaml

#: awscli's constants (customizations/eks/get_token.py).
TOKEN_PREFIX = "k8s-aws-v1."
K8S_AWS_ID_HEADER = "x-k8s-aws-id"
TOKEN_EXPIRES_S = 60


class KubeError(RuntimeError):
    """The API server refused a call: the HTTP status, its reason, and what to do about it."""

    def __init__(self, method: str, path: str, code: int, status: dict, hint: str = "") -> None:
        message = status.get("message") or status.get("reason") or "no message"
        super().__init__(f"{method} {path}: HTTP {code} {message}" + (f"; {hint}" if hint else ""))
        self.code, self.status = code, status


@dataclass
class Connection:
    """An API server and how to reach it."""

    server: str
    token: str | None = None
    #: PEM of the CA that signed the server's certificate (None: the system's, or plain http).
    ca_pem: str | None = None
    #: What a 401 or 403 means here, said with the error (which identity, which access entry).
    identity_hint: str = ""

    def _context(self) -> ssl.SSLContext | None:
        if not self.server.startswith("https://"):
            return None
        context = ssl.create_default_context()
        if self.ca_pem:
            context.load_verify_locations(cadata=self.ca_pem)
        return context

    def call(self, method: str, path: str, body: dict | None = None, *, query: dict | None = None,
             content_type: str = "application/json", raw: bool = False, timeout: float = 30):
        """One request; the decoded JSON reply (``raw``: the response object, for a stream)."""
        url = self.server.rstrip("/") + path + (f"?{urllib.parse.urlencode(query)}" if query else "")
        headers = {"Accept": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        data = None
        if body is not None:
            data, headers["Content-Type"] = json.dumps(body).encode(), content_type
        request = urllib.request.Request(url, data=data, method=method, headers=headers)
        try:
            response = urllib.request.urlopen(request, timeout=timeout, context=self._context())
        except urllib.error.HTTPError as error:
            try:
                status = json.loads(error.read() or b"{}")
            except ValueError:
                status = {}
            hint = self.identity_hint if error.code in (401, 403) else ""
            raise KubeError(method, path, error.code, status, hint) from None
        if raw:
            return response
        with response:
            return json.loads(response.read() or b"{}")


def eks_token(cluster_name: str, *, session) -> str:
    """A bearer token for EKS cluster ``cluster_name`` from ``session``'s AWS identity (a boto3
    Session), as ``aws eks get-token`` makes it: offline, nothing is sent to STS here."""
    sts = session.client("sts", region_name=session.region_name,
                         endpoint_url=f"https://sts.{session.region_name}.amazonaws.com")

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


def from_eks(cluster_name: str, *, session, admin_setting: str = "") -> Connection:
    """The cluster's API server with a token of ``session``'s identity (``eks:DescribeCluster``)."""
    cluster = session.client("eks").describe_cluster(name=cluster_name)["cluster"]
    identity = session.client("sts").get_caller_identity()["Arn"]
    hint = (f"the cluster does not let {identity} in: add an EKS access entry for it with the "
            f"AmazonEKSClusterAdminPolicy (aws eks create-access-entry --cluster-name {cluster_name} --principal-arn "
            f"<its role ARN>, then aws eks associate-access-policy), or deploy the stack with {admin_setting}")
    return Connection(server=cluster["endpoint"], token=eks_token(cluster_name, session=session),
                      ca_pem=base64.b64decode(cluster["certificateAuthority"]["data"]).decode(), identity_hint=hint)


def from_kubeconfig(path: str | None = None, context: str | None = None) -> Connection:
    """The kubeconfig's context (its current one unless named): server, CA and the user's token
    (or what its ``exec`` plugin prints)."""
    path = path or os.environ.get("KUBECONFIG", "").split(os.pathsep)[0] or os.path.expanduser("~/.kube/config")
    with open(path) as handle:
        config = yaml.safe_load(handle)
    name = context or config.get("current-context")
    contexts = {c["name"]: c["context"] for c in config.get("contexts") or []}
    if name not in contexts:
        raise ValueError(f"kubeconfig {path}: no context {name!r}; its contexts: {', '.join(contexts) or 'none'}")
    chosen = contexts[name]
    cluster = {c["name"]: c["cluster"] for c in config.get("clusters") or []}[chosen["cluster"]]
    user = {u["name"]: u["user"] for u in config.get("users") or []}.get(chosen.get("user"), {}) or {}
    ca = cluster.get("certificate-authority-data")
    ca_pem = base64.b64decode(ca).decode() if ca else None
    if not ca_pem and cluster.get("certificate-authority"):
        with open(cluster["certificate-authority"]) as handle:
            ca_pem = handle.read()
    token = user.get("token")
    if not token and user.get("exec"):
        token = _exec_token(user["exec"])
    hint = f"the identity of kubeconfig context {name!r} may not do this here; ask the cluster's admin for access"
    return Connection(server=cluster["server"], token=token, ca_pem=ca_pem, identity_hint=hint)


def _exec_token(plugin: dict) -> str:
    """The token a kubeconfig ``exec`` plugin prints (client.authentication.k8s.io ExecCredential)."""
    env = {**os.environ, **{e["name"]: e["value"] for e in plugin.get("env") or []}}
    result = subprocess.run([plugin["command"], *(plugin.get("args") or [])], capture_output=True, text=True, env=env,
                            timeout=60)
    if result.returncode != 0:
        raise RuntimeError(f"kubeconfig exec plugin {plugin['command']!r} failed: {result.stderr.strip()[:500]}")
    return json.loads(result.stdout)["status"]["token"]
