"""The shape of Ray 2.58's ``OpenAiIngress`` routes (ray/llm/_internal/serve/core/ingress/ingress.py,
whose module imports vLLM): their signatures with real types, as that module has them (no
``from __future__ import annotations`` there, nor here: FastAPI reads these annotations)."""

from fastapi import Request
from pydantic import BaseModel


class ChatCompletionRequest(BaseModel):
    model: str


class OpenAiIngress:
    def __init__(self, llm_deployments, model_cards=None):
        pass

    async def models(self) -> dict:
        return {"data": [{"id": "m"}]}

    async def model_data(self, model: str) -> dict:
        return {"id": model}

    async def chat(self, body: ChatCompletionRequest, request: Request):
        return {"answered": body.model}
