"""Speculative-decoding metrics (docs/DESIGN.md, "Metrics") from the engine's per-row
counters, and the n-gram diversity of generated text (how loop-prone a target's greedy
outputs are)."""

from __future__ import annotations

import numpy as np


def acceptance_metrics(stats, rows=None) -> dict:
  """τ, acceptance rate, per-position acceptance and the τ histogram.

  tau: token-weighted, as the serving engines and SpecForge report it: tokens committed by
  verify steps / verify steps, over every row (the cut at a stop token or at the budget
  applied; the prefill's first token is no verify step's). tau_per_prompt_mean: the mean
  over rows of each row's τ. Per-position acceptance at draft position k (1-based):
  unconditional P(n >= k) over all steps of all rows, with n the drafts a step committed;
  conditional P(n >= k | n >= k-1) over the steps that verified a draft at k with every
  earlier one accepted (exact under a varying verify length; 0.0 where none did).
  acceptance_lengths: row 0's committed tokens per verify step (when the stats carry them).
  verified_per_committed: positions sent to verification (each step's drafts plus the one
  the target always scores) per committed token; 1.0 for AR, lower is less wasted verify
  work (what a per-request verify length saves in a ragged batch).
  """
  hist = np.asarray(stats.accept_hist_BG1, np.int64)
  steps = np.asarray(stats.steps_B, np.int64)
  committed = np.asarray(stats.committed_B, np.int64)
  proposed = np.asarray(stats.proposed_B, np.int64)
  accepted = np.asarray(stats.accepted_B, np.int64)
  reached = np.asarray(stats.reached_BG, np.int64)
  passed = np.asarray(stats.passed_BG, np.int64)
  if rows is not None:
    hist, steps, committed = hist[rows], steps[rows], committed[rows]
    proposed, accepted = proposed[rows], accepted[rows]
    reached, passed = reached[rows], passed[rows]
  live = steps > 0
  total_hist = hist.sum(axis=0)
  total_steps = max(int(total_hist.sum()), 1)
  at_least = total_hist[::-1].cumsum()[::-1]          # at_least[k] = #steps with n >= k
  gamma = hist.shape[1] - 1
  uncond = [float(at_least[k] / total_steps) for k in range(1, gamma + 1)]
  reached, passed = reached.sum(axis=0), passed.sum(axis=0)
  cond = [float(p / r) if r else 0.0 for p, r in zip(passed, reached)]
  out = {
      'tau': float(committed.sum() / steps.sum()) if steps.sum() else 1.0,
      'tau_per_prompt_mean': float(np.mean(committed[live] / steps[live]))
                             if live.any() else 1.0,
      'acceptance_rate': float(accepted.sum() / proposed.sum()) if proposed.sum() else 0.0,
      'per_position_acceptance': uncond,
      'per_position_acceptance_conditional': cond,
      'tau_histogram': [int(c) for c in total_hist],   # index n: steps committing n + 1
      'position_reached': [int(c) for c in reached],
      'position_passed': [int(c) for c in passed],
      'verify_steps': int(steps.sum()),
      'verified_per_committed': float((steps.sum() + proposed.sum()) / committed.sum())
                                if committed.sum() else 1.0,
  }
  row0 = getattr(stats, 'row0_committed_S', None)
  if row0 is not None and rows is None:
    out['acceptance_lengths'] = [int(c) for c in np.asarray(row0)[:int(steps[0])]]
  return out


def distinct_ngram_ratio(sequences, n: int = 4) -> float:
  """Mean over sequences of (distinct n-grams / n-grams) of each token sequence.

  1.0 means no n-gram repeats within an output; a greedy loop of period p drives it
  towards p / length. Sequences shorter than n are skipped (nan when none is long enough).
  """
  ratios = []
  for seq in sequences:
    grams = [tuple(seq[i:i + n]) for i in range(len(seq) - n + 1)]
    if grams:
      ratios.append(len(set(grams)) / len(grams))
  return float(np.mean(ratios)) if ratios else float('nan')
