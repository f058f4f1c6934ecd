"""MFU arithmetic against hand calculations, the traffic model, and the preflight's
reading of NCCL and its respect for the user's NCCL_DEBUG."""

from __future__ import annotations

import os

import pytest
import torch

from training.telemetry.metrics import PEAK_TFLOPS_BF16, flops_shape, mfu, peak_tflops, step_flops
from training.resilience.preflight import NCCL_LOG_PATTERN, bus_bandwidth_gbps, captured_stdout, detect_transport, prepare_nccl_logging
from training.modeling.traffic import step_traffic


def test_flops_of_one_full_sequence_by_hand():
    # One 2,048-token sample: 6 x 1e9 x 2048 + 12 x 24 layers x 2048 hidden x 2048^2, and the
    # head (1e8 parameters) on its 1,000 trained tokens only: 6 x 1e8 x 1000.
    assert step_flops(decoder_params=10**9, head_params=10**8, num_layers=24, hidden_size=2048, tokens=2048,
                      trained_tokens=1000, squared_lengths=2048**2) == 2048 * 7_207_959_552 + 6 * 10**8 * 1000


def test_the_head_counts_only_on_trained_tokens_as_the_chunked_loss_runs_it():
    # Qwen2.5-1.5B, one 2,048-token sample of which a quarter is response: counting the tied
    # 233 M head on every token, as 6 x N does, overstates the matmul FLOPs by about 13%.
    decoder, head = 1_310_340_608, 233_373_696
    honest = step_flops(decoder_params=decoder, head_params=head, num_layers=0, hidden_size=0, tokens=2048,
                        trained_tokens=512, squared_lengths=2048**2)
    every_token = 6 * (decoder + head) * 2048
    assert every_token / honest == pytest.approx(1 + 0.75 * head / (decoder + 0.25 * head))
    assert 1.12 < every_token / honest < 1.14


def test_mfu_by_hand():
    # 5,000 tokens/s x 7.2e9 FLOPs = 36 TFLOPS achieved, over an L4's 121 TFLOPS
    assert mfu(flops_per_s=5000 * 7.2e9, peak_tflops=PEAK_TFLOPS_BF16["NVIDIA L4"]) == pytest.approx(36 / 121)
    assert mfu(flops_per_s=5000 * 7.2e9, peak_tflops=None) is None


@pytest.mark.parametrize("name, peak", [
    ("NVIDIA L4", 121.0), ("NVIDIA L40S", 362.0),  # "L4" is a substring of "L40S"
    ("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA H100 NVL", 835.0),
    ("NVIDIA H200", 989.0), ("NVIDIA A100-SXM4-40GB", 312.0), ("NVIDIA RTX 4090", None),
])
def test_peak_is_found_by_the_exact_device_name(name, peak):
    assert peak_tflops(name) == peak


def test_attention_flops_follow_the_packed_samples_not_the_row():
    # Two samples of 100 and 300 tokens in a 2,048-token row, 10 matmul params, 2 layers, hidden 8:
    # 6 x 10 x 400 tokens + 12 x 2 x 8 x (100^2 + 300^2) = 24,000 + 19,200,000
    flops = step_flops(decoder_params=10, head_params=0, num_layers=2, hidden_size=8, tokens=400, trained_tokens=0,
                       squared_lengths=100**2 + 300**2)
    assert flops == 19_224_000
    # where counting every token's context as the whole 2,048-token row would say 157,310,400
    assert flops < 400 * (6 * 10 + 12 * 2 * 8 * 2048)


def test_traffic_model_by_hand_at_the_l4_preset():
    params = 1_543_714_304
    # FSDP over 8 ranks on 2 nodes, 2 micro-steps: per micro-step 2 bf16 gathers + 1 fp32 reduce-scatter
    # = 8 x P bytes collected; each rank sends 7/8 of it; a quarter of a node's sends leave the node.
    fsdp = step_traffic(params=params, num_workers=8, workers_per_node=4, accumulation=2, hsdp=False)
    assert fsdp.cross_node == pytest.approx(7 / 8 * 8 * params * 2 / 4)  # 3.5 P = 5.40 GB
    assert fsdp.within_node + fsdp.cross_node == pytest.approx(7 / 8 * 8 * params * 2)
    # HSDP: gathers and reduce-scatters inside the node (3/4 of 8 P per micro-step); across nodes
    # only the all-reduce of each rank's fp32 shard (4 P / 4) among 2 replicas: 2 x 1/2 x P.
    hsdp = step_traffic(params=params, num_workers=8, workers_per_node=4, accumulation=2, hsdp=True)
    assert hsdp.cross_node == pytest.approx(params)  # 1.54 GB, once per step
    assert hsdp.within_node == pytest.approx(3 / 4 * 8 * params * 2)
    assert fsdp.cross_node / hsdp.cross_node == pytest.approx(3.5)
    single = step_traffic(params=params, num_workers=4, workers_per_node=4, accumulation=2, hsdp=False)
    assert single.cross_node == 0.0


def test_qwen2_5_1_5b_flops_shape_by_hand():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True)
    with torch.device("meta"):
        model = Qwen2ForCausalLM(config)
    # By hand: embedding 151,936 x 1,536 = 233,373,696; per layer q 2,360,832 + k 393,472 + v 393,472
    # + o 2,359,296 + MLP 41,287,680 + 2 norms 3,072 = 46,797,824, x 28 = 1,310,339,072; final norm 1,536.
    # Total 1,543,714,304 (the published 1.54B): the decoder's matmuls are all but the embedding
    # (tied: the head is the same 233,373,696 parameters, counted apart on trained tokens).
    assert flops_shape(model) == {"decoder_params": 1_543_714_304 - 233_373_696, "head_params": 233_373_696,
                                  "num_layers": 28, "hidden_size": 1536}


def test_transport_is_read_from_nccl_logs():
    efa_log = "ip-10-0-1-2:123:456 [0] NCCL INFO NET/OFI Selected provider is efa, fabric is efa (found 1 nics)\n" \
              "ip-10-0-1-2:123:456 [0] NCCL INFO Using network Libfabric\n"
    assert detect_transport(efa_log)[0] == "efa"
    assert detect_transport("host:1:2 [0] NCCL INFO NET/OFI Selected Provider is efa (found 4 nics)\n")[0] == "efa"
    # The OFI plugin loaded, but nothing says which provider: not proof of EFA.
    assert detect_transport("host:1:2 [0] NCCL INFO Using network Libfabric\n")[0] == "libfabric"
    assert detect_transport("host:1:2 [0] NCCL INFO NET/OFI Selected provider is tcp\n"
                            "host:1:2 [0] NCCL INFO Using network Libfabric\n")[0] == "libfabric"
    socket_log = "ip-10-0-1-2:123:456 [0] NCCL INFO NET/Plugin: Could not find: libnccl-net.so\n" \
                 "ip-10-0-1-2:123:456 [0] NCCL INFO Using network Socket\n"
    transport, lines = detect_transport(socket_log)
    assert transport == "socket" and "Using network Socket" in lines[-1]
    assert detect_transport("nothing here")[0] == "unknown"


def test_nccl_logging_respects_a_user_who_asked_for_it(monkeypatch):
    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    monkeypatch.delenv("NCCL_DEBUG_FILE", raising=False)
    monkeypatch.delenv("NCCL_DEBUG_SUBSYS", raising=False)
    assert prepare_nccl_logging() is None  # NCCL logs to stdout, where they asked; nothing changed
    assert os.environ["NCCL_DEBUG"] == "INFO" and "NCCL_DEBUG_FILE" not in os.environ and "NCCL_DEBUG_SUBSYS" not in os.environ


@pytest.mark.parametrize("level", ["WARN", None])
def test_quiet_nccl_logs_its_init_lines_to_a_file(monkeypatch, level):
    # Set first, so that monkeypatch records it and restores its absence: prepare_nccl_logging sets it
    # (a NCCL_DEBUG=INFO left behind made a later multi-node run's workers start no NCCL log follower).
    monkeypatch.setenv("NCCL_DEBUG", level or "placeholder")
    if not level:
        monkeypatch.delenv("NCCL_DEBUG")
    for name in ("NCCL_DEBUG_FILE", "NCCL_DEBUG_SUBSYS"):
        monkeypatch.setenv(name, "placeholder")  # monkeypatch restores them afterwards
    assert prepare_nccl_logging() == NCCL_LOG_PATTERN
    assert (os.environ["NCCL_DEBUG"], os.environ["NCCL_DEBUG_SUBSYS"], os.environ["NCCL_DEBUG_FILE"]) == ("INFO", "INIT,NET", NCCL_LOG_PATTERN)


def test_captured_stdout_reads_what_c_code_writes_and_gives_it_back(capfd):
    with captured_stdout(True) as capture:
        os.write(1, b"NCCL INFO NET/OFI Selected provider is efa\n")
    assert capture.text == "NCCL INFO NET/OFI Selected provider is efa\n"
    assert "Selected provider is efa" in capfd.readouterr().out  # replayed, nothing lost


def test_bus_bandwidth_follows_nccl_tests():
    # 1 GB in 0.1 s over 8 ranks: 1e9 x 2 x 7/8 / 0.1 s = 17.5 GB/s
    assert bus_bandwidth_gbps(size_bytes=10**9, seconds=0.1, world_size=8) == pytest.approx(17.5)


_HUNG_CAPTURE = """
import os, sys, time
import torch, torch.distributed as dist
from training.resilience import preflight
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
real_all_reduce = dist.all_reduce

def never_connects(tensor, group=None, **kwargs):
    if group is not None and group != dist.group.WORLD:  # the preflight's own group
        os.write(1, b"NCCL INFO printed before the hang\\n")
        time.sleep(3600)
    return real_all_reduce(tensor, group=group, **kwargs)

dist.all_reduce = never_connects
preflight.captures_stdout = lambda device: True  # as on a GPU with -c ncclDebug=true
result = preflight.network_check(device=torch.device("cpu"), size_mib=1, expect_efa=False, timeout_s=2, nccl_log=None)
print("after the deadline:", result.problems[0][:40], flush=True)
os.write(1, b"and C-level output too\\n")
os._exit(0)
"""


def test_a_hung_first_all_reduce_gives_stdout_back_at_the_deadline(tmp_path):
    """Verbose mode captures fd 1 around the first all-reduce; when it hangs, the capture is
    released at the deadline by the waiting thread, so what the worker prints afterwards (and
    what NCCL printed before the hang) still reaches its stdout."""
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "stdout.txt"
    with out.open("wb") as stdout:
        subprocess.run([sys.executable, "-c", _HUNG_CAPTURE, str(tmp_path / "store")], stdout=stdout, timeout=120,
                       check=True, cwd=Path(__file__).resolve().parents[2])
    text = out.read_text()
    assert "NCCL INFO printed before the hang" in text
    assert "after the deadline: the preflight all-reduce across 1 w" in text
    assert "and C-level output too" in text


def test_captured_stdout_flushes_what_c_stdio_still_buffers():
    """NCCL prints with C stdio and never flushes; stdout is a file under Ray (and here), so
    block-buffered: the capture must flush C's buffer before it reads."""
    import ctypes

    libc = ctypes.CDLL(None)
    with captured_stdout(True) as capture:
        libc.printf(b"host:1:2 [0] NCCL INFO NET/OFI Selected provider is efa, fabric is efa\n")
    assert detect_transport(capture.text)[0] == "efa"


def test_the_nccl_log_file_is_read_after_flushing_c_stdio(tmp_path, monkeypatch):
    import ctypes

    from training.resilience.preflight import nccl_log_text

    libc = ctypes.CDLL(None)
    libc.fopen.restype = ctypes.c_void_p
    libc.fprintf.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    libc.fclose.argtypes = [ctypes.c_void_p]
    pattern = str(tmp_path / "nccl.%h.%p.log")
    stream = libc.fopen(pattern.replace("%h", "host").replace("%p", str(os.getpid())).encode(), b"w")
    try:
        libc.fprintf(stream, b"host:1:2 [0] NCCL INFO NET/OFI Selected provider is efa\nhost:1:2 [0] NCCL WARN Call to ibv_reg_mr failed\n")
        # Not flushed here (NCCL line-buffers its file, src/debug.cc; a block-buffered writer
        # would not): the reader flushes this process's C stdio first.
        assert "Selected provider is efa" in nccl_log_text(pattern)
        assert "NCCL WARN Call to ibv_reg_mr failed" in nccl_log_text(pattern)
    finally:
        libc.fclose(stream)


class _FakeFlashAttention:
    """A stand-in ``flash_attn`` module (no GPU here): records the call, returns q."""

    def __init__(self):
        self.calls = []

    def flash_attn_varlen_func(self, q, k, v, cu_q, cu_k, max_q, max_k, causal):
        self.calls.append((tuple(q.shape), cu_q.tolist(), max_q, causal))
        return q


def test_flash_attention_is_checked_by_importing_it_and_running_the_varlen_kernel(monkeypatch):
    import sys

    from training.resilience.preflight import flash_attention_problem

    fake = _FakeFlashAttention()
    monkeypatch.setitem(sys.modules, "flash_attn", fake)
    assert flash_attention_problem("flash_attention_2", torch.device("cpu"), dtype=torch.float32) is None
    assert fake.calls == [((5, 2, 64), [0, 2, 5], 3, True)]
    assert flash_attention_problem("sdpa", torch.device("cpu")) is None


def test_a_flash_attention_wheel_built_for_another_torch_fails_the_preflight(monkeypatch):
    """Its metadata is there (is_flash_attn_2_available() says yes); its import is not."""
    import importlib.abc
    import importlib.util
    import sys

    from training.resilience.preflight import flash_attention_problem

    symbol = "flash_attn_2_cuda.cpython-311-x86_64-linux-gnu.so: undefined symbol: _ZN3c105ErrorC2ENS_14SourceLocationE"

    class MismatchedWheel(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        def find_spec(self, name, path=None, target=None):
            return importlib.util.spec_from_loader(name, self) if name == "flash_attn" else None

        def create_module(self, spec):
            return None

        def exec_module(self, module):
            raise ImportError(symbol)

    monkeypatch.delitem(sys.modules, "flash_attn", raising=False)
    monkeypatch.setattr(sys, "meta_path", [MismatchedWheel(), *sys.meta_path])
    problem = flash_attention_problem("flash_attention_2", torch.device("cpu"))
    assert problem == (f"attn_implementation='flash_attention_2' but flash_attn does not import on this GPU worker "
                       f"(ImportError: {symbol}); install a flash-attn built for this image's torch and CUDA, "
                       "or use --attn-implementation sdpa (each packed sequence then runs as a row of its own with its own "
                       "seq_len x seq_len mask: no flattened row, no varlen kernel, slower than flash-attn by what "
                       "bench/gpu_first_hour.py measures)")


def test_run_bounded_returns_raises_or_gives_up_at_its_deadline():
    import time

    from training.resilience.preflight import DeadlineExceeded, run_bounded

    assert run_bounded(lambda: 42, 5, "quick") == 42
    with pytest.raises(ZeroDivisionError):
        run_bounded(lambda: 1 / 0, 5, "broken")
    started = time.perf_counter()
    with pytest.raises(DeadlineExceeded, match="stuck did not finish within 0.3 s"):
        run_bounded(lambda: time.sleep(30), 0.3, "stuck")
    assert time.perf_counter() - started < 2


def test_the_preflight_fails_when_the_pods_prestop_hook_would_not_drain_this_node():
    import json
    import sys

    from ray_train_eks import charts
    from training.resilience.preflight import PRESTOP_CHECK_ENV, prestop_problem

    assert charts.PRESTOP_CHECK_ENV == PRESTOP_CHECK_ENV
    says = lambda text: json.dumps([sys.executable, "-c", f"print({text!r})"])  # noqa: E731
    assert prestop_problem(says("preStop check: node abc123 GCS 10.0.0.1:6379 python /p ray 2.58.0"), "abc123") is None
    wrong = prestop_problem(says("preStop check: node def456 GCS 10.0.0.1:6379"), "abc123")
    assert wrong.startswith("the pod's preStop hook would not drain this Ray node abc123 (exit 0: preStop check: node def456")
    failing = prestop_problem(json.dumps(["/bin/sh", "-c", "echo 'preStop: no raylet runs in this pod' >&2; exit 1"]), "abc123")
    assert "(exit 1: preStop: no raylet runs in this pod)" in failing
    assert prestop_problem(None, "abc123") is None  # not in a pod of ours
