"""Speed of light for τ: the Pankratov–Alistarh bound at T > 0, an oracle ceiling at T = 0.

T > 0, `sol_bound`. Pankratov & Alistarh, "Speculative Decoding Speed-of-Light: Optimal
Lower Bounds via Branching Random Walks" (arXiv 2512.11718; EACL 2026 long paper 301,
pp. 6404-6418), abstract: for any *deterministic* speculative generation algorithm whose
verifier checks P tokens in parallel, the expected number of tokens successfully predicted
per speculative iteration satisfies

    E[X] <= (μ + μ₂) · log P / μ² + O(1),

μ the expected entropy of the verifier's output distribution and μ₂ its "expected second
log-moment" (arXiv 2512.11718; EACL: "this entropy's second moment"). The often-quoted
log P / μ is only the first term of this bound, not a bound. We take
μ = mean of H_t = -Σ p log p (nats) and μ₂ = mean of M_t = Σ p (log p)² over the generated
positions of the target's own AR outputs at the run's temperature, with p the distribution
the verifier samples from (temperature, top-k, top-p applied); M_t >= H_t² (Jensen), so
this reading of μ₂ is the larger, safer one. For a chain of γ drafts, P = γ + 1 and

    sol_bound = min(P, 1 + (μ + μ₂) · ln P / μ²):

the 1 adds the verifier's own token (τ counts it, E[X] may not), the cap is τ's trivial
limit and the O(1) is dropped. It covers drafters whose proposals are deterministic given
the context (one-hot q: n-gram, suffix, DFlash, greedy MTP). Drafters that sample their
proposals from q and are verified against the full q fall outside it: rejection sampling
couples the verifier's sample to the draft, and q = p accepts everything (τ = P).

T = 0, `greedy_oracle_ceiling`. The target is a point mass and the bound says nothing.
The ceiling is the τ of an oracle that proposes the target's own greedy continuation with
the same verify width: every verify step commits min(P, remaining) tokens, so it follows
from the AR outputs' lengths alone. Greedy speculative outputs equal AR's, so no drafter
with that width can beat it.
"""

from __future__ import annotations

import functools
import math
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspec.sampling import SamplingSpec, processed_probs


@functools.partial(jax.jit, static_argnums=(0, 2))
def _entropy_moments(graphdef, params, spec: SamplingSpec, tokens_BL, temperature, top_p):
  """(H, M) per position [B, L] of the distribution predicting the next token."""
  target = nnx.merge(graphdef, params)
  logits = target(tokens_BL).logits_BTV
  b, t, v = logits.shape
  p = processed_probs(logits.reshape(b * t, v), spec, temperature, top_p).reshape(b, t, v)
  logp = jnp.where(p > 0, jnp.log(jnp.where(p > 0, p, 1.0)), 0.0)
  h = -jnp.sum(p * logp, axis=-1)
  return h, jnp.sum(p * logp * logp, axis=-1)


class EntropyMeter:
  """Accumulates per-token entropy moments over the generated positions of AR runs at the
  run's temperature (T > 0)."""

  def __init__(self, graphdef, params, temperature: float, top_k: int, top_p: float):
    if not temperature > 0:
      raise ValueError(f'EntropyMeter needs temperature > 0 (the bound says nothing at '
                       f'T = 0; use greedy_oracle_ceiling), got {temperature}')
    self.temperature = temperature
    self._spec = SamplingSpec(greedy=False, top_k=int(top_k), use_top_p=top_p < 1.0)
    self._top_p = top_p
    self._graphdef, self._params = graphdef, params
    self.sums = np.zeros(3)      # Σ H, Σ M, Σ H²
    self.count = 0

  def add(self, state, rows: int) -> None:
    """Adds the generated positions of the first `rows` rows of a final decode state."""
    tokens, lens, nums = jax.device_get((state.tokens_BL, state.prompt_len_B,
                                         state.num_tokens_B))
    h, m = jax.device_get(_entropy_moments(self._graphdef, self._params, self._spec,
                                           jnp.asarray(tokens), self.temperature,
                                           self._top_p))
    for b in range(rows):
      sl = slice(lens[b] - 1, nums[b] - 1)   # logits at t predict token t + 1
      self.sums += [h[b, sl].sum(), m[b, sl].sum(), (h[b, sl] ** 2).sum()]
      self.count += nums[b] - lens[b]

  def moments(self) -> dict:
    mu, mu2, h2 = self.sums / max(self.count, 1)
    return {'entropy_mu': float(mu), 'entropy_mu2': float(mu2), 'entropy_h2': float(h2),
            'entropy_tokens': int(self.count), 'sol_temperature': self.temperature}


def sol_bound(mu: float, mu2: float, verify_width: int) -> float:
  """min(P, 1 + (μ + μ₂) ln P / μ²) for P = verify_width (module docstring)."""
  if verify_width <= 1:
    return 1.0
  if mu <= 0:
    return float(verify_width)
  return float(min(verify_width, 1.0 + (mu + mu2) * math.log(verify_width) / mu ** 2))


def greedy_oracle_ceiling(outputs: Sequence[Sequence[int]], verify_width: int,
                          prefill_tokens: int = 1) -> float:
  """Token-weighted τ of an oracle proposing the target's own greedy continuation.

  outputs: the AR-generated ids of each prompt (stop token included, as committed);
  verify_width: P = drafts + 1, the most tokens one verify step commits (the largest
  width used when it varies); prefill_tokens: tokens each prompt gets from the prefill,
  which is no verify step. Each verify step commits min(P, remaining) tokens, so the
  ceiling is Σ tokens / Σ ceil(tokens / P) over the prompts; 1.0 with no verify step.
  """
  if verify_width < 1:
    raise ValueError(f'verify_width must be >= 1, got {verify_width}')
  tokens = [max(len(ids) - prefill_tokens, 0) for ids in outputs]
  steps = sum(-(-n // verify_width) for n in tokens)
  return sum(tokens) / steps if steps else 1.0


def speed_of_light(temperature: float, verify_width: int, entropy: Optional[dict] = None,
                   ar_outputs: Optional[Sequence[Sequence[int]]] = None,
                   sampled_proposals: bool = False) -> dict:
  """A benchmark row's ceilings; None where one does not apply.

  sol_bound: T > 0 only, from `entropy` (`EntropyMeter.moments()` at that temperature), and
  not for drafters that sample their proposals (module docstring). greedy_oracle_ceiling:
  T = 0 only, from the AR outputs of the same prompts.
  """
  bound = ceiling = None
  if temperature > 0:
    if entropy is None:
      raise ValueError('speed_of_light at T > 0 needs the entropy moments')
    if not sampled_proposals:
      bound = sol_bound(entropy['entropy_mu'], entropy['entropy_mu2'], verify_width)
  else:
    if ar_outputs is None:
      raise ValueError('speed_of_light at T = 0 needs the AR outputs')
    ceiling = greedy_oracle_ceiling(ar_outputs, verify_width)
  return {'sol_bound': bound, 'greedy_oracle_ceiling': ceiling}
