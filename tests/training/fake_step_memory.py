"""One rank's memory through the project's own load and training step at a real model's shapes,
with no memory allocated: every tensor is a ``FakeTensor`` (``FakeTensorMode``) and every collective
goes to torch's fake process group, so only shapes, dtypes and lifetimes are real.

What runs is the product's code: ``load_sharded`` (the meta model, ``fully_shard``, the tensors
broadcast one at a time), activation checkpointing, ``train_step`` (the chunked loss, gradients
accumulated over micro-batches, HSDP's cross-node all-reduce on the last one), gradient clipping,
AdamW and ``zero_grad(set_to_none=True)``. The step is measured with AdamW's state already made, as
the training loop's calibration measures it (AdamW makes its state at its first step).

:class:`LiveBytes` counts the bytes of every tensor storage alive, moment by moment: a storage
enters when an operator returns it and leaves when Python frees it (a ``weakref.finalize`` on the
storage, whose Python object torch keeps for the storage's life) or FSDP2 resizes it
(``alloc_storage``/``free_storage`` in torch 2.13 ``_fsdp_param.py`` call ``UntypedStorage.resize_``,
which reaches no dispatch mode, so it is wrapped here).

Why not ``torch.distributed._tools.fsdp2_mem_tracker.FSDPMemTracker``, which the issue named: its
optimizer state comes out 16 times too large at these sizes. DTensor's sharding propagation builds
global-shape stand-ins of an operator's arguments in the active ``FakeTensorMode``
(``_sharding_prop.py`` ``_propagate_tensor_meta_non_cached``: ``detect_fake_mode() or
FakeTensorMode()``), its filter (``active_fake_mode() is self._fake_mode_on_entry``) lets them
through, and inside ``optimizer.step`` it files them as optimizer state. Here the propagation runs
with counting suspended (through ``ShardingPropagator._fake_mode_lock``, the hook torch gives it).

Where this differs from a GPU, and by how much:

- **flash-attn**: its kernel cannot run on a CPU, and the project's CPU kernel reads the segment
  bounds with ``tolist()``, which a fake tensor cannot. :class:`FlashStandIn` allocates what
  flash-attn 2's varlen call keeps and makes (``flash_api.cpp`` ``mha_varlen_fwd``/``mha_varlen_bwd``):
  it saves q, k, v, the output (bf16) and the log-sum-exp (fp32, heads x tokens); its backward makes
  dq, dk, dv, an fp32 ``dq_accum``, the fp32 ``softmax_d`` and, for grouped queries, dk and dv
  expanded to every query head before they are summed.
- **gradient accumulation inside autograd**: a fake tensor counts as a tensor subclass, so autograd
  sums two gradients of one tensor out of place (torch ``csrc/autograd/input_buffer.cpp``,
  ``can_accumulate_inplace``), where a GPU sums them in place. The extra is one tensor of the
  summed gradient's size for an instant (a tokens x hidden bf16 tensor in a layer, under 1% of a
  moment at these sizes); the head's gradient is summed out of place on a GPU too on its first
  accumulation (its first chunk's gradient is a transposed view), so there both agree.
- **collectives**: NCCL's reduce-scatter and all-gather make no copies of their own; the fake
  process group makes none either.
"""

from __future__ import annotations

import contextlib
import tempfile
import weakref
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten


class LiveBytes(TorchDispatchMode):
    """The bytes of the tensor storages alive, and the largest total of each labelled interval
    (``label(name)`` starts one; an interval's name may recur, its peak is the largest)."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}
        self.total = 0
        self.suspended = 0
        self.label_now = "start"
        self.peaks: dict[str, int] = {}

    # -- what is counted ------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self.suspended:
            for value in tree_flatten(out)[0]:
                if isinstance(value, torch.Tensor):
                    self._enter_tensor(value)
        return out

    def _enter_tensor(self, value: torch.Tensor) -> None:
        # A DTensor's wrapper reports its global size and holds no memory; its local tensor was
        # made by an operator that ran below this mode, so it is counted here, from the wrapper.
        if is_traceable_wrapper_subclass(value):
            for name in value.__tensor_flatten__()[0]:
                inner = getattr(value, name)
                if isinstance(inner, torch.Tensor):
                    self._enter_tensor(inner)
        elif value.device.type != "meta":
            self._enter(value.untyped_storage())

    def _enter(self, storage) -> None:
        key = storage._cdata
        if key in self.live:
            return
        self.live[key] = storage.nbytes()
        weakref.finalize(storage, self._leave, key)
        self._grew(self.live[key])

    def _leave(self, key: int) -> None:
        self.total -= self.live.pop(key, 0)

    def _resized(self, storage, before: int) -> None:
        key = storage._cdata
        if key not in self.live:
            if not self.suspended:
                self._enter(storage)
            return
        now = storage.nbytes()
        self.live[key] = now
        self._grew(now - before)

    def _grew(self, delta: int) -> None:
        self.total += delta
        if delta > 0 and self.total > self.peaks.get(self.label_now, 0):
            self.peaks[self.label_now] = self.total

    # -- intervals ------------------------------------------------------------------------------
    def label(self, name: str) -> None:
        self.label_now = name
        self.peaks[name] = max(self.peaks.get(name, 0), self.total)

    def suspend(self) -> "_Suspend":
        """A context in which nothing is counted."""
        return _Suspend(self)

    @contextlib.contextmanager
    def counting(self):
        """The mode entered, storage resizes and DTensor's sharding propagation hooked."""
        from torch.distributed.tensor._sharding_prop import ShardingPropagator

        tracker, resize = self, torch.UntypedStorage.resize_

        def resize_(storage, size):
            before = storage.nbytes()
            result = resize(storage, size)
            tracker._resized(storage, before)
            return result

        lock = ShardingPropagator._fake_mode_lock
        torch.UntypedStorage.resize_ = resize_
        ShardingPropagator._fake_mode_lock = self.suspend()
        try:
            with self:
                yield self
        finally:
            torch.UntypedStorage.resize_ = resize
            ShardingPropagator._fake_mode_lock = lock


class _Suspend:
    """A reusable context manager (``ShardingPropagator._fake_mode_lock`` is entered on every
    operator) that stops counting while it is held."""

    def __init__(self, tracker: LiveBytes) -> None:
        self.tracker = tracker

    def __enter__(self):
        self.tracker.suspended += 1

    def __exit__(self, *exc):
        self.tracker.suspended -= 1


class FlashStandIn(torch.autograd.Function):
    """flash-attn 2's varlen attention as memory sees it (shapes only; see the module's docstring)."""

    @staticmethod
    def forward(ctx, q, k, v):
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[1], q.shape[0], dtype=torch.float32, device=q.device)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        dq = torch.empty_like(q)
        dq_accum = torch.empty(q.shape, dtype=torch.float32, device=q.device)  # noqa: F841 (alive until the return)
        softmax_d = torch.empty_like(lse)  # noqa: F841
        heads, kv_heads = q.shape[1], k.shape[1]
        if heads != kv_heads:  # grouped queries: every query head's dk, dv, then summed per kv head
            expanded = (q.shape[0], kv_heads, heads // kv_heads, k.shape[2])
            dk = torch.empty(expanded, dtype=k.dtype, device=k.device).sum(2)
            dv = torch.empty(expanded, dtype=v.dtype, device=v.device).sum(2)
        else:
            dk, dv = torch.empty_like(k), torch.empty_like(v)
        return dq, dk, dv


def flash_stand_in(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **options):
    """``flash_attn_varlen_func``'s signature, :class:`FlashStandIn`'s memory."""
    return FlashStandIn.apply(q, k, v)


@dataclass(frozen=True)
class Case:
    """One configuration to measure: the model's real widths with ``layers`` decoder layers."""

    model: str
    layers: int
    num_workers: int
    shard_size: int
    micro_batch_size: int
    seq_len: int
    micro_steps: int
    activation_checkpointing: bool = True
    loss_chunk_tokens: int = 1024
    #: LoRA: the adapters' rank (0: a full fine-tune) and dropout, on every linear layer.
    lora_rank: int = 0
    lora_dropout: float = 0.0
    #: DPO: the product's preference step (training/modeling/preference.py), each packed sequence a pair;
    #: with LoRA (not SimPO) each micro-batch's policy forward follows a reference forward with the
    #: adapters off and no gradient (``reference_logps``, labelled by :func:`_reference_forwards`).
    objective: str = "sft"
    dpo_loss: str = "sigmoid"

    @property
    def lora_reference(self) -> bool:
        return self.objective == "dpo" and self.dpo_loss != "simpo" and self.lora_rank > 0

    def lora(self):
        from training.modeling.lora import LoraSettings

        return LoraSettings(rank=self.lora_rank, alpha=2.0 * self.lora_rank, dropout=self.lora_dropout) if self.lora_rank else None

    def shape(self):
        from training.modeling.shapes import KNOWN_MODELS

        return replace(KNOWN_MODELS[self.model], layers=self.layers)

    def options(self):
        from training.modeling.plan import Options

        return Options(num_workers=self.num_workers, workers_per_node=self.shard_size, shard_size=self.shard_size,
                       micro_batch_size=self.micro_batch_size, seq_len=self.seq_len,
                       activation_checkpointing=self.activation_checkpointing, loss_chunk_tokens=self.loss_chunk_tokens,
                       global_batch_size=self.num_workers * self.micro_batch_size * self.micro_steps,
                       lora_rank=self.lora_rank, lora_dropout=self.lora_dropout, objective=self.objective,
                       dpo_loss=self.dpo_loss)


def _write_config(shape, folder: str) -> None:
    from transformers import AutoConfig

    fields = {"hidden_size": shape.hidden, "intermediate_size": shape.intermediate, "num_hidden_layers": shape.layers,
              "num_attention_heads": shape.heads, "num_key_value_heads": shape.kv_heads, "vocab_size": shape.vocab,
              "tie_word_embeddings": shape.tied, **({"head_dim": shape.head_dim} if shape.head_dim else {})}
    AutoConfig.for_model(shape.family, **fields).save_pretrained(folder)


@contextlib.contextmanager
def _fake_load(folder: str, tracker: LiveBytes, lora=None):
    """What the load needs under a fake process group and fake tensors.
    ``set_model_state_dict(broadcast_from_rank0=True)`` on a rank other than 0 first receives
    rank 0's list of keys, shapes and dtypes (``_state_dict_utils._broadcast_state_dict``); the
    fake process group carries no objects, so the list is made here from the meta model, as rank 0
    would send it. Each received tensor's shard offsets are computed with small index tensors
    (``tensor/_utils.py`` ``_get_first_offset`` reads one with ``int()``), which must be real."""
    import torch.distributed._state_dict_utils as state_dict_utils
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed._state_dict_utils import _TensorInfo
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        lm = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder),
                                              dtype=torch.float32 if lora is None else torch.bfloat16)
    if lora is not None:  # rank 0 sends the bf16 base and its fp32 adapters (training/modeling/load.py)
        from training.modeling.lora import add_adapters

        lm = add_adapters(lm, lora, seed=0)
    infos = {f"lm.{key}": _TensorInfo(value.size(), value.dtype) for key, value in lm.state_dict().items()}
    original = dist.broadcast_object_list

    def broadcast_object_list(objects, src=0, group=None, device=None, group_src=None):
        if len(objects) == 1 and isinstance(objects[0], dict):
            objects[0] = dict(infos)
            return None
        return original(objects, src=src, group=group, device=device, group_src=group_src)

    offsets = state_dict_utils.compute_local_shape_and_global_offset

    def real_offsets(*args, **kwargs):
        with unset_fake_temporarily(), tracker.suspend():
            return offsets(*args, **kwargs)

    dist.broadcast_object_list, state_dict_utils.compute_local_shape_and_global_offset = broadcast_object_list, real_offsets
    try:
        yield
    finally:
        dist.broadcast_object_list, state_dict_utils.compute_local_shape_and_global_offset = original, offsets


@contextlib.contextmanager
def _phases(model, tracker: LiveBytes):
    """Intervals named as the plan's moments, from FSDP2's own hooks: the loss's backward runs from
    the end of the model's forward to the last layer's pre-backward; the last layer's backward to
    the end of its post-backward (its reduce-scatter); the root's reduce is the root's
    post-backward."""
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    last, root = model.layers[-1], model

    def owner(group) -> str:
        return "last" if last in group.modules else "root" if root in group.modules else "layer"

    pre, post = FSDPParamGroup.pre_backward, FSDPParamGroup.post_backward

    def pre_backward(self, *args, **kwargs):
        if owner(self) == "last":
            tracker.label("last layer's backward")
        return pre(self, *args, **kwargs)

    def post_backward(self, *args, **kwargs):
        who = owner(self)
        if who == "root":
            tracker.label("root reduce")
        result = post(self, *args, **kwargs)
        if who in ("last", "root"):
            tracker.label("earlier layers' backward" if who == "last" else "after the backward")
        return result

    # A forward with no gradient is a DPO reference forward (:func:`_reference_forwards`).
    hook = model.register_forward_hook(
        lambda *_: tracker.label("loss backward" if torch.is_grad_enabled() else "after the reference forward"))
    # Every micro-step's forward (from the second on, with the earlier micro-steps' gradients), from
    # before FSDP2's own pre-forward (the root's all-gather), which fully_shard registered first.
    start = model.register_forward_pre_hook(
        lambda *_: tracker.label("forward" if torch.is_grad_enabled() else "reference forward"), prepend=True)
    FSDPParamGroup.pre_backward, FSDPParamGroup.post_backward = pre_backward, post_backward
    try:
        yield
    finally:
        FSDPParamGroup.pre_backward, FSDPParamGroup.post_backward = pre, post
        hook.remove()
        start.remove()


@contextlib.contextmanager
def _reference_forwards(model, tracker: LiveBytes):
    """A DPO step's reference forwards labelled: ``reference_logps`` is an FSDP forward method, not
    ``__call__``, so the module's hooks do not see it."""
    inner = model.reference_logps

    def labelled(**kwargs):
        tracker.label("reference forward")
        found = inner(**kwargs)
        tracker.label("after the reference forward")
        return found

    model.reference_logps = labelled
    try:
        yield
    finally:
        model.reference_logps = inner


def _micro_batch(tokens: int, seq_len: int, *, pairs: bool = False):
    """A flattened micro-batch of ``tokens`` tokens in packed sequences of ``seq_len``, every
    position trained (training/data/batch.py ``collate``'s fields); with ``pairs``, each sequence a
    preference pair, two segments of half its length (``PairSegments``)."""
    import numpy as np

    from training.data.batch import MicroBatch, PairSegments

    segment = seq_len // 2 if pairs else seq_len
    bounds = torch.arange(0, tokens + 1, segment, dtype=torch.int32)
    inputs = {"input_ids": torch.zeros(1, tokens, dtype=torch.long), "position_ids": torch.zeros(1, tokens, dtype=torch.long),
              "cu_seq_lens_q": bounds, "cu_seq_lens_k": bounds, "max_length_q": segment, "max_length_k": segment}
    found = None
    if pairs:
        count = tokens // seq_len
        found = PairSegments(segments=torch.arange(tokens - 1) // segment,
                             bounds=torch.clamp(torch.arange(0, 2 * count + 1) * segment, max=tokens - 1),
                             segment_tokens=torch.full((2 * count,), float(segment)), pair_ids=np.arange(count),
                             pair_index=torch.arange(count))
    return MicroBatch(inputs=inputs, labels=torch.zeros(1, tokens, dtype=torch.long),
                      trained_positions=torch.arange(tokens - 1), real_tokens=tokens, label_tokens=tokens - 1,
                      sample_lengths=(segment,) * (tokens // segment), pairs=found)


def measure(case: Case) -> dict[str, int]:
    """Rank 1's largest live bytes in each interval (``load``; then, in a step with AdamW's state
    made, ``forward``, ``loss backward``, ``last layer's backward``, ``earlier layers' backward``,
    ``root reduce``, ``after the backward``, ``optimizer``; a LoRA DPO case's ``reference forward``),
    and ``step`` the step's peak."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import training.modeling.attention as attention
    from training.modeling.load import load_sharded
    from training.modeling.lora import trainable_parameters
    from training.modeling.parallel import build_mesh, is_hsdp
    from training.modeling.preference import PreferenceSettings
    from training.modeling.step import train_step

    shape = case.shape()
    measured: dict[str, int] = {}
    with tempfile.TemporaryDirectory() as folder:
        _write_config(shape, folder)
        dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=case.num_workers)
        reference = attention.reference_varlen_attention
        attention.reference_varlen_attention = flash_stand_in  # what hf_attention registers on a CPU
        try:
            mesh = build_mesh(device_type="cpu", world_size=case.num_workers, shard_size=case.shard_size)
            tracker = LiveBytes()
            with FakeTensorMode(), tracker.counting(), _fake_load(folder, tracker, case.lora()):
                tracker.label("load")
                model = load_sharded(folder, mesh=mesh, device=torch.device("cpu"), rank=1,
                                     attn_implementation=attention.FLASH,
                                     activation_checkpointing=case.activation_checkpointing, mixed_precision="bf16",
                                     loss_chunk_tokens=case.loss_chunk_tokens, lora=case.lora())
                measured["load"] = tracker.peaks["load"]
                trained = trainable_parameters(model)
                optimizer = torch.optim.AdamW(trained, lr=1e-5, betas=(0.9, 0.95), fused=True)
                # AdamW's state, as after a first step or a restore, made as AdamW makes it (torch
                # 2.13 optim/adam.py _init_group; a first step would cost as much as the measured one).
                for parameter in trained:
                    optimizer.state[parameter] = {
                        "step": torch.zeros((), dtype=torch.float32, device=parameter.device),
                        "exp_avg": torch.zeros_like(parameter, memory_format=torch.preserve_format),
                        "exp_avg_sq": torch.zeros_like(parameter, memory_format=torch.preserve_format)}
                tokens = case.micro_batch_size * case.seq_len
                preference = PreferenceSettings(loss=case.dpo_loss) if case.objective == "dpo" else None
                with _phases(model, tracker), (_reference_forwards(model, tracker) if case.lora_reference
                                               else contextlib.nullcontext()):
                    tracker.peaks.clear()
                    tracker.label("forward")
                    batches = [_micro_batch(tokens, case.seq_len, pairs=preference is not None) for _ in range(case.micro_steps)]
                    train_step(model, batches, normaliser=float(tokens), cross_node_sync=is_hsdp(mesh), preference=preference)
                    del batches
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                    tracker.label("optimizer")
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                measured.update(tracker.peaks)
                measured["step"] = max(tracker.peaks.values())
                del model, optimizer
        finally:
            attention.reference_varlen_attention = reference
            dist.destroy_process_group()
    return measured


#: The plan's moments each measured interval is compared with (the largest of them). What a layer's
#: backward holds changes linearly from layer to layer: the earlier layers' largest is the next
#: layer's or the first layer's. The forward's largest is at its start (the root's and the first
#: layer's all-gathers), its last layer or its loss. After the root's reduce-scatter (``after the
#: backward``: the end of the backward and gradient clipping) less is alive than in the root's reduce,
#: so no moment of the plan is its own.
MOMENTS = {"load": ("load",), "forward": ("forward", "last layer's forward", "loss forward"),
           "loss backward": ("loss backward",), "last layer's backward": ("last layer's backward",),
           "earlier layers' backward": ("next layer's backward", "first layer's backward"),
           "root reduce": ("root reduce",), "optimizer": ("optimizer step",), "step": ("step",)}
#: A LoRA DPO case's reference forward, and the plan's moments for it: it is the micro-step's first
#: forward, so the root's all-gather (the plan's ``forward``) is in it; the policy's forward finds the
#: root still gathered.
REFERENCE_MOMENTS = {"reference forward": ("forward", "reference forward (adapters off)")}


def planned(case: Case) -> dict[str, int]:
    """The plan's moments for ``case``, without the context allowance (no tensor of the step's)."""
    from training.modeling.plan import CONTEXT_ALLOWANCE, plan

    found = plan(case.shape(), "H200", case.options())
    moments = {name: sum(terms.values()) - CONTEXT_ALLOWANCE for name, terms in found.moments.items()}
    moments["step"] = found.peak - CONTEXT_ALLOWANCE
    return moments


def ratios(case: Case) -> dict[str, tuple[float, float, float]]:
    """Each moment's (planned GiB, measured GiB, planned / measured), by the measured interval."""
    measured, plan_of = measure(case), planned(case)
    gib = 2**30
    compared = {**MOMENTS, **(REFERENCE_MOMENTS if case.lora_reference else {})}
    found = {name: max(plan_of[moment] for moment in moments) for name, moments in compared.items()}
    return {name: (found[name] / gib, measured[name] / gib, found[name] / measured[name]) for name in compared}


if __name__ == "__main__":
    import argparse
    import time

    cases = {
        "1.5b": Case("Qwen/Qwen2.5-1.5B", 28, 8, 4, 8, 2048, 1),
        "1.5b-accumulating": Case("Qwen/Qwen2.5-1.5B", 28, 8, 4, 8, 2048, 2),
        "7b": Case("Qwen/Qwen2.5-7B", 28, 12, 12, 1, 2048, 2),
        "llama": Case("meta-llama/Llama-3.1-8B", 32, 8, 8, 4, 2048, 2),
        "32b-lora": Case("Qwen/Qwen2.5-32B", 64, 8, 8, 2, 2048, 4, lora_rank=8),
        "7b-lora-dropout": Case("Qwen/Qwen2.5-7B", 28, 8, 4, 4, 2048, 1, activation_checkpointing=False, lora_rank=16,
                                lora_dropout=0.05),
        "7b-lora-dpo": Case("Qwen/Qwen2.5-7B", 28, 8, 4, 8, 2048, 1, lora_rank=8, objective="dpo"),
    }
    parser = argparse.ArgumentParser(prog="python -m tests.training.fake_step_memory",
                                     description="Plan against measured memory of one rank, at a real model's shapes")
    parser.add_argument("cases", help=f"comma-separated, of {', '.join(cases)}")
    parser.add_argument("layers", nargs="?", type=int, help="fewer decoder layers than the model's (faster)")
    args = parser.parse_args()
    layers = args.layers
    for name in args.cases.split(","):
        case = cases[name] if layers is None else replace(cases[name], layers=layers)
        started = time.perf_counter()
        found = ratios(case)
        print(f"{name} ({case.layers} layers, {time.perf_counter() - started:.1f} s)")
        for moment, (p, m, r) in found.items():
            print(f"  {moment:<24} plan {p:8.3f} GiB  measured {m:8.3f} GiB  {r:5.2f}")
