"""The preference losses and metrics (training/modeling/preference.py) against TRL's own code on the
same batch and the same log-probabilities: DPO and IPO against ``DPOTrainer._compute_loss`` (trl
1.16.0: the loss and its metrics are computed inline there, from the policy's per-token
log-probabilities, which its model returns, and the precomputed reference's), SimPO against
``CPOTrainer.cpo_loss`` (``trl.experimental.cpo``, ``loss_type="simpo"``, ``alpha=0``). TRL is a test
dependency only (requirements-dev.txt); the stand-ins for its trainer's ``self`` carry exactly the
attributes those functions read."""

from __future__ import annotations

import os
import types
from collections import defaultdict

import pytest
import torch
import torch.nn.functional as F

from training.modeling.preference import PreferenceSettings, STATS, preference_losses

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
PAIRS, LENGTH = 5, 12


def _batch(seed: int):
    """TRL's layout: rows [chosen..., rejected...], each a prompt then a completion then padding;
    ``completion_mask`` over the tokens, per-token log-probabilities at the positions that score a
    completion token (position t scores token t + 1), the reference's sums per row."""
    generator = torch.Generator().manual_seed(seed)
    mask = torch.zeros(2 * PAIRS, LENGTH, dtype=torch.long)
    for row in range(2 * PAIRS):
        prompt = int(torch.randint(1, 4, (), generator=generator))
        completion = int(torch.randint(1, LENGTH - prompt, (), generator=generator))
        mask[row, prompt:prompt + completion] = 1
    per_token = -torch.rand(2 * PAIRS, LENGTH - 1, generator=generator) * 3 * mask[:, 1:]
    reference = -torch.rand(2 * PAIRS, generator=generator) * 20
    return per_token, mask, reference


def _ours(per_token, mask, reference, settings):
    """Our inputs from TRL's batch: per segment (pair p's chosen at 2p, rejected at 2p + 1) the summed
    log-probability, the reference's, and the trained tokens."""
    order = torch.stack([torch.arange(PAIRS), torch.arange(PAIRS) + PAIRS], dim=1).reshape(-1)
    return preference_losses(per_token.sum(1)[order], reference[order] if settings.needs_reference else None,
                             mask.sum(1)[order].float(), settings)


def _trl_dpo(per_token, mask, reference, loss_type: str, beta: float):
    from trl.trainer.dpo_trainer import DPOTrainer
    from trl.trainer.utils import FusedCausalLMOutput

    rows, length = mask.shape
    output = FusedCausalLMOutput(log_probs=per_token, entropy=torch.zeros(rows, length - 1),
                                 mean_logits=torch.zeros(rows, length - 1),
                                 is_top1=torch.zeros(rows, length - 1, dtype=torch.bool))
    trainer = types.SimpleNamespace(
        model=types.SimpleNamespace(training=True),
        accelerator=types.SimpleNamespace(device=torch.device("cpu"), gather=lambda t: t, gather_for_metrics=lambda t: t),
        aux_loss_enabled=False, ld_alpha=None, precompute_ref_logps=True, f_divergence_type="reverse_kl",
        f_alpha_divergence_coef=0.5, loss_types=[loss_type], loss_weights=[1.0], beta=beta, label_smoothing=0.0,
        use_weighting=False, args=types.SimpleNamespace(discopop_tau=0.05),
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)}, _total_train_tokens=0, _tp_size=1)
    inputs = {"input_ids": torch.zeros(rows, length, dtype=torch.long), "attention_mask": torch.ones(rows, length, dtype=torch.long),
              "completion_mask": mask, "ref_chosen_logps": reference[:PAIRS], "ref_rejected_logps": reference[PAIRS:]}
    loss = DPOTrainer._compute_loss(trainer, lambda **_: output, inputs, return_outputs=False)
    return loss, {key: values[-1] for key, values in trainer._metrics["train"].items()}


@pytest.mark.parametrize("loss_type,beta", [("sigmoid", 0.1), ("sigmoid", 0.5), ("ipo", 0.1)])
def test_dpo_and_ipo_equal_trls_loss_and_metrics(loss_type, beta):
    per_token, mask, reference = _batch(seed=int(beta * 10) + len(loss_type))
    expected, metrics = _trl_dpo(per_token, mask, reference, loss_type, beta)
    losses, stats = _ours(per_token, mask, reference, PreferenceSettings(loss=loss_type, beta=beta))
    assert losses.mean().item() == pytest.approx(expected.item(), rel=1e-6, abs=1e-7)
    ours = dict(zip(STATS, stats.mean(dim=0).tolist()))
    assert 0 < ours["rewards/accuracies"] < 1  # the batch has pairs either way round
    for name in STATS:
        assert ours[name] == pytest.approx(metrics[name], rel=1e-5, abs=1e-6), name


@pytest.mark.parametrize("beta,gamma", [(2.0, 0.5), (2.5, 1.375)])
def test_simpo_equals_trls_cpo_loss_with_its_rewards(beta, gamma):
    from trl.experimental.cpo import CPOTrainer

    per_token, mask, _ = _batch(seed=7)
    averaged = per_token.sum(1) / mask.sum(1)
    trainer = types.SimpleNamespace(alpha=0.0, loss_type="simpo", beta=beta, simpo_gamma=gamma, label_smoothing=0.0,
                                    accelerator=types.SimpleNamespace(device=torch.device("cpu")))
    expected, chosen_rewards, rejected_rewards = CPOTrainer.cpo_loss(trainer, averaged[:PAIRS], averaged[PAIRS:])
    losses, stats = _ours(per_token, mask, None, PreferenceSettings(loss="simpo", beta=beta, simpo_gamma=gamma))
    assert losses.tolist() == pytest.approx(expected.tolist(), rel=1e-6)
    assert stats[:, 0].tolist() == pytest.approx(chosen_rewards.tolist(), rel=1e-6)
    assert stats[:, 1].tolist() == pytest.approx(rejected_rewards.tolist(), rel=1e-6)
    assert stats[:, 4].tolist() == pytest.approx(averaged[:PAIRS].tolist(), rel=1e-6)  # CPO logs the averaged logps
    assert losses.tolist() == pytest.approx((-F.logsigmoid(beta * (averaged[:PAIRS] - averaged[PAIRS:]) - gamma)).tolist(),
                                            rel=1e-6)


def test_the_default_beta_is_trls_for_dpo_and_ipo_and_simpos_papers_for_simpo():
    from trl import DPOConfig

    assert PreferenceSettings(loss="sigmoid").beta_value == DPOConfig.beta == PreferenceSettings(loss="ipo").beta_value
    assert PreferenceSettings(loss="simpo").beta_value == 2.0
