"""What the controller knows of a drafter's acceptance: per-row EMA estimates, the
expected tokens of a tier, and shadow drafts judged against the committed tokens (before a
chunk, `shadow_match`, or after it, `retrospective_match`)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np


class AcceptanceEstimate:
  """Per-row EMA counts of conditional acceptance at draft positions 1..G, given a
  proposal, and of how often a row proposes at all (an n-gram miss proposes nothing)."""

  def __init__(self, batch: int, max_gamma: int, cfg: ControllerConfig, carried=None):
    """`carried`: (α_G, π) pooled at the end of an earlier generation, the prior in place
    of (cfg.prior, 1)."""
    self.cfg = cfg
    self.carried = carried
    self.num_BG = np.zeros((batch, max_gamma))
    self.den_BG = np.zeros((batch, max_gamma))
    self.proposing_B = np.zeros(batch)   # steps with a proposal ...
    self.steps_B = np.zeros(batch)       # ... out of steps observed

  def _add(self, num_BG, den_BG, proposing_B, steps_B) -> None:
    """EMA update of the positions (and rows) that got evidence; others keep theirs."""
    g = num_BG.shape[1]
    decay = np.where(den_BG > 0, self.cfg.ema, 1.0)
    self.num_BG[:, :g] = decay * self.num_BG[:, :g] + num_BG
    self.den_BG[:, :g] = decay * self.den_BG[:, :g] + den_BG
    decay = np.where(steps_B > 0, self.cfg.ema, 1.0)
    self.proposing_B = decay * self.proposing_B + proposing_B
    self.steps_B = decay * self.steps_B + steps_B

  def observe(self, delta_hist_BG1: np.ndarray, proposing_B: np.ndarray, gamma: int) -> None:
    """Adds the accepted-count histogram of steps run at tier `gamma`, of which
    `proposing_B` had a proposal (the others accepted nothing for want of one)."""
    if gamma == 0:
      return
    h = delta_hist_BG1[:, :gamma + 1].astype(np.float64)
    steps_B = h.sum(axis=1)
    h[:, 0] -= steps_B - proposing_B                          # steps that proposed nothing
    at_least = np.cumsum(h[:, ::-1], axis=1)[:, ::-1]         # [B, γ+1]: steps with n >= j
    self._add(at_least[:, 1:], at_least[:, :-1], proposing_B, steps_B)

  def observe_shadow(self, accepted_BS: np.ndarray, judged_BS: np.ndarray,
                     proposed_BS: np.ndarray) -> None:
    """Adds S unverified proposals per row (as one observation): `accepted_BS` leading
    drafts matched the committed tokens, out of `judged_BS` comparable positions (0: no
    sample), `proposed_BS` whether there was a proposal at all."""
    j = np.arange(1, self.num_BG.shape[1] + 1)[None, None, :]
    sampled = judged_BS > 0
    judged = (j <= judged_BS[..., None]) & (proposed_BS & sampled)[..., None]
    self._add(np.sum(judged & (accepted_BS[..., None] >= j), axis=1, dtype=np.float64),
              np.sum(judged & (accepted_BS[..., None] >= j - 1), axis=1, dtype=np.float64),
              np.sum(proposed_BS & sampled, axis=1, dtype=np.float64),
              np.sum(sampled, axis=1, dtype=np.float64))

  def pooled(self):
    """(α_G, π) of the whole batch: the prior where unseen (without a carried prior,
    positions past the last verified one take its value)."""
    w = self.cfg.prior_weight
    prior_alpha, prior_rate = self.carried or (self.cfg.prior, 1.0)
    pool_den = self.den_BG.sum(0)
    alpha = (self.num_BG.sum(0) + w * prior_alpha) / (pool_den + w)
    seen = np.nonzero(pool_den > 0)[0]
    if len(seen) and self.carried is None:
      alpha[seen[-1] + 1:] = alpha[seen[-1]]
    return alpha, (self.proposing_B.sum() + w * prior_rate) / (self.steps_B.sum() + w)

  def conditional(self) -> np.ndarray:
    """α_rj [B, G]: row counts shrunk to the pooled estimate."""
    return (self.num_BG + self.cfg.prior_weight * self.pooled()[0]) / (
        self.den_BG + self.cfg.prior_weight)

  def proposal_rate(self) -> np.ndarray:
    """π_r [B]: the fraction of steps in which row r proposes, shrunk to the pooled rate
    (1 before any evidence: a drafter is assumed to draft, and its steps to cost so)."""
    w = self.cfg.prior_weight
    return (self.proposing_B + w * self.pooled()[1]) / (self.steps_B + w)


def expected_tokens(alpha_BG: np.ndarray, gamma: int, live_B: np.ndarray,
                    remaining_B: np.ndarray, rate_B=1.0) -> float:
  """Σ_{live r} min(1 + π_r Σ_{k≤γ} Π_{j≤k} α_rj, remaining_r)."""
  return float(np.sum(np.minimum(row_tokens(alpha_BG, gamma, rate_B), remaining_B) * live_B))


def row_tokens(alpha_BG: np.ndarray, gamma: int, rate_B=1.0) -> np.ndarray:
  """Expected tokens per step of each row at tier γ: 1 + π_r Σ_{k≤γ} Π_{j≤k} α_rj."""
  return 1.0 + rate_B * np.cumprod(alpha_BG[:, :gamma], axis=1).sum(axis=1)


def _match_committed(tokens_BL, num_tokens_B, draft_BG, num_proposed_B, start_B):
  """(leading drafts equal to the tokens committed from `start_B` on, positions comparable)."""
  b, g = draft_BG.shape
  j = jnp.arange(g)[None, :]
  committed_BG = tokens_BL[jnp.arange(b)[:, None],
                           jnp.clip(start_B[:, None] + j, 0, tokens_BL.shape[1] - 1)]
  judged_B = jnp.clip(num_tokens_B - start_B, 0, g)
  ok = (committed_BG == draft_BG) & (j < num_proposed_B[:, None]) & (j < judged_B[:, None])
  return jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1), judged_B


@jax.jit
def shadow_match(tokens_BL, num_tokens_B, draft_BG, num_proposed_B, start_B):
  """`_match_committed`, and whether each row proposed at all: [B, 1] samples."""
  accepted_B, judged_B = _match_committed(tokens_BL, num_tokens_B, draft_BG, num_proposed_B,
                                          start_B)
  return accepted_B[:, None], judged_B[:, None], (num_proposed_B > 0)[:, None]


@functools.partial(jax.jit, static_argnums=(0, 1))
def retrospective_match(drafter, width: int, tokens_BL, start_B, end_B):
  """Shadow samples [B, width] of `drafter` (one with `propose_from_tokens`) judged after
  the fact: what it would have proposed after each length start_B .. end_B - 1 (at most
  `width`), matched against the tokens committed since, along the walk a tier verifying
  every proposal would have taken (each step advances accepted + 1 tokens). Returns
  (accepted, judged, proposed) for `AcceptanceEstimate.observe_shadow`; judged is 0 past a
  row's walk."""

  def at(offset):
    length_B = start_B + offset
    p = drafter.propose_from_tokens(tokens_BL, length_B)
    accepted_B, judged_B = _match_committed(tokens_BL, end_B, p.tokens_BG, p.num_proposed_B,
                                            length_B)
    return accepted_B, judged_B, p.num_proposed_B > 0

  accepted_BW, judged_BW, proposed_BW = jax.vmap(at, out_axes=1)(
      jnp.arange(width, dtype=jnp.int32))
  rows = jnp.arange(tokens_BL.shape[0])

  def step(s, carry):
    at_B, samples = carry
    i_B = jnp.minimum(at_B, width - 1)
    live_B = (at_B < width) & (judged_BW[rows, i_B] > 0)
    sample = (accepted_BW[rows, i_B], judged_BW[rows, i_B], proposed_BW[rows, i_B])
    samples = tuple(out.at[:, s].set(jnp.where(live_B, x, jnp.zeros_like(x)))
                    for out, x in zip(samples, sample))
    return jnp.where(live_B, at_B + sample[0] + 1, width), samples

  zeros = jnp.zeros_like(judged_BW)
  return jax.lax.fori_loop(0, width, step, (jnp.zeros_like(start_B), (
      zeros, zeros, zeros.astype(bool))))[1]
