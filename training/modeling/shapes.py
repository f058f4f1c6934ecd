"""The shapes of the models the memory plan (:mod:`.plan`) knows: a decoder's dimensions from its
``config.json``, and a table of well-known releases, so that ``cdk synth`` plans them without a
download. Standard library only: the CDK app imports it too.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class ModelShape:
    """The shape of a Qwen2/Llama/Mistral-style decoder, as its ``config.json`` gives it."""

    name: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    tied: bool
    attention_bias: bool
    head_dim: int | None = None
    #: Where the numbers come from.
    source: str = ""
    #: ``model_type`` in its config.json (the transformers family).
    family: str = ""
    #: RMSNorms per decoder layer: 2, or 4 in Gemma 2 and 3 (around attention and MLP both).
    layer_norms: int = 2
    #: RMSNorms on each head's q and k (Qwen3, Gemma 3): two of ``head_dim``.
    qk_norm: bool = False

    @classmethod
    def from_config(cls, config: dict, name: str = "", source: str = "config.json") -> "ModelShape":
        """From a Hugging Face ``config.json``; Qwen2 has biases on q, k and v (modeling_qwen2.py)."""
        model_type = config.get("model_type", "")
        missing = [k for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
                   if k not in config]
        if missing:
            raise ValueError(f"model {name or '?'}: config.json lacks {', '.join(missing)}; the memory plan knows "
                             "decoder-only models of the Qwen2, Llama and Mistral kind")
        return cls(
            name=name or config.get("_name_or_path", model_type), hidden=config["hidden_size"],
            intermediate=config["intermediate_size"], layers=config["num_hidden_layers"],
            heads=config["num_attention_heads"], kv_heads=config.get("num_key_value_heads") or config["num_attention_heads"],
            vocab=config["vocab_size"], tied=bool(config.get("tie_word_embeddings", False)),
            attention_bias=bool(config.get("attention_bias", model_type == "qwen2")),
            head_dim=config.get("head_dim"), source=source, family=model_type,
            layer_norms=FOUR_NORM_FAMILIES.get(model_type, 2), qk_norm=model_type in QK_NORM_FAMILIES,
        )

    @property
    def dim(self) -> int:
        return self.head_dim or self.hidden // self.heads

    def layer_parameter_shapes(self) -> list[tuple[int, ...]]:
        """One decoder layer's parameters (q, k, v, o, gate, up, down, its norms; Phi-3's fused
        qkv and gate-up projections hold the same elements)."""
        h, kv, q = self.hidden, self.kv_heads * self.dim, self.heads * self.dim
        shapes = [(q, h), (kv, h), (kv, h), (h, q), (self.intermediate, h), (self.intermediate, h), (h, self.intermediate)]
        shapes += [(h,)] * self.layer_norms + [(self.dim,)] * (2 if self.qk_norm else 0)
        if self.attention_bias:
            shapes += [(q,), (kv,), (kv,)]
        return shapes

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """One decoder layer's linear layers by module name, ``(out, in)``: the names LoRA targets
        (Phi-3 fuses q, k, v into ``qkv_proj`` and gate, up into ``gate_up_proj``)."""
        h, kv, q, inter = self.hidden, self.kv_heads * self.dim, self.heads * self.dim, self.intermediate
        if self.family == "phi3":
            return {"qkv_proj": (q + 2 * kv, h), "o_proj": (h, q), "gate_up_proj": (2 * inter, h), "down_proj": (h, inter)}
        return {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q), "gate_proj": (inter, h),
                "up_proj": (inter, h), "down_proj": (h, inter)}

    def lora_targets(self, targets: str) -> dict[str, tuple[int, int]]:
        """The linear layers ``--lora-target-modules`` names in one decoder layer (``all-linear``:
        every one); ValueError naming this model's when a name is not among them."""
        from ..config import ALL_LINEAR, lora_target_list  # the option's own parsing (standard library only)

        linears, names = self.linear_shapes(), lora_target_list(targets)
        if names == ALL_LINEAR:
            return linears
        unknown = [name for name in names if name not in linears]
        if unknown:
            raise ValueError(f"lora_target_modules={targets!r}: {', '.join(unknown)} is not a linear layer of "
                             f"{self.name or 'this model'}'s decoder layers; use all-linear or some of {', '.join(linears)}")
        return {name: linears[name] for name in names}

    def adapter_shapes(self, rank: int, targets: str) -> list[tuple[int, int]]:
        """One decoder layer's LoRA parameters: for each targeted linear ``(out, in)``, A ``(rank, in)``
        and B ``(out, rank)`` (PEFT's ``lora_A``, ``lora_B``)."""
        return [shape for out, inp in self.lora_targets(targets).values() for shape in ((rank, inp), (out, rank))]

    def root_parameter_shapes(self) -> list[tuple[int, ...]]:
        """The root's: the embedding, the final norm, and the head unless tied."""
        return [(self.vocab, self.hidden), (self.hidden,)] + ([] if self.tied else [(self.vocab, self.hidden)])

    @property
    def parameters(self) -> int:
        return self.layers * numel(self.layer_parameter_shapes()) + numel(self.root_parameter_shapes())


def numel(shapes) -> int:
    return sum(math.prod(shape) for shape in shapes)


def sharded_numel(shapes, shard: int) -> int:
    """Elements one rank holds of ``shapes`` sharded on dim 0 over ``shard`` ranks, dim 0
    padded to a multiple of ``shard`` (FSDP2)."""
    return sum(math.ceil(shape[0] / shard) * math.prod(shape[1:]) for shape in shapes)


#: Families whose decoder layers have four RMSNorms (modeling_gemma2.py, modeling_gemma3.py), and
#: those with a norm on each head's q and k (modeling_qwen3.py, modeling_gemma3.py).
FOUR_NORM_FAMILIES = {"gemma2": 4, "gemma3_text": 4}
QK_NORM_FAMILIES = {"qwen3", "gemma3_text"}


def _shape(family: str, name: str, hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, vocab: int,
           tied: bool, head_dim: int | None = None) -> ModelShape:
    return ModelShape(name, hidden, intermediate, layers, heads, kv_heads, vocab, tied, attention_bias=family == "qwen2",
                      head_dim=head_dim, source=f"https://huggingface.co/{name}/blob/main/config.json", family=family,
                      layer_norms=FOUR_NORM_FAMILIES.get(family, 2), qk_norm=family in QK_NORM_FAMILIES)


#: Well-known models' shapes, from each model's config.json on the Hugging Face Hub
#: (https://huggingface.co/<id>/blob/main/config.json): synth plans these without a download.
#: Each with the ids of its post-trained releases, which share the shape. Gemma 3 from 4B up is an
#: image-text model (Gemma3ForConditionalGeneration), which the training path does not take; its
#: 1B is text only.
_TABLE: list[tuple[ModelShape, tuple[str, ...]]] = [
    (_shape("qwen2", "Qwen/Qwen2.5-0.5B", 896, 4864, 24, 14, 2, 151936, True), ("Qwen/Qwen2.5-0.5B-Instruct",)),
    (_shape("qwen2", "Qwen/Qwen2.5-1.5B", 1536, 8960, 28, 12, 2, 151936, True), ("Qwen/Qwen2.5-1.5B-Instruct",)),
    (_shape("qwen2", "Qwen/Qwen2.5-3B", 2048, 11008, 36, 16, 2, 151936, True), ("Qwen/Qwen2.5-3B-Instruct",)),
    (_shape("qwen2", "Qwen/Qwen2.5-7B", 3584, 18944, 28, 28, 4, 152064, False), ("Qwen/Qwen2.5-7B-Instruct",)),
    (_shape("qwen2", "Qwen/Qwen2.5-14B", 5120, 13824, 48, 40, 8, 152064, False), ("Qwen/Qwen2.5-14B-Instruct",)),
    (_shape("qwen2", "Qwen/Qwen2.5-32B", 5120, 27648, 64, 40, 8, 152064, False), ("Qwen/Qwen2.5-32B-Instruct",)),
    (_shape("qwen2", "Qwen/Qwen2.5-72B", 8192, 29568, 80, 64, 8, 152064, False), ("Qwen/Qwen2.5-72B-Instruct",)),
    (_shape("qwen3", "Qwen/Qwen3-0.6B", 1024, 3072, 28, 16, 8, 151936, True, 128), ("Qwen/Qwen3-0.6B-Base",)),
    (_shape("qwen3", "Qwen/Qwen3-1.7B", 2048, 6144, 28, 16, 8, 151936, True, 128), ("Qwen/Qwen3-1.7B-Base",)),
    (_shape("qwen3", "Qwen/Qwen3-4B", 2560, 9728, 36, 32, 8, 151936, True, 128), ("Qwen/Qwen3-4B-Base",)),
    (_shape("qwen3", "Qwen/Qwen3-8B", 4096, 12288, 36, 32, 8, 151936, False, 128), ("Qwen/Qwen3-8B-Base",)),
    (_shape("qwen3", "Qwen/Qwen3-14B", 5120, 17408, 40, 40, 8, 151936, False, 128), ("Qwen/Qwen3-14B-Base",)),
    (_shape("qwen3", "Qwen/Qwen3-32B", 5120, 25600, 64, 64, 8, 151936, False, 128), ()),
    (_shape("llama", "meta-llama/Llama-3.2-1B", 2048, 8192, 16, 32, 8, 128256, True, 64), ("meta-llama/Llama-3.2-1B-Instruct",)),
    (_shape("llama", "meta-llama/Llama-3.2-3B", 3072, 8192, 28, 24, 8, 128256, True, 128), ("meta-llama/Llama-3.2-3B-Instruct",)),
    (_shape("llama", "meta-llama/Llama-3.1-8B", 4096, 14336, 32, 32, 8, 128256, False), ("meta-llama/Llama-3.1-8B-Instruct",)),
    (_shape("llama", "meta-llama/Llama-3.1-70B", 8192, 28672, 80, 64, 8, 128256, False, 128),
     ("meta-llama/Llama-3.1-70B-Instruct", "meta-llama/Llama-3.3-70B-Instruct")),
    (_shape("mistral", "mistralai/Mistral-7B-v0.3", 4096, 14336, 32, 32, 8, 32768, False), ("mistralai/Mistral-7B-Instruct-v0.3",)),
    (_shape("mistral", "mistralai/Mistral-Nemo-Base-2407", 5120, 14336, 40, 32, 8, 131072, False, 128),
     ("mistralai/Mistral-Nemo-Instruct-2407",)),
    (_shape("gemma2", "google/gemma-2-2b", 2304, 9216, 26, 8, 4, 256000, True, 256), ("google/gemma-2-2b-it",)),
    (_shape("gemma2", "google/gemma-2-9b", 3584, 14336, 42, 16, 8, 256000, True, 256), ("google/gemma-2-9b-it",)),
    (_shape("gemma2", "google/gemma-2-27b", 4608, 36864, 46, 32, 16, 256000, True, 128), ("google/gemma-2-27b-it",)),
    (_shape("gemma3_text", "google/gemma-3-1b-pt", 1152, 6912, 26, 4, 1, 262144, True, 256), ("google/gemma-3-1b-it",)),
    (_shape("phi3", "microsoft/Phi-3-mini-4k-instruct", 3072, 8192, 32, 32, 32, 32064, False),
     ("microsoft/Phi-3-mini-128k-instruct",)),
    (_shape("phi3", "microsoft/Phi-3-medium-4k-instruct", 5120, 17920, 40, 40, 10, 32064, False),
     ("microsoft/Phi-3-medium-128k-instruct",)),
]
#: The table's releases (the ``fit_table`` rows): one per shape.
TABLE_MODELS: dict[str, ModelShape] = {shape.name: shape for shape, _ in _TABLE}
#: Every id the plan knows without a download: the releases and their post-trained variants.
KNOWN_MODELS: dict[str, ModelShape] = {
    **TABLE_MODELS,
    **{variant: replace(shape, name=variant, source=f"https://huggingface.co/{variant}/blob/main/config.json")
       for shape, variants in _TABLE for variant in variants},
}


def model_shape(model: str, *, config_reader=None) -> ModelShape:
    """The shape of ``model``: from the table of well-known models, else from its
    ``config.json`` through ``config_reader(model)`` (a local folder, a Hub id); ValueError
    when neither knows it."""
    if model in KNOWN_MODELS:
        return KNOWN_MODELS[model]
    local = os.path.join(os.path.expanduser(model), "config.json")
    if os.path.isfile(local):
        with open(local) as handle:
            return ModelShape.from_config(json.load(handle), name=model, source=local)
    if config_reader is not None:
        return ModelShape.from_config(config_reader(model), name=model)
    raise ValueError(f"model {model!r}: not among the memory plan's {len(KNOWN_MODELS)} known models (docs/how-training-works.md, "
                     "\"The memory plan\") and no config.json at hand")
