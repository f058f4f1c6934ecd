"""Preference losses (``--objective dpo``) on the log-probabilities of the completion tokens of each
pair's two sides, as TRL computes them (``--dpo-loss``):

- ``sigmoid``: DPO (Rafailov et al. 2023), ``-log σ(β [(π_c - ref_c) - (π_r - ref_r)])`` over the
  completions' summed log-probabilities (TRL ``DPOTrainer``, ``loss_type="sigmoid"``);
- ``ipo``: IPO (Azar et al. 2023), ``((π_c - ref_c) / n_c - (π_r - ref_r) / n_r - 1 / (2β))²``: each side's
  log-ratio averaged over its completion tokens (TRL 1.16 ``DPOTrainer._compute_loss``, ``"ipo"``);
- ``simpo``: SimPO (Meng et al. 2024), reference-free, ``-log σ(β (π_c / n_c - π_r / n_r) - γ)`` over the
  log-probabilities averaged per completion token, ``γ`` the absolute margin ``--simpo-gamma`` (default half
  of β, SimPO's recipe: :data:`SIMPO_GAMMA_BETA_RATIO`), as TRL's
  ``CPOTrainer`` (``trl.experimental.cpo``, ``loss_type="simpo"``, ``cpo_alpha=0``) computes it
  (``logits -= simpo_gamma / beta`` inside ``β (...)``).

SimPO rather than ORPO as the reference-free loss: both need no reference model, but ORPO adds a
supervised loss on the chosen side and its odds ratio over the averaged log-probabilities, where SimPO
is the DPO step with the reference replaced by a length normalisation and a margin, so it reuses
everything DPO computes here (and its paper reports it ahead of ORPO on AlpacaEval 2 and Arena-Hard).

The metrics are TRL's: ``rewards/chosen`` and ``rewards/rejected`` (β times the policy's summed
log-ratio to the reference, for IPO too; SimPO: β times the averaged log-probability, as CPO's),
``rewards/margins`` (their difference), ``rewards/accuracies`` (the share of pairs whose chosen reward
is the larger; a tie counts as not) and ``logps/chosen``, ``logps/rejected`` (the policy's summed
log-probabilities; SimPO: averaged), each a mean over the step's pairs (TRL averages per micro-batch
means; equal micro-batches give the same).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

#: ``--dpo-loss`` values.
LOSSES = ("sigmoid", "ipo", "simpo")
#: Per loss: β when ``--dpo-beta`` is not given (TRL 1.16's DPOConfig default 0.1 for DPO and IPO; SimPO's
#: paper trains with β 2.0 to 2.5, princeton-nlp/SimPO's README: 2.5 with γ/β 0.55 for Llama-3-Instruct,
#: 2.0 with γ/β 0.5 for Llama-3-Base; TRL's CPOConfig keeps 0.1 for every loss type).
DEFAULT_BETA = {"sigmoid": 0.1, "ipo": 0.1, "simpo": 2.0}
#: SimPO's γ when ``--simpo-gamma`` is not given, as a share of β: the recipe's ``gamma_beta_ratio``
#: (princeton-nlp/SimPO training_configs/llama-3-8b-base-simpo.yaml: beta 2.0, gamma_beta_ratio 0.5).
SIMPO_GAMMA_BETA_RATIO = 0.5
#: The metrics a preference step reports, each a mean over the step's pairs (TRL's names).
STATS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen", "logps/rejected")


@dataclass(frozen=True)
class PreferenceSettings:
    """``--dpo-loss``, ``--dpo-beta`` (None: :data:`DEFAULT_BETA`), ``--simpo-gamma`` (None:
    :data:`SIMPO_GAMMA_BETA_RATIO` of β)."""

    loss: str = "sigmoid"
    beta: float | None = None
    simpo_gamma: float | None = None

    @classmethod
    def of(cls, config) -> "PreferenceSettings | None":
        """From a TrainConfig; None for supervised fine-tuning."""
        if getattr(config, "objective", "sft") != "dpo":
            return None
        return cls(loss=config.dpo_loss, beta=config.dpo_beta, simpo_gamma=config.simpo_gamma)

    @property
    def beta_value(self) -> float:
        return self.beta if self.beta is not None else DEFAULT_BETA[self.loss]

    @property
    def gamma_value(self) -> float:
        """SimPO's target margin γ: as given, else :data:`SIMPO_GAMMA_BETA_RATIO` of β."""
        return self.simpo_gamma if self.simpo_gamma is not None else SIMPO_GAMMA_BETA_RATIO * self.beta_value

    @property
    def needs_reference(self) -> bool:
        """Whether the loss compares with a reference model (SimPO does not)."""
        return self.loss != "simpo"



def preference_losses(policy: torch.Tensor, reference: torch.Tensor | None, segment_tokens: torch.Tensor,
                      settings: PreferenceSettings) -> tuple[torch.Tensor, torch.Tensor]:
    """Per pair, the loss and the metrics (:data:`STATS`, one row a pair).

    :param policy: summed log-probabilities of each segment's completion tokens, (2P,): pair ``p``'s
        chosen side at ``2p``, its rejected side at ``2p + 1``.
    :param reference: the same under the reference model (None for SimPO).
    :param segment_tokens: each segment's trained tokens, (2P,), for the averaged losses.
    """
    beta = settings.beta_value
    if settings.loss == "simpo":
        policy = policy / segment_tokens
        chosen, rejected = policy[0::2], policy[1::2]
        losses = -F.logsigmoid(beta * (chosen - rejected - settings.gamma_value / beta))
        chosen_rewards, rejected_rewards = beta * chosen.detach(), beta * rejected.detach()
    else:
        if reference is None:
            raise ValueError(f"dpo_loss={settings.loss!r} needs the reference model's log-probabilities")
        chosen, rejected = policy[0::2], policy[1::2]
        ratios = policy - reference
        if settings.loss == "sigmoid":
            losses = -F.logsigmoid(beta * (ratios[0::2] - ratios[1::2]))
        else:
            averaged = ratios / segment_tokens
            losses = (averaged[0::2] - averaged[1::2] - 1 / (2 * beta)) ** 2
        chosen_rewards, rejected_rewards = beta * ratios[0::2].detach(), beta * ratios[1::2].detach()
    stats = torch.stack([chosen_rewards, rejected_rewards, (chosen_rewards > rejected_rewards).float(),
                         chosen_rewards - rejected_rewards, chosen.detach(), rejected.detach()], dim=1)
    return losses, stats


def pair_logps(model, batch, *, reference: bool = False) -> torch.Tensor:
    """Summed log-probabilities of each segment's trained tokens in ``batch`` (a micro-batch of
    pairs), (2P,) fp32: the policy's, or with ``reference`` the reference model's, without gradients
    (under LoRA the same model with its adapters off: training/modeling/model.py)."""
    call = model.reference_logps if reference else model
    return call(**batch.inputs, labels=batch.labels, trained_positions=batch.trained_positions,
                segment_bounds=batch.pairs.bounds, normaliser=1.0)


def reference_of(model, batch, table: torch.Tensor | None) -> torch.Tensor:
    """The reference log-probabilities of ``batch``'s pairs: from the precomputed ``table`` (a full
    fine-tune: (pairs, 2) on the device, training/modeling/reference.py; indexed on the device, no
    host sync), else computed now with the adapters off (LoRA)."""
    if table is not None:
        return table.index_select(0, batch.pairs.pair_index).reshape(-1)
    with torch.no_grad():
        return pair_logps(model, batch, reference=True)


def preference_step_loss(model, batch, settings: PreferenceSettings, *, normaliser: float,
                         table: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One micro-batch's preference loss (summed over its pairs, over ``normaliser``) with its
    graph, and its metrics (:data:`STATS`) summed over its pairs, detached (the pair count is known
    on the CPU: ``PackedDataset.loss_units``)."""
    reference = reference_of(model, batch, table) if settings.needs_reference else None
    policy = pair_logps(model, batch)
    losses, stats = preference_losses(policy, reference, batch.pairs.segment_tokens, settings)
    loss = (losses.sum() + policy.sum() * 0.0) / normaliser  # connected to the graph with no pair too
    return loss, stats.sum(dim=0)
