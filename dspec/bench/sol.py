"""Speed-of-light bound on τ from the target's measured per-token entropy.

Pankratov & Alistarh (arXiv 2512.11718; EACL 2026), `reference/serving_anchors.md` §5: for
any deterministic speculative algorithm whose verifier checks P tokens per step, the
expected number of accepted tokens per step is at most

    E[X] <= (μ + μ₂) · ln P / μ² + O(1),

μ = mean over positions of the verifier's next-token entropy H_t = −Σ p log p (nats),
μ₂ = mean of M_t = Σ p (log p)² (the arXiv "second log-moment"; the EACL wording, the mean
of H_t², is reported as `sol_bound_eacl`). Both are measured by teacher-forcing the target
on its own AR outputs (prompt + continuation) at every generated position, with p the
distribution the verifier samples from (temperature, top-k, top-p applied).

What we report per row (a chain of γ drafts, so P = γ + 1):

    sol_bound = min(P, 1 + (μ + μ₂) · ln P / μ²)

The 1 adds the bonus token (τ counts it, E[X] does not), the cap is τ's trivial limit, and
the O(1) term is dropped, so this is the bound's leading-order estimate, not a strict
upper bound. At T = 0 the verifier is a point mass and the bound says nothing; there μ and
μ₂ are measured on the T = 1 distribution along the greedy outputs (`sol_temperature`),
which gauges how predictable the text is for the model.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspec.decoding.sampling import SamplingSpec, processed_probs


@functools.partial(jax.jit, static_argnums=(0, 2))
def _entropy_moments(graphdef, params, spec: SamplingSpec, tokens_BL, temperature, top_p):
  """(H, M, H²) per position [B, L] of the distribution predicting the next token."""
  target = nnx.merge(graphdef, params)
  logits = target(tokens_BL).logits_BTV
  b, t, v = logits.shape
  p = processed_probs(logits.reshape(b * t, v), spec, temperature, top_p).reshape(b, t, v)
  logp = jnp.where(p > 0, jnp.log(jnp.where(p > 0, p, 1.0)), 0.0)
  h = -jnp.sum(p * logp, axis=-1)
  return h, jnp.sum(p * logp * logp, axis=-1)


class EntropyMeter:
  """Accumulates per-token entropy moments over the generated positions of AR runs."""

  def __init__(self, graphdef, params, temperature: float, top_k: int, top_p: float):
    self.temperature = temperature if temperature > 0 else 1.0
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
