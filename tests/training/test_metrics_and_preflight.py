"""MFU arithmetic against hand calculations, the traffic model, and the preflight's
reading of NCCL and its respect for the user's NCCL_DEBUG."""

from __future__ import annotations

import os

import pytest
import torch

from training.metrics import PEAK_TFLOPS_BF16, matmul_parameters, mfu, peak_tflops, step_flops
from training.preflight import NCCL_LOG_PATTERN, bus_bandwidth_gbps, captured_stdout, detect_transport, prepare_nccl_logging
from training.traffic import step_traffic


def test_flops_of_one_full_sequence_by_hand():
    # One 2,048-token sample: 6 x 1e9 x 2048 + 12 x 24 layers x 2048 hidden x 2048^2
    assert step_flops(matmul_params=10**9, num_layers=24, hidden_size=2048, sample_lengths=[2048]) == 2048 * 7_207_959_552


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
    assert step_flops(matmul_params=10, num_layers=2, hidden_size=8, sample_lengths=[100, 300]) == 19_224_000
    # where counting every token's context as the whole 2,048-token row would say 157,310,400
    assert step_flops(matmul_params=10, num_layers=2, hidden_size=8, sample_lengths=[100, 300]) < 400 * (6 * 10 + 12 * 2 * 8 * 2048)


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


def test_qwen2_5_1_5b_matmul_parameters_by_hand():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True)
    with torch.device("meta"):
        model = Qwen2ForCausalLM(config)
    # By hand: embedding 151,936 x 1,536 = 233,373,696; per layer q 2,360,832 + k 393,472 + v 393,472
    # + o 2,359,296 + MLP 41,287,680 + 2 norms 3,072 = 46,797,824, x 28 = 1,310,339,072; final norm 1,536.
    # Total 1,543,714,304 (the published 1.54B); tied, so the head's matmul is the embedding's parameters.
    assert matmul_parameters(model) == 1_543_714_304


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
    if level:
        monkeypatch.setenv("NCCL_DEBUG", level)
    else:
        monkeypatch.delenv("NCCL_DEBUG", raising=False)
    for name in ("NCCL_DEBUG_FILE", "NCCL_DEBUG_SUBSYS"):
        monkeypatch.setenv(name, "placeholder")  # monkeypatch restores them afterwards
    assert prepare_nccl_logging() == NCCL_LOG_PATTERN
    assert (os.environ["NCCL_DEBUG"], os.environ["NCCL_DEBUG_SUBSYS"], os.environ["NCCL_DEBUG_FILE"]) == ("INFO", "INIT,NET", NCCL_LOG_PATTERN)


def test_captured_stdout_reads_what_c_code_writes_and_gives_it_back(capfd):
    with captured_stdout(True) as text:
        os.write(1, b"NCCL INFO NET/OFI Selected provider is efa\n")
    assert text == ["NCCL INFO NET/OFI Selected provider is efa\n"]
    assert "Selected provider is efa" in capfd.readouterr().out  # replayed, nothing lost


def test_bus_bandwidth_follows_nccl_tests():
    # 1 GB in 0.1 s over 8 ranks: 1e9 x 2 x 7/8 / 0.1 s = 17.5 GB/s
    assert bus_bandwidth_gbps(size_bytes=10**9, seconds=0.1, world_size=8) == pytest.approx(17.5)


