"""Ray 2.58's own schemas of what a service serves, made strict: ``ServeDeploySchema`` and its
sub-schemas ignore unknown keys, and ``LLMConfig`` accepts any under ``deployment_config`` and
``engine_kwargs`` (ray/serve/schema.py, ray/llm/_internal/serve/core/configs/llm_config.py), so a
misspelled key would be dropped without a word on the cluster. Here every key must be a field of
the model it is in (through Optional, List and Union), ``deployment_config`` is read as Serve's
``DeploymentSchema``, ``build_openai_app``'s ``args`` as its ``LLMServingArgs`` (whose module imports
vLLM, so its fields are ported here from ray/llm/_internal/serve/core/ingress/builder.py), and
``engine_kwargs`` must be vLLM 0.26 engine arguments."""

from __future__ import annotations

import typing

from pydantic import BaseModel

#: ``LLMServingArgs`` and ``IngressClsConfig`` (ray/llm/_internal/serve/core/ingress/builder.py, Ray
#: 2.58: ``llm_configs``, ``ingress_cls_config``, ``ingress_deployment_config``; ``ingress_cls``,
#: ``ingress_extra_kwargs``; both extra="forbid").
SERVING_ARGS = {"llm_configs", "ingress_cls_config", "ingress_deployment_config"}
INGRESS_CLS_CONFIG = {"ingress_cls", "ingress_extra_kwargs"}
#: The vLLM 0.26 engine arguments the service may set (vllm/engine/arg_utils.py ``EngineArgs``:
#: tensor_parallel_size, enable_lora, max_lora_rank, max_loras, max_cpu_loras, generation_config,
#: revision, tokenizer_revision; vllm/entrypoints/openai/cli_args.py ``FrontendArgs``: chat_template).
VLLM_ENGINE_ARGS = {"tensor_parallel_size", "enable_lora", "max_lora_rank", "max_loras", "max_cpu_loras",
                    "generation_config", "revision", "tokenizer_revision", "chat_template"}


def _models(annotation) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [model for arg in typing.get_args(annotation) for model in _models(arg)]


def unknown_keys(cls: type[BaseModel], data, path: str = "", overrides: dict | None = None) -> list[str]:
    """Every key of ``data`` that is no field (or alias) of ``cls``, recursively, as ``a.b[0].c``."""
    overrides = overrides or {}
    found: list[str] = []
    names = set(cls.model_fields) | {f.alias for f in cls.model_fields.values() if f.alias}
    for key, value in (data or {}).items():
        where = f"{path}.{key}" if path else key
        if key not in names:
            found.append(where)
            continue
        sub = overrides.get((cls, key)) or next(iter(_models(cls.model_fields[key].annotation)), None)
        for index, item in enumerate(value if isinstance(value, list) else [value]):
            if sub is not None and isinstance(item, dict):
                found += unknown_keys(sub, item, f"{where}[{index}]" if isinstance(value, list) else where, overrides)
    return found


def serve_config_problems(config: dict) -> list[str]:
    """Why Ray 2.58 would refuse ``config`` (a serveConfigV2 dict), or silently drop part of it."""
    from ray.llm._internal.serve.core.configs.llm_config import LLMConfig
    from ray.serve.schema import DeploymentSchema, ServeDeploySchema

    problems = [f"unknown {key}" for key in unknown_keys(ServeDeploySchema, config)]
    ServeDeploySchema.model_validate(config)
    for app in config["applications"]:
        args = app.get("args") or {}
        problems += [f"unknown args.{key}" for key in set(args) - SERVING_ARGS]
        problems += [f"unknown ingress_cls_config.{key}" for key in set(args.get("ingress_cls_config") or {}) - INGRESS_CLS_CONFIG]
        problems += [f"unknown ingress_deployment_config.{key}" for key in unknown_keys(DeploymentSchema, {
            "name": "ingress", **(args.get("ingress_deployment_config") or {})})]
        for index, llm in enumerate(args.get("llm_configs") or []):
            LLMConfig.model_validate(llm)
            problems += [f"llm_configs[{index}]: unknown {key}" for key in unknown_keys(
                LLMConfig, llm, overrides={(LLMConfig, "deployment_config"): DeploymentSchema})]
            problems += [f"llm_configs[{index}]: engine_kwargs.{key} is no vLLM 0.26 engine argument the service sets"
                         for key in set(llm.get("engine_kwargs") or {}) - VLLM_ENGINE_ARGS]
    return problems
