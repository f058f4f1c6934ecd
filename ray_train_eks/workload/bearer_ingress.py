"""Ray Serve LLM's OpenAI ingress with a bearer key: what a service reached through an internal load
balancer (``ray-train-eks serve --internal-lb``) runs, since Serve's HTTP proxy authenticates
nothing (ray-project/ray#59578, whose maintainers suggest this: a custom ``ingress_cls``; vLLM's
``VLLM_API_KEY`` has no effect under Serve, ray#55369).

This file is shipped to the service, not imported by ray-train-eks: ``ray-train-eks serve`` zips it
as the package ``ray_train_eks_serving`` (module ``ingress``) into the bucket and names it in the
application's ``runtime_env.py_modules``; the Serve LLM image imports it where the app is built (the
head) and where the ingress runs. It compares the SHA-256 of the presented key with the one in the
service's configuration (the key itself is never stored: the command prints it once).

Ray 2.58 builds the ingress's FastAPI routes from the class's methods by name
(ray/llm/_internal/serve/core/ingress/ingress.py ``make_fastapi_ingress``, ``DEFAULT_ENDPOINTS``),
so overriding each route's method, with the request added to its signature, puts the check in
front of every route. The proxy's own ``/-/healthz`` (what KubeRay probes) is not an app route and
stays open. Two things FastAPI and Ray's class-based view need of an override: annotations FastAPI
can resolve (no ``from __future__ import annotations`` here: ``Request`` must be a type, not a
string it looks up in this module), and a ``__qualname__`` under the class (Ray turns a route into
a method only then: ray/serve/_private/http_util.py ``make_fastapi_class_based_view``).
"""

import hashlib
import hmac

try:  # the service's image has FastAPI; the package that ships this file need not
    from fastapi import HTTPException, Request
except ImportError:  # pragma: no cover - only where this file is read, not run
    HTTPException = Request = None

#: The module's name where the service imports it, and the class the configuration names.
PACKAGE, CLASS = "ray_train_eks_serving", "BearerKeyIngress"
#: Ray 2.58's routes of the OpenAI ingress that take a body (``DEFAULT_ENDPOINTS`` less ``models`` and
#: ``model_data``, which take none and are overridden on their own below).
BODY_ROUTES = ("completions", "chat", "embeddings", "transcriptions", "score", "tokenize", "detokenize")


def key_matches(authorization, key_sha256: str) -> bool:
    """Whether an ``Authorization: Bearer <key>`` header carries the key whose SHA-256 is ``key_sha256``
    (compared in constant time)."""
    if not authorization or not authorization.startswith("Bearer "):
        return False
    presented = hashlib.sha256(authorization.removeprefix("Bearer ").strip().encode()).hexdigest()
    return hmac.compare_digest(presented, key_sha256)


def bearer_ingress(base):
    """The subclass of ``base`` (Ray's ``OpenAiIngress``) that refuses a request without the key
    (HTTP 401) before the route runs."""
    import inspect

    class BearerKeyIngress(base):
        def __init__(self, *args, key_sha256: str, **kwargs):
            super().__init__(*args, **kwargs)
            self._key_sha256 = key_sha256

        def _check(self, request: Request) -> None:
            if not key_matches(request.headers.get("authorization"), self._key_sha256):
                raise HTTPException(status_code=401, detail="a bearer key is required: Authorization: Bearer <key>")

        async def models(self, request: Request):
            self._check(request)
            return await super().models()

        async def model_data(self, model: str, request: Request):
            self._check(request)
            return await super().model_data(model)

    def checked(name: str):
        original = getattr(base, name)

        async def route(self, body, request: Request):
            self._check(request)
            return await original(self, body, request)

        # FastAPI parses the body by the base's annotation (its request model).
        route.__signature__ = inspect.signature(original)
        route.__annotations__ = dict(getattr(original, "__annotations__", {}))
        route.__name__ = name
        route.__qualname__ = f"{BearerKeyIngress.__qualname__}.{name}"
        return route

    for name in BODY_ROUTES:
        if hasattr(base, name):
            setattr(BearerKeyIngress, name, checked(name))
    return BearerKeyIngress


def __getattr__(name: str):
    """``BearerKeyIngress`` on first use (it needs Ray Serve LLM, and so vLLM, which only the service has)."""
    if name == CLASS:
        from ray.llm._internal.serve.core.ingress.ingress import OpenAiIngress

        cls = bearer_ingress(OpenAiIngress)
        globals()[CLASS] = cls
        return cls
    raise AttributeError(name)
