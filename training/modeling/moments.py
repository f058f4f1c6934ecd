"""The memory plan's model of one GPU: the training options it depends on (:class:`Options`), the
moments of a step with the tensors alive in each (:func:`plan`) and the :class:`Plan` they make.
:mod:`.plan` says what each term is, and chooses and checks configurations with it; every name here
is importable from there too. Standard library only (the CDK app imports it)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .shapes import ModelShape, numel, sharded_numel

GIB = 2**30
#: The GPU memory ``nvidia-smi`` reports (memory.total, MiB) per model: the NVIDIA data sheets'
#: 24/24/40/80/141 GB less what the driver keeps.
GPU_MEMORY_MIB = {"L4": 23034, "A10G": 23028, "A100": 40960, "H100": 81559, "H200": 143771}
CONTEXT_ALLOWANCE = int(1.5 * GIB)
FRAGMENTATION_MARGIN = 0.05
#: Where a DPO run's reference log-probs come from (:attr:`Options.reference`): LoRA's base is the
#: reference, the adapters switched off (PEFT's ``disable_adapter``) in a no-grad forward of each
#: micro-batch before the policy's; a full fine-tune's are computed in one no-grad pass over the
#: data before training (before AdamW's state exists) and kept, a few bytes a pair; SimPO and SFT
#: need none.
REFERENCES = {"lora": "adapters off (no copy)", "full": "precomputed before training", "none": "none"}


@dataclass(frozen=True)
class Options:
    """The training options the plan depends on (training/config.py's names)."""

    num_workers: int
    workers_per_node: int
    shard_size: int
    micro_batch_size: int
    seq_len: int
    activation_checkpointing: bool = True
    mixed_precision: str = "bf16"
    loss_chunk_tokens: int = 1024
    #: Sequences per optimizer step over all workers; with ``num_workers x micro_batch_size`` it
    #: says whether gradients accumulate over micro-steps. None: unknown, counted as accumulating.
    global_batch_size: int | None = None
    #: LoRA (``--peft lora``): the adapters' rank (0: a full fine-tune), targets and dropout.
    lora_rank: int = 0
    lora_targets: str = "all-linear"
    lora_dropout: float = 0.0
    #: ``--objective sft|dpo`` and ``--dpo-loss sigmoid|ipo|simpo``: what the reference costs.
    objective: str = "sft"
    dpo_loss: str = "sigmoid"

    @property
    def lora(self) -> bool:
        return self.lora_rank > 0

    @property
    def reference(self) -> str:
        """Where the reference log-probs come from (:data:`REFERENCES`)."""
        if self.objective != "dpo" or self.dpo_loss == "simpo":
            return REFERENCES["none"]
        return REFERENCES["lora" if self.lora else "full"]

    @property
    def accumulating(self) -> bool:
        """More than one micro-step per optimizer step (or not known)."""
        return self.global_batch_size is None or self.global_batch_size > self.num_workers * self.micro_batch_size

    @classmethod
    def of(cls, config) -> "Options":
        """From a TrainConfig (or anything with its fields and ``shard_size``); what it leaves to
        the plan (None) as without a plan (``TrainConfig.with_defaults``)."""
        config = config.with_defaults()
        return cls(num_workers=config.num_workers, workers_per_node=config.workers_per_node, shard_size=config.shard_size,
                   micro_batch_size=config.micro_batch_size, seq_len=config.seq_len,
                   activation_checkpointing=config.activation_checkpointing, mixed_precision=config.mixed_precision,
                   loss_chunk_tokens=config.loss_chunk_tokens, global_batch_size=config.global_batch_size,
                   objective=getattr(config, "objective", "sft"), dpo_loss=getattr(config, "dpo_loss", "sigmoid"),
                   **({"lora_rank": config.lora_rank, "lora_targets": config.lora_target_modules,
                       "lora_dropout": config.lora_dropout} if getattr(config, "peft", "none") == "lora" else {}))


@dataclass(frozen=True)
class Plan:
    """Bytes per GPU, term by term, and whether they fit."""

    model: ModelShape
    gpu: str
    options: Options
    #: The peak moment's tensors.
    terms: dict[str, int]
    peak: int
    capacity: int
    #: Every moment's tensors, by moment (:data:`MOMENTS`).
    moments: dict[str, dict[str, int]] = field(default_factory=dict)
    peak_moment: str = ""
    #: Bytes of a checkpoint's tensors (the trained parameters and their AdamW state, fp32), and of a
    #: full fine-tune's of the same model.
    checkpoint_bytes: int = 0
    full_checkpoint_bytes: int = 0

    @property
    def needed(self) -> int:
        """The peak with the fragmentation margin."""
        return int(self.peak * (1 + FRAGMENTATION_MARGIN))

    @property
    def fits(self) -> bool:
        return self.needed <= self.capacity

    @property
    def headroom(self) -> int:
        return self.capacity - self.needed

    def table(self) -> str:
        """The plan as the job log and ``python -m training.modeling.plan`` print it."""
        o = self.options
        layout = (f"HSDP shard {o.shard_size} x replicate {o.num_workers // o.shard_size}" if o.shard_size < o.num_workers
                  else f"FSDP over {o.num_workers}")
        lines = [f"memory plan: {self.model.name} ({self.model.parameters / 1e9:.2f} B parameters) on {o.num_workers} x "
                 f"{self.gpu} ({self.capacity / GIB:.1f} GiB each), {layout}, micro-batch {o.micro_batch_size} x "
                 f"{o.seq_len}, activation checkpointing {'on' if o.activation_checkpointing else 'off'}, "
                 f"{o.mixed_precision}, loss chunk {o.loss_chunk_tokens}"
                 + (f", DPO ({o.dpo_loss}), reference: {o.reference}" if o.objective == "dpo" else "")]
        for moment, terms in self.moments.items():
            lines.append(f"  {moment + (' (the peak)' if moment == self.peak_moment else ''):<52} "
                         f"{sum(terms.values()) / GIB:8.2f} GiB")
        lines.append(f"  the peak, {self.peak_moment}:")
        for name, value in self.terms.items():
            lines.append(f"    {name:<50} {value / GIB:8.2f} GiB")
        if o.lora:
            lines.append(f"  LoRA rank {o.lora_rank} on {o.lora_targets}: a checkpoint holds {self.checkpoint_bytes / GIB:.3f} GiB "
                         f"of adapters and AdamW state ({100 * self.checkpoint_bytes / self.full_checkpoint_bytes:.1f}% of a "
                         f"full fine-tune's {self.full_checkpoint_bytes / GIB:.1f} GiB)")
        lines.append(f"  {'peak (+5% fragmentation)':<52} {self.needed / GIB:8.2f} GiB of {self.capacity / GIB:.2f}: "
                     + (f"fits, {self.headroom / GIB:.2f} GiB headroom" if self.fits
                        else f"does NOT fit, {-self.headroom / GIB:.2f} GiB short"))
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {"model": self.model.name, "gpu": self.gpu, "terms_gib": {k: round(v / GIB, 3) for k, v in self.terms.items()},
                "peak_moment": self.peak_moment,
                "moments_gib": {name: round(sum(t.values()) / GIB, 3) for name, t in self.moments.items()},
                "peak_gib": round(self.needed / GIB, 3), "capacity_gib": round(self.capacity / GIB, 3), "fits": self.fits,
                "objective": self.options.objective, "reference": self.reference}

    @property
    def reference(self) -> str:
        """Where a DPO run's reference log-probs come from ('none' for SFT and SimPO)."""
        return self.options.reference


@dataclass(frozen=True)
class _Trained:
    """What trains, and what that holds: every parameter of a full fine-tune; under LoRA the
    adapters of each layer, the base frozen in the compute dtype (training/modeling/lora.py) with no
    gradient and no state."""

    held: dict[str, int]
    trained: int  # sharded elements trained on one GPU
    trained_layer: int  # unsharded elements trained in one layer
    adapters: list
    extra_per_token: int  # activation bytes per token and layer the adapters add
    root_trained: int
    load_bytes: int  # bytes per element of the tensors the load sends


def _what_trains(m: ModelShape, o: Options, cb: int, local: int) -> _Trained:
    if not o.lora:
        return _Trained(held={"parameters (sharded, fp32)": 4 * local, "optimizer (AdamW, fp32)": 8 * local},
                        trained=local, trained_layer=numel(m.layer_parameter_shapes()), adapters=[], extra_per_token=0,
                        root_trained=numel(m.root_parameter_shapes()), load_bytes=4)
    adapters = m.adapter_shapes(o.lora_rank, o.lora_targets)
    trained = m.layers * sharded_numel(adapters, o.shard_size)
    # Each adapter saves its A's output (rank x compute bytes per token) for B's backward; with
    # dropout, each its own mask (1 byte) and dropped input per token of its input width.
    extra = sum(o.lora_rank * cb + ((cb + 1) * inp if o.lora_dropout > 0 else 0)
                for _, inp in m.lora_targets(o.lora_targets).values())
    return _Trained(held={f"base (sharded, frozen, {'bf16' if cb == 2 else 'fp32'})": cb * local,
                          "adapters (sharded, fp32)": 4 * trained, "optimizer (AdamW, fp32, adapters)": 8 * trained},
                    trained=trained, trained_layer=numel(adapters), adapters=adapters, extra_per_token=extra,
                    root_trained=0, load_bytes=cb)


def _loss_terms(logits_chunk: int, head_gradient: int) -> dict[str, int]:
    """The loss's largest: a chunk of logits with the head's gradient, or (large hidden sizes) the
    first two chunks' head gradients and their out-of-place sum; a frozen head (LoRA) has none."""
    if not logits_chunk:  # a layer's backward: the head's gradient alone, if it has one
        return {"head gradient (unsharded)": head_gradient} if head_gradient else {}
    if 3 * head_gradient > logits_chunk + head_gradient:
        return {"head gradient, its first two chunks summed out of place (3 x unsharded)": 3 * head_gradient}
    if head_gradient:
        return {"logits chunk (bf16, fp32, gradients)": logits_chunk, "head gradient (unsharded)": head_gradient}
    return {"logits chunk (bf16, fp32, gradients)": logits_chunk}


@dataclass(frozen=True)
class _Sizes:
    """What every moment is made of, in bytes (per GPU unless said)."""

    held: dict[str, int]  # the states: parameters (or the frozen base and adapters) and AdamW's
    trains: _Trained
    cb: int  # bytes of a compute-dtype element
    tokens: int  # tokens per micro-batch
    layer_numel: int  # one decoder layer's elements, unsharded (with its adapters)
    root_numel: int
    per_layer_token: int  # activation bytes per token of one layer, as autograd saves them
    saved_per_layer: int  # bytes each layer keeps from its forward to its backward
    head_gradient: int
    logits_chunk_entries: int  # tokens x vocabulary of one chunk of the loss
    hidden: int
    intermediate: int


def _sizes(m: ModelShape, o: Options) -> _Sizes:
    layer, root = m.layer_parameter_shapes(), m.root_parameter_shapes()
    local = m.layers * sharded_numel(layer, o.shard_size) + sharded_numel(root, o.shard_size)
    cb = 2 if o.mixed_precision == "bf16" else 4
    tokens = o.micro_batch_size * o.seq_len
    h, q, kv, inter, a = m.hidden, m.heads * m.dim, m.kv_heads * m.dim, m.intermediate, m.heads
    trains = _what_trains(m, o, cb, local)
    per_layer_token = (16 * h + 4 * q + 4 * kv + 8 * inter + 4 * a) * cb // 2 + trains.extra_per_token
    return _Sizes(held=trains.held, trains=trains, cb=cb, tokens=tokens, layer_numel=numel(layer) + numel(trains.adapters),
                  root_numel=numel(root), per_layer_token=per_layer_token,
                  saved_per_layer=tokens * (h * cb if o.activation_checkpointing else per_layer_token),
                  head_gradient=cb * m.vocab * h if not o.lora else 0, logits_chunk_entries=min(o.loss_chunk_tokens, tokens) * m.vocab,
                  hidden=h, intermediate=inter)


def _forward_transients(s: _Sizes, o: Options) -> int:
    """Bytes per token a layer's forward holds beyond what it saves, at its MLP (its largest):
    the normed input, act(gate), up and their product (the gate itself freed after its
    activation); with checkpointing nothing is saved so these are the layer's own, without it
    they are saved (counted in the saved activations). Under LoRA each adapted linear's output is
    made out of place beside the base's (PEFT: ``result + lora_B(lora_A(x)) * scaling``): the
    adapter's output and its scaled copy, at the widest (the MLP's intermediate)."""
    if not o.activation_checkpointing:
        return 0
    return s.cb * (2 * s.hidden + 3 * s.intermediate + (2 * s.intermediate if o.lora else 0))


def _forward_moments(s: _Sizes, o: Options, m: ModelShape, gradients, root_gathered, context) -> dict[str, dict[str, int]]:
    """The forward's two largest: a layer's (the last: every earlier layer's activations saved) and
    the loss's (the last chunk's logits, which the chunk's checkpoint frees after its forward:
    bf16, their fp32 copy and the fp32 log-softmax)."""
    common = {**s.held, **gradients(0), **root_gathered}
    return {
        "last layer's forward": {**common, "saved activations": m.layers * s.saved_per_layer,
                                 "layer's forward transients (not saved)": s.tokens * _forward_transients(s, o),
                                 "gathered layers": min(2, m.layers) * s.cb * s.layer_numel, **context},
        "loss forward": {**common, "last layer (kept gathered after the forward)": s.cb * s.layer_numel,
                         "saved activations": m.layers * s.saved_per_layer,
                         "hidden states (bf16, fp32 norm input, the trained rows)": s.tokens * s.hidden * (2 * s.cb + 4),
                         "logits chunk (bf16, fp32, log-softmax; no gradient yet)": s.logits_chunk_entries * (s.cb + 8),
                         **context},
    }


def _reference_moments(s: _Sizes, o: Options, m: ModelShape, gradients, root_gathered, context) -> dict[str, dict[str, int]]:
    """DPO's reference forward, no gradient (:attr:`Options.reference`). LoRA: before each micro-batch's
    policy forward, the adapters off, with the states and the gradients accumulated so far; a full
    fine-tune: one pass before training, the fp32 parameters alone (no gradient, no AdamW state yet).
    It holds a layer gathered with its all-gather buffer (kept for the next copy-in; the root through
    the loss) and one layer's activations at a time (at its MLP: the layer's input, its normed copy,
    the residual, its output, act(gate), up and their product: 4h + 3I a token), or at the loss the
    hidden states and one chunk's logits with their log-softmax: the larger of the two."""
    if o.reference == REFERENCES["none"]:
        return {}
    largest = max(s.tokens * s.cb * (4 * s.hidden + 3 * s.intermediate),
                  s.tokens * s.hidden * 2 * s.cb + s.logits_chunk_entries * (s.cb + 8))
    transient = {"gathered layers": min(2, m.layers) * s.cb * s.layer_numel,
                 "a layer's activations or the loss chunk (no gradient)": largest, **context}
    if o.lora:
        return {"reference forward (adapters off)": {**s.held, **gradients(0), **root_gathered, **transient}}
    parameters = {name: value for name, value in s.held.items() if not name.startswith("optimizer")}
    return {"reference pass (before training)": {**parameters, **root_gathered, **transient}}


def plan(model: ModelShape, gpu: str, options: Options) -> Plan:
    """The memory plan of ``model`` trained with ``options`` on GPUs of model ``gpu``: each moment
    with the tensors alive in it (:data:`MOMENTS`); the peak is the largest."""
    if gpu not in GPU_MEMORY_MIB:
        raise ValueError(f"gpu type {gpu!r} is unknown to the memory plan; use one of {', '.join(GPU_MEMORY_MIB)}")
    o, m = options, model
    s = _sizes(m, o)
    trains, context, held, cb, tokens, h = s.trains, {"CUDA context, cuBLAS, NCCL": CONTEXT_ALLOWANCE}, s.held, s.cb, s.tokens, s.hidden
    layer_local = 4 * sharded_numel(trains.adapters if o.lora else m.layer_parameter_shapes(), o.shard_size)

    def gradients(layers_reduced: int) -> dict[str, int]:
        # Accumulating, the earlier micro-steps' gradients (with HSDP, FSDP2's partial_reduce_output
        # in their place: the same bytes) are alive throughout; else zero_grad(set_to_none) freed
        # them, and only the layers whose reduce-scatter has run hold theirs.
        if o.accumulating:
            return {"gradients (sharded, fp32)": 4 * trains.trained}
        return {"gradients (sharded, fp32), layers reduced so far": layers_reduced * layer_local} if layers_reduced else {}

    recomputed = tokens * s.per_layer_token if o.activation_checkpointing else 0
    root_gathered, head = {"gathered root (embedding, norm, head)": cb * s.root_numel}, _loss_terms(0, s.head_gradient)
    loss = _loss_terms(s.logits_chunk_entries * 12, s.head_gradient)

    def layer_backward(layers_reduced: int, saved_layers: int, gathered_layers: int) -> dict[str, int]:
        # From the second layer on, the previous layer's fp32 reduce-scatter input is still in flight
        # while this one's backward runs (FSDP2 keeps one, reduce_scatter_max_input_buffers = 1,
        # torch 2.13 _fsdp_param_group.py post_backward; freed at this layer's own post-backward).
        in_flight = {"previous layer's reduce-scatter input (in flight)": 4 * trains.trained_layer} if layers_reduced else {}
        return {**held, **gradients(layers_reduced), **root_gathered, "saved activations": saved_layers * s.saved_per_layer,
                "recomputed layer": recomputed,
                "gradient flowing back, MLP transients": tokens * (8 * h + 4 * s.intermediate + 4 * h),
                "gathered layers": gathered_layers * cb * s.layer_numel, "layer gradient buffers": (cb + 4) * trains.trained_layer,
                **in_flight, **head, **context}

    largest = max(math.prod(shape) for shape in [*m.layer_parameter_shapes(), *m.root_parameter_shapes()])
    parameters = {name: value for name, value in held.items() if not name.startswith("optimizer")}
    moments = {
        "load": {**parameters, f"largest tensor, whole ({'fp32' if trains.load_bytes == 4 else 'bf16'}, being sent)":
                 trains.load_bytes * largest, **context},
        # The root's all-gather at the start of each micro-step's forward: FSDP2 gathers into one
        # flat buffer, then copies it out into the unsharded parameters (``foreach_all_gather_copy_out``:
        # ``split_with_sizes_copy``), so for a moment the root is there twice; and its buffer outlives
        # the copy-out until the next all-gather, the first layer's, has made its own buffer and copy
        # (``AllGatherState`` in torch 2.13 _fsdp_param_group.py: kept for the next copy-in).
        "forward": {**held, **gradients(0), **root_gathered,
                    "root's all-gather buffer (being copied out)": cb * s.root_numel,
                    "first layer's all-gather buffer and copy": 2 * cb * s.layer_numel, **context},
        **_reference_moments(s, o, m, gradients, root_gathered, context),
        **_forward_moments(s, o, m, gradients, root_gathered, context),
        "loss backward": {**held, **gradients(0), **root_gathered,
                          "last layer (kept gathered after the forward)": cb * s.layer_numel,
                          "saved activations": m.layers * s.saved_per_layer,
                          "hidden states (bf16, fp32 norm input and gradient)": tokens * h * 10, **loss, **context},
        "last layer's backward": layer_backward(0, m.layers, min(2, m.layers)),
        "next layer's backward": layer_backward(1, m.layers - 1, min(2, m.layers - 1)),
        "first layer's backward": layer_backward(m.layers - 1, 1, 1),
        # FSDP2 frees the gathered root at its post-backward, before the reduce-scatter. A frozen root
        # (LoRA) has no reduce-scatter and its gathered parameters are the moment's largest; and without
        # activation checkpointing the first layer's input (the frozen embedding's output) needs no
        # gradient, so no hook runs the first layer's post-backward: FSDP2's final callback does, with
        # the root's (torch 2.13 _fsdp_state.py ``_root_post_backward_final_callback``), the layer
        # still gathered (measured: tests/training/fake_step_memory.py; with checkpointing the
        # layer's recomputation runs it in its own backward).
        "root reduce": {**held, **gradients(m.layers), **context,
                        **({"root gradient buffers": (cb + 4) * trains.root_trained} if trains.root_trained else
                           {**root_gathered, **({"first layer's input gradient (fp32)": tokens * h * 4}
                                                if o.activation_checkpointing else
                                                {"first layer (gathered until the final callback)": cb * s.layer_numel})})},
        # Gradient clipping and AdamW (fused on a GPU: no temporaries of a tensor's size) on the states
        # and every trained parameter's sharded gradient.
        "optimizer step": {**held, "gradients (sharded, fp32)": 4 * trains.trained, **context},
    }
    totals = {name: sum(terms.values()) for name, terms in moments.items()}
    peak_moment = max(totals, key=totals.get)
    return Plan(model=m, gpu=gpu, options=o, terms=moments[peak_moment], peak=totals[peak_moment],
                capacity=GPU_MEMORY_MIB[gpu] * 2**20, moments=moments, peak_moment=peak_moment,
                checkpoint_bytes=12 * (m.layers * numel(trains.adapters) if o.lora else m.parameters),
                full_checkpoint_bytes=12 * m.parameters)
