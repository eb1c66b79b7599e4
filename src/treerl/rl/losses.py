"""Policy and value losses, separable over the sequences of a global batch.

A loss object is built once per step from the global :class:`TokenBatch` and called by
the engine (``TreeEngine.forward_backward(..., separable=True)``) as
``loss(per_sequence_tensors, [entropies], index=sequence_indices)``, possibly several
times on disjoint parts of the batch. All normalisers are fixed at construction
(:mod:`treerl.rl.aggregation`), so the calls' losses (and gradients) sum to those of one
call on the full batch. Metrics are accumulated on the device during the calls and read
with :meth:`metrics` (the only host sync).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import Tensor

from .aggregation import Normalisers, check_aggregation, token_weights
from .batch import TokenBatch
from .kl import KL_ESTIMATORS, kl_estimate

RATIO_LEVELS = ("token", "sequence")


@dataclass(frozen=True)
class PolicyLossConfig:
    """Policy-gradient loss settings.

    ratio: ``"token"`` (PPO) or ``"sequence"`` (GSPO: the sequence's ratio
        ``exp(mean over its trained tokens of (logp - logp_old))``, clipped and applied
        to each of its tokens).
    eps_low, eps_high: clip range ``[1 - eps_low, 1 + eps_high]`` (DAPO clip-higher:
        ``eps_high > eps_low``; GSPO uses ~3e-4 / 4e-4).
    dual_clip: ``c > 1``; for negative advantages the token loss is capped at ``-A c``.
    behaviour_weight_cap: decoupled PPO; tokens whose behaviour weight
        ``exp(logp_prox - logp_behav)`` exceeds it are *masked* from the policy-gradient
        term (they still count in the normaliser, like AReaL). None = no cap.
    behaviour_weight_truncate: with a cap, *truncate* the weight at it instead of masking
        (truncated importance sampling, TIS: ``w = min(exp(prox - behav), cap)``), the
        correction for rollout/trainer logprob mismatch (bf16 generation vs training).
    aggregation, norm_constant: see :mod:`treerl.rl.aggregation`.
    kl_coef, kl_estimator: ``+ kl_coef * aggregated KL(pi || pi_ref)`` (k1, k2 or k3).
    entropy_coef: ``- entropy_coef * aggregated entropy`` (needs entropies).
    """

    ratio: str = "token"
    eps_low: float = 0.2
    eps_high: float = 0.2
    dual_clip: float | None = None
    behaviour_weight_cap: float | None = None
    behaviour_weight_truncate: bool = False
    aggregation: str = "token-mean"
    norm_constant: float | None = None
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0

    def __post_init__(self) -> None:
        if self.ratio not in RATIO_LEVELS:
            raise ValueError(f"unknown ratio level {self.ratio!r}: choose one of {', '.join(RATIO_LEVELS)}")
        if not (0 <= self.eps_low < 1 and self.eps_high >= 0):
            raise ValueError(f"need 0 <= eps_low < 1 and eps_high >= 0, got {self.eps_low}, {self.eps_high}")
        if self.dual_clip is not None and not self.dual_clip > 1:
            raise ValueError(f"dual_clip must be > 1, got {self.dual_clip}")
        if self.behaviour_weight_cap is not None and not self.behaviour_weight_cap > 0:
            raise ValueError(f"behaviour_weight_cap must be positive, got {self.behaviour_weight_cap}")
        check_aggregation(self.aggregation, self.norm_constant)
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"unknown KL estimator {self.kl_estimator!r}: choose one of {', '.join(KL_ESTIMATORS)}")


class _SeparableLoss:
    """Shared machinery: per-token weights, batch on the call's device, index checks,
    metric accumulators."""

    separable = True  # pass to TreeEngine.forward_backward(separable=loss.separable)

    def __init__(self, batch: TokenBatch, aggregation: str, norm_constant, normalisers: Normalisers | None):
        self.batch = batch
        self.weights = token_weights(batch, aggregation, normalisers, norm_constant)
        self._lengths = batch.seq_lengths.tolist()
        self._device_batch: dict[torch.device, dict[str, Tensor]] = {}
        self.reset_metrics()

    def reset_metrics(self) -> None:
        self._acc: dict[str, Tensor] = {}

    def _fields(self, device: torch.device) -> dict[str, Tensor]:
        """Per-token tensors the loss uses, on ``device`` (moved once, then cached)."""
        if device not in self._device_batch:
            self._device_batch[device] = {k: v.to(device) for k, v in self._tensors().items()}
        return self._device_batch[device]

    def _tensors(self) -> dict[str, Tensor]:
        raise NotImplementedError

    def _select(self, tensors: Sequence[Tensor], index, what: str) -> tuple[Tensor, Tensor | None, list[int]]:
        """Concatenate the per-sequence tensors after checking them against ``index``."""
        tokens, seqs = self.batch.token_index(index)
        if len(tensors) != len(seqs):
            raise ValueError(f"got {len(tensors)} {what} tensors for {len(seqs)} sequences (index)")
        for t, s in zip(tensors, seqs):
            if t.dim() != 1 or t.shape[0] != self._lengths[s]:
                raise ValueError(
                    f"{what} of sequence {s} has shape {tuple(t.shape)} but the batch has "
                    f"{self._lengths[s]} predicted tokens for it"
                )
        flat = torch.cat(list(tensors)) if len(tensors) else self.weights.new_zeros(0)
        if tokens is not None:
            tokens = tokens.to(flat.device)
        return flat, tokens, seqs

    def _accumulate(self, **values: Tensor) -> None:
        with torch.no_grad():
            for k, v in values.items():
                v = v.detach().to(torch.float64)
                if k.endswith("_max"):
                    self._acc[k] = torch.maximum(self._acc[k], v) if k in self._acc else v
                elif k.endswith("_min"):
                    self._acc[k] = torch.minimum(self._acc[k], v) if k in self._acc else v
                else:
                    self._acc[k] = self._acc[k] + v if k in self._acc else v

    def _read(self) -> dict[str, float]:
        if not self._acc:
            return {}
        keys = list(self._acc)
        vals = torch.stack([self._acc[k].reshape(()) for k in keys]).tolist()  # one host sync
        return dict(zip(keys, vals))


class PolicyLoss(_SeparableLoss):
    """PPO / dual-clip / DAPO clip-higher / GSPO / decoupled PPO, with KL and entropy terms.

    Per trained token ``t`` (``A`` advantage, ``old`` = proximal logprobs if present, else
    behaviour logprobs, else the current logprobs detached, i.e. on-policy):
    ``r = exp(logp - old)`` (GSPO: the sequence ratio), ``pg = max(-A r, -A clip(r))``,
    dual clip ``pg = min(pg, -A c)`` where ``A < 0``, decoupled PPO ``pg *= w`` with
    ``w = exp(prox - behav)`` (0 above ``behaviour_weight_cap``),
    ``term = pg + kl_coef * kl(logp, ref) - entropy_coef * entropy``,
    ``loss = sum_t weight_t * term_t``.

    Call: ``loss(logprobs, entropies=None, *, index=None) -> scalar`` with per-sequence
    current logprobs ``[L_i - 1]`` (with grad) of the sequences ``index`` (None = all, in
    order). ``normalisers``: global counts when ``batch`` is one rank's share.

    ``current_proximal``: decoupled PPO whose proximal logprobs are the current ones,
    detached (a step's first update: the weights are still the proximal ones), so ``batch``
    carries none; the values its calls used are kept in :attr:`current_logprobs`.
    """

    def __init__(
        self,
        batch: TokenBatch,
        config: PolicyLossConfig = PolicyLossConfig(),
        *,
        normalisers: Normalisers | None = None,
        current_proximal: bool = False,
    ):
        self.config = config
        if config.kl_coef != 0.0 and batch.reference_logprobs is None:
            raise ValueError("kl_coef is set but the batch has no reference_logprobs")
        if current_proximal and batch.proximal_logprobs is not None:
            raise ValueError("current_proximal: the batch must not carry proximal_logprobs")
        if current_proximal and batch.behaviour_logprobs is None:
            raise ValueError("current_proximal (decoupled PPO) needs behaviour_logprobs")
        self.current_proximal = current_proximal
        super().__init__(batch, config.aggregation, config.norm_constant, normalisers)
        # [T]: the proximal (= current, detached) logprobs the calls used; NaN on tokens no call saw
        self.current_logprobs: Tensor | None = (
            torch.full_like(batch.behaviour_logprobs, torch.nan) if current_proximal else None)

    def _tensors(self) -> dict[str, Tensor]:
        b = self.batch
        out = {"mask": b.loss_mask, "adv": b.advantages, "weight": self.weights.to(b.advantages.dtype)}
        if b.behaviour_logprobs is not None:
            out["behav"] = b.behaviour_logprobs
        if b.proximal_logprobs is not None:
            out["prox"] = b.proximal_logprobs
        if b.reference_logprobs is not None:
            out["ref"] = b.reference_logprobs
        if self.config.ratio == "sequence":
            out["count"] = b.masked_counts()
        return out

    def _proximal(self, logp: Tensor, take: Callable[[str], Tensor]) -> Tensor | None:
        """The call's proximal logprobs (decoupled PPO), None without: the batch's, or the
        current ones detached (``current_proximal``)."""
        if self.current_proximal:
            return logp.detach()
        return take("prox") if self.batch.proximal_logprobs is not None else None

    def _behaviour_weight(self, prox: Tensor, behav: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        """``w = exp(prox - behav)`` on trained tokens (capped out: 0, or truncated at the
        cap), and the raw weight."""
        raw = torch.exp(torch.where(mask, prox - behav, 0.0))
        cap = self.config.behaviour_weight_cap
        if cap is not None and self.config.behaviour_weight_truncate:
            return torch.where(mask, raw.clamp(max=cap), torch.zeros_like(raw)), raw
        keep = mask if cap is None else mask & (raw <= cap)
        return torch.where(keep, raw, torch.zeros_like(raw)), raw

    def __call__(
        self,
        logprobs: Sequence[Tensor],
        entropies: Sequence[Tensor] | None = None,
        *,
        index: Tensor | Sequence[int] | None = None,
    ) -> Tensor:
        logp, tokens, seqs = self._select(logprobs, index, "logprobs")
        ent = None if entropies is None else self._select(entropies, index, "entropies")[0]
        return self._loss(logp, ent, tokens, seqs)

    @property
    def token_loss(self) -> Callable[[Tensor, Tensor | None, Tensor], Tensor] | None:
        """The loss on flat tokens (``tokens`` [n] positions in the batch, their logprobs and
        entropies [n]), each token's term a function of its own values: the engine's fused
        loss head takes its gradients in one pass (:mod:`treerl.engine.token_loss`). None
        for GSPO's sequence ratio, whose terms depend on the whole sequence."""
        if self.config.ratio == "sequence":
            return None
        return lambda logprob, entropy, tokens: self._loss(logprob, entropy, tokens, None)

    def _loss(self, logp: Tensor, ent: Tensor | None, tokens: Tensor | None, seqs: list[int] | None) -> Tensor:
        """The loss over flat tokens ``tokens`` (None: the whole batch in order) of the
        sequences ``seqs`` (needed by the sequence ratio alone)."""
        cfg = self.config
        f = self._fields(logp.device)

        def take(name: str) -> Tensor:
            return f[name] if tokens is None else f[name][tokens]

        mask, adv, weight = take("mask"), take("adv"), take("weight")
        zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
        prox = self._proximal(logp, take)
        old = prox if prox is not None else take("behav") if "behav" in f else logp.detach()
        if self.current_proximal:
            self.current_logprobs[slice(None) if tokens is None else tokens.to(self.current_logprobs.device)] = (
                prox.to(self.current_logprobs))
        log_ratio = torch.where(mask, logp - old, zero)
        if cfg.ratio == "sequence":
            local = torch.repeat_interleave(
                torch.arange(len(seqs), device=logp.device),
                torch.tensor([self._lengths[s] for s in seqs], device=logp.device),
                output_size=logp.shape[0],
            )
            count = f["count"][torch.as_tensor(seqs, device=logp.device)].clamp(min=1)
            seq_mean = log_ratio.new_zeros(len(seqs)).index_add(0, local, log_ratio) / count
            log_ratio = torch.where(mask, seq_mean[local], zero)
        ratio = torch.exp(log_ratio)
        clipped = ratio.clamp(1.0 - cfg.eps_low, 1.0 + cfg.eps_high)
        pg = torch.maximum(-adv * ratio, -adv * clipped)
        negative = adv < 0
        if cfg.dual_clip is not None:
            dual_capped = negative & (pg > -adv * cfg.dual_clip)
            pg = torch.where(negative, torch.minimum(pg, -adv * cfg.dual_clip), pg)
        if prox is not None:
            bw, raw_bw = self._behaviour_weight(prox, take("behav"), mask)
            pg = pg * bw
        pg_loss = (weight * torch.where(mask, pg, zero)).sum()
        loss = pg_loss
        metrics: dict[str, Tensor] = {}
        if "ref" in f:
            kl = kl_estimate(torch.where(mask, logp, zero), torch.where(mask, take("ref"), zero), cfg.kl_estimator)
            kl_loss = (weight * kl).sum()
            if cfg.kl_coef != 0.0:
                loss = loss + cfg.kl_coef * kl_loss
            metrics.update(kl_term=kl_loss, ref_kl_sum=kl.sum())
        if ent is not None or cfg.entropy_coef != 0.0:
            if ent is None:
                raise ValueError("entropy_coef is set: call the loss with entropies (engine: entropy=True)")
            ent = torch.where(mask, ent, zero)
            entropy_loss = (weight * ent).sum()
            if cfg.entropy_coef != 0.0:
                loss = loss - cfg.entropy_coef * entropy_loss
            metrics.update(entropy_term=entropy_loss, entropy_sum=ent.sum())
        with torch.no_grad():
            n = mask.sum()
            d = torch.where(mask, old - logp, zero)
            clip_low = mask & negative & (ratio < 1.0 - cfg.eps_low)
            clip_high = mask & (adv > 0) & (ratio > 1.0 + cfg.eps_high)
            metrics.update(
                tokens=n,
                pg_loss=pg_loss,
                loss=loss,
                ratio_sum=torch.where(mask, ratio, zero).sum(),
                ratio_max=torch.where(mask, ratio, -torch.inf).amax() if logp.numel() else -torch.inf + zero,
                ratio_min=torch.where(mask, ratio, torch.inf).amin() if logp.numel() else torch.inf + zero,
                clip_low_sum=clip_low.sum(),
                clip_high_sum=clip_high.sum(),
                approx_kl_sum=(torch.expm1(d) - d).sum(),
            )
            if cfg.dual_clip is not None:
                metrics["dual_clip_sum"] = (mask & dual_capped).sum()
            if prox is not None and logp.numel():
                metrics.update(bw_sum=torch.where(mask, raw_bw, zero).sum(), bw_capped=(mask & (bw < raw_bw)).sum(),
                               bw_max=torch.where(mask, raw_bw, -torch.inf).amax(),
                               bw_min=torch.where(mask, raw_bw, torch.inf).amin())
        self._accumulate(**metrics)
        return loss

    def metrics(self) -> dict[str, float]:
        """Metrics over every token seen since the last :meth:`reset_metrics` (host sync).

        Token means over trained tokens: ``clip_fraction`` (``_low``/``_high``: the
        clipped branch is active), ``dual_clip_fraction``, ``approx_kl`` (k3 of the old
        policy vs the current one), ``ratio_mean``/``_min``/``_max``, ``ref_kl`` (the
        configured estimator), ``entropy``, decoupled PPO's raw behaviour weights
        (``behaviour_weight_mean``/``_min``/``_max``, ``behaviour_weight_capped_fraction``); and
        the aggregated loss parts (summed over calls): ``loss``, ``pg_loss``, ``kl_term`` and
        ``entropy_term`` (aggregated KL and entropy, before their coefficients).
        """
        raw = self._read()
        if not raw:
            return {}
        n = max(raw["tokens"], 1.0)
        out = {k: raw[k] for k in ("loss", "pg_loss", "kl_term", "entropy_term") if k in raw}
        low, high = raw["clip_low_sum"] / n, raw["clip_high_sum"] / n
        out.update(clip_fraction=low + high, clip_fraction_low=low, clip_fraction_high=high)
        if "dual_clip_sum" in raw:
            out["dual_clip_fraction"] = raw["dual_clip_sum"] / n
        out.update(approx_kl=raw["approx_kl_sum"] / n, ratio_mean=raw["ratio_sum"] / n)
        if raw["tokens"] > 0:
            out.update(ratio_min=raw["ratio_min"], ratio_max=raw["ratio_max"])
        if "ref_kl_sum" in raw:
            out["ref_kl"] = raw["ref_kl_sum"] / n
        if "entropy_sum" in raw:
            out["entropy"] = raw["entropy_sum"] / n
        if "bw_sum" in raw and raw["tokens"] > 0:
            out.update(behaviour_weight_mean=raw["bw_sum"] / n, behaviour_weight_max=raw["bw_max"],
                       behaviour_weight_min=raw["bw_min"], behaviour_weight_capped_fraction=raw["bw_capped"] / n)
        return out


@dataclass(frozen=True)
class ValueLossConfig:
    """Critic loss settings.

    clip: clipped value loss (PPO): the prediction may move at most ``clip`` from the
        batch's ``values`` before the loss stops rewarding it; None = plain loss.
    aggregation, norm_constant: see :mod:`treerl.rl.aggregation`.
    """

    clip: float | None = None
    aggregation: str = "token-mean"
    norm_constant: float | None = None

    def __post_init__(self) -> None:
        if self.clip is not None and not self.clip > 0:
            raise ValueError(f"clip must be positive, got {self.clip}")
        check_aggregation(self.aggregation, self.norm_constant)


class ValueLoss(_SeparableLoss):
    """Critic regression to ``batch.returns``: per trained token
    ``0.5 * max((v - R)^2, (v_old + clip(v - v_old, -c, c) - R)^2)`` (just
    ``0.5 (v - R)^2`` without ``clip``), aggregated like the policy loss.

    Call: ``loss(values, *, index=None) -> scalar`` with per-sequence predictions
    ``[L_i - 1]`` (with grad), aligned like the logprobs.
    """

    def __init__(
        self,
        batch: TokenBatch,
        config: ValueLossConfig = ValueLossConfig(),
        *,
        normalisers: Normalisers | None = None,
    ):
        if batch.returns is None:
            raise ValueError("the value loss needs batch.returns")
        if config.clip is not None and batch.values is None:
            raise ValueError("the clipped value loss needs batch.values (the values at rollout time)")
        self.config = config
        super().__init__(batch, config.aggregation, config.norm_constant, normalisers)

    def _tensors(self) -> dict[str, Tensor]:
        b = self.batch
        out = {"mask": b.loss_mask, "returns": b.returns, "weight": self.weights.to(b.returns.dtype)}
        if b.values is not None:
            out["old"] = b.values
        return out

    def __call__(self, values: Sequence[Tensor], *, index: Tensor | Sequence[int] | None = None) -> Tensor:
        v, tokens, _ = self._select(values, index, "values")
        f = self._fields(v.device)

        def take(name: str) -> Tensor:
            return f[name] if tokens is None else f[name][tokens]

        mask, ret, weight = take("mask"), take("returns"), take("weight")
        zero = torch.zeros((), dtype=v.dtype, device=v.device)
        err = torch.where(mask, v - ret, zero)
        per_token = 0.5 * err * err
        metrics: dict[str, Tensor] = {}
        if self.config.clip is not None:
            old = take("old")
            v_clip = old + (v - old).clamp(-self.config.clip, self.config.clip)
            err_clip = torch.where(mask, v_clip - ret, zero)
            clipped = 0.5 * err_clip * err_clip
            metrics["clip_sum"] = (mask & (clipped > per_token)).sum()
            per_token = torch.maximum(per_token, clipped)
        loss = (weight * per_token).sum()
        with torch.no_grad():
            metrics.update(
                tokens=mask.sum(),
                loss=loss,
                value_sum=torch.where(mask, v, zero).sum(),
                sq_error_sum=(err * err).sum(),
            )
        self._accumulate(**metrics)
        return loss

    def metrics(self) -> dict[str, float]:
        """``loss`` (summed over calls), token means ``value_mean``, ``value_mse``, and
        ``clip_fraction`` (the clipped branch is active) since :meth:`reset_metrics`."""
        raw = self._read()
        if not raw:
            return {}
        n = max(raw["tokens"], 1.0)
        out = {"loss": raw["loss"], "value_mean": raw["value_sum"] / n, "value_mse": raw["sq_error_sum"] / n}
        if "clip_sum" in raw:
            out["clip_fraction"] = raw["clip_sum"] / n
        return out
