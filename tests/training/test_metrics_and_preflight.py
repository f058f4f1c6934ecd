"""MFU arithmetic against hand calculations, and the network preflight's reading of NCCL."""

from __future__ import annotations

import pytest
import torch

from training.metrics import PEAK_TFLOPS_BF16, flops_per_token, mfu, model_flops_per_token
from training.preflight import bus_bandwidth_gbps, detect_transport, run_preflight


def test_flops_per_token_by_hand():
    # 6 x 1e9 + 12 x 24 layers x 2048 hidden x 2048 tokens = 6e9 + 1,207,959,552
    assert flops_per_token(matmul_params=10**9, num_layers=24, hidden_size=2048, seq_len=2048) == 7_207_959_552


def test_mfu_by_hand():
    # 5,000 tokens/s x 7.2e9 FLOPs = 36 TFLOPS achieved, over an L4's 121 TFLOPS
    assert mfu(tokens_per_s=5000, flops_per_token=7.2e9, peak_tflops=PEAK_TFLOPS_BF16["L4"]) == pytest.approx(36 / 121)
    assert mfu(tokens_per_s=5000, flops_per_token=7.2e9, peak_tflops=None) is None


def test_qwen2_5_1_5b_flops_per_token():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True)
    with torch.device("meta"):
        model = Qwen2ForCausalLM(config)
    # By hand: embedding 151,936 x 1,536 = 233,373,696; per layer q 2,360,832 + k 393,472 + v 393,472
    # + o 2,359,296 + MLP 41,287,680 + 2 norms 3,072 = 46,797,824, x 28 = 1,310,339,072; final norm 1,536.
    # Total 1,543,714,304 (the published 1.54B); tied, so the head's matmul is the embedding's parameters.
    total = 1_543_714_304
    assert model_flops_per_token(model, 2048) == 6 * total + 12 * 28 * 1536 * 2048


def test_transport_is_read_from_nccl_logs():
    efa_log = "ip-10-0-1-2:123:456 [0] NCCL INFO NET/OFI Selected provider is efa, fabric is efa (found 1 nics)\n" \
              "ip-10-0-1-2:123:456 [0] NCCL INFO Using network Libfabric\n"
    assert detect_transport(efa_log)[0] == "efa"
    socket_log = "ip-10-0-1-2:123:456 [0] NCCL INFO NET/Plugin: Could not find: libnccl-net.so\n" \
                 "ip-10-0-1-2:123:456 [0] NCCL INFO Using network Socket\n"
    transport, lines = detect_transport(socket_log)
    assert transport == "socket" and "Using network Socket" in lines[-1]
    assert detect_transport("nothing here")[0] == "unknown"


def test_bus_bandwidth_follows_nccl_tests():
    # 1 GB in 0.1 s over 8 ranks: 1e9 x 2 x 7/8 / 0.1 s = 17.5 GB/s
    assert bus_bandwidth_gbps(size_bytes=10**9, seconds=0.1, world_size=8) == pytest.approx(17.5)


def test_preflight_is_skipped_on_cpu(capsys):
    assert run_preflight(device=torch.device("cpu"), size_mib=256, expect_efa=True) is None
    assert "network preflight skipped" in capsys.readouterr().out
