"""EAGLE-3 drafter (arXiv 2503.01840; SafeAILab/EAGLE `cnets.py`): fused target
taps, one (or a few) decoder layers over [embedding ; hidden], its own norm and head.

Entry p of the draft sequence reads the token t_{p+1} and a hidden g:

  g = fc(concat(taps of target layers at p))                 (committed positions)
  x = Layer_0( [input_layernorm(emb(t_{p+1})) ; hidden_norm(g)] , residual = g )
  x = Layers_1..n-1(x);   logits = lm_head(norm(x))  -> predicts t_{p+2}

Chained drafting feeds the entry's own output back as the next entry's g (`next_hidden`:
x, or norm(x) with `norm_output`), at RoPE position p (the target's positions). The first
layer's q/k/v read the 2H concatenation; with `norm_before_residual` the residual is
hidden_norm(g). `norm_before_fc` applies one RMSNorm over the concatenated taps,
`fc_norm` one per tap (speculators' options, mutually exclusive).

The embedding is the target's (never copied) unless `own_embedding` (speculators'
`embed_requires_grad`: a trained embedding the checkpoint carries); the head is the
drafter's own, over a reduced draft vocabulary `draft_vocab` (target ids, sorted; () = the
full vocabulary), initialised from the target's head rows. speculators' d2t / t2d maps are
derived from it.

Training-time test (`ttt_logits`, speculators' `Eagle3DraftModel.forward` semantics): step
s at index t reads token x_{t+1+s} and hidden = step s-1's output at t (step 0: the fused
taps at t), at position t+s; it attends to step-0 keys at indices <= t and to its own
index's keys of steps 1..s. That is exactly the context of a chained draft entry. A
'sliding_attention' layer (speculators' default for trained drafters) sees only the step-0
keys at indices > t - W (`window_mask`), for every step of index t.

Taps: a tap id -1 reads the target's embedding output (speculators' aux hidden state 0).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Tuple

import jax.numpy as jnp
from flax import nnx

from dspec import checkpoint
from dspec.models.config import DictConfig, TransformerConfig
from dspec.models.draft_vocab import DraftVocab
from dspec.models.layers import (MLP, Attention, DecoderLayer, RMSNorm, attend,
                                 rope_tables)
from dspec.models.transformer import final_normed_taps

CHECKPOINT_KIND = 'eagle3'
LAYER_TYPES = ('full_attention', 'sliding_attention')
_INIT = nnx.initializers.normal(stddev=0.02)


def default_target_layer_ids(num_target_layers: int) -> Tuple[int, ...]:
  """EAGLE-3's taps: the inputs of layers 2, L//2 and L-3 (speculators' hidden-state ids),
  i.e. the outputs of layers 1, L//2-1, L-4, clipped to [0, L-1]."""
  big_l = num_target_layers
  return tuple(min(max(i, 0), big_l - 1) for i in (1, big_l // 2 - 1, big_l - 4))


@dataclasses.dataclass(frozen=True)
class Eagle3Config(DictConfig):
  """Static EAGLE-3 architecture (the layer shapes come from the drafter's target_cfg).

  target_layer_ids: 0-based target layers whose residual outputs are fused, in fc order
    (-1: the embedding output).
  final_tap_normed: a tap of the target's last layer reads its post-final-norm hidden
    (HF's hidden_states[L], which speculators' aux id L names).
  ttt_steps: the draft length it was trained for (the drafter's num_draft 0).
  own_embedding: the drafter embeds tokens with its own `embed_tokens` [V, H] instead of
    the target's.
  layer_types: () (every draft layer full attention) or 'full_attention' /
    'sliding_attention' per draft layer; sliding_window: W of the sliding layers (None:
    they attend fully).
  """

  target_layer_ids: Tuple[int, ...]
  num_layers: int = 1
  draft_vocab: Tuple[int, ...] = ()
  norm_before_residual: bool = False
  norm_before_fc: bool = False
  fc_norm: bool = False
  norm_output: bool = False
  final_tap_normed: bool = False
  ttt_steps: int = 3
  own_embedding: bool = False
  layer_types: Tuple[str, ...] = ()
  sliding_window: Optional[int] = None

  def __post_init__(self):
    object.__setattr__(self, 'target_layer_ids', tuple(int(i) for i in self.target_layer_ids))
    object.__setattr__(self, 'draft_vocab', tuple(int(i) for i in self.draft_vocab))
    object.__setattr__(self, 'layer_types', tuple(self.layer_types))
    if self.layer_types and (len(self.layer_types) != self.num_layers or any(
        t not in LAYER_TYPES for t in self.layer_types)):
      raise ValueError(f'eagle3 layer_types must name one of {LAYER_TYPES} per layer '
                       f'({self.num_layers}), got {list(self.layer_types)}')
    if self.sliding_window is not None and self.sliding_window < 1:
      raise ValueError(f'eagle3 sliding_window must be None or >= 1, got '
                       f'{self.sliding_window}')
    if not self.target_layer_ids:
      raise ValueError('eagle3 target_layer_ids must not be empty')
    if self.num_layers < 1 or self.ttt_steps < 1:
      raise ValueError(f'eagle3 needs num_layers >= 1 and ttt_steps >= 1, got '
                       f'{self.num_layers}, {self.ttt_steps}')
    if self.norm_before_fc and self.fc_norm:
      raise ValueError('eagle3 norm_before_fc and fc_norm are mutually exclusive')
    if list(self.draft_vocab) != sorted(set(self.draft_vocab)):
      raise ValueError('eagle3 draft_vocab must be sorted distinct token ids')

  def to_dict(self) -> dict:
    d = dataclasses.asdict(self)
    d['target_layer_ids'] = list(d['target_layer_ids'])
    d['draft_vocab'] = list(d['draft_vocab'])
    d['layer_types'] = list(d['layer_types'])
    return d

  def window_mask(self, i: int, q_index, kv_index):
    """Whether draft layer i lets index `q_index` see the step-0 entry at `kv_index`
    (broadcast; True everywhere for a full-attention layer)."""
    if not self.layer_types or self.layer_types[i] != 'sliding_attention' or \
        self.sliding_window is None:
      return jnp.bool_(True)
    return kv_index > q_index - self.sliding_window


class Eagle3FirstLayer(nnx.Module):
  """A decoder layer whose q/k/v read [input_layernorm(emb) ; hidden_norm(g)] (2H)."""

  def __init__(self, cfg: TransformerConfig, norm_before_residual: bool, *,
               rngs: nnx.Rngs):
    d, pdt = cfg.embed_dim, cfg.param_dtype
    self.norm_before_residual = norm_before_residual
    self.input_layernorm = RMSNorm(d, eps=cfg.norm_eps, param_dtype=pdt)
    self.hidden_norm = RMSNorm(d, eps=cfg.norm_eps, param_dtype=pdt)
    self.self_attn = Attention(cfg, rngs=rngs)
    for name, width in (('q_proj', cfg.num_heads), ('k_proj', cfg.num_kv_heads),
                        ('v_proj', cfg.num_kv_heads)):
      setattr(self.self_attn, name, nnx.Linear(
          2 * d, width * cfg.head_dim, use_bias=False, kernel_init=_INIT, dtype=cfg.dtype,
          param_dtype=pdt, rngs=rngs))
    self.post_attention_layernorm = RMSNorm(d, eps=cfg.norm_eps, param_dtype=pdt)
    self.mlp = MLP(cfg, rngs=rngs)

  def __call__(self, e_BTD, g_BTD, sin, cos, kv_fn):
    hidden = self.hidden_norm(g_BTD)
    residual = hidden if self.norm_before_residual else g_BTD
    h = jnp.concatenate([self.input_layernorm(e_BTD), hidden], axis=-1)
    q = self.self_attn.project_q(h, sin, cos)
    k, v = self.self_attn.project_kv(h, sin, cos)
    x = residual + self.self_attn.output(attend(q, *kv_fn(k, v)))
    return x + self.mlp(self.post_attention_layernorm(x))


class Eagle3Model(DraftVocab, nnx.Module):
  """EAGLE-3 weights for a target of shape `target_cfg` (width, vocabulary, depth; the
  draft layers take its heads / head_dim / MLP width / RoPE)."""

  checkpoint_kind = CHECKPOINT_KIND

  def __init__(self, cfg: Eagle3Config, target_cfg: TransformerConfig, *,
               rngs: nnx.Rngs):
    for i in cfg.target_layer_ids:
      if not -1 <= i < target_cfg.num_layers:
        raise ValueError(f'eagle3 tap layer {i} out of range for a '
                         f'{target_cfg.num_layers}-layer target')
    if cfg.draft_vocab and not 0 <= cfg.draft_vocab[0] <= cfg.draft_vocab[-1] < \
        target_cfg.vocab_size:
      raise ValueError(f'eagle3 draft_vocab ids must lie in [0, {target_cfg.vocab_size})')
    self.cfg = cfg
    self.target_cfg = target_cfg
    self.layer_cfg = dataclasses.replace(target_cfg, num_layers=cfg.num_layers)
    d, n, pdt = target_cfg.embed_dim, len(cfg.target_layer_ids), target_cfg.param_dtype
    eps = target_cfg.norm_eps
    if cfg.own_embedding:
      self.embed_tokens = nnx.Param(_INIT(rngs.params(), (target_cfg.vocab_size, d), pdt))
    if cfg.norm_before_fc:
      self.input_norm = RMSNorm(n * d, eps=eps, param_dtype=pdt)
    if cfg.fc_norm:
      self.fc_norm = nnx.List([RMSNorm(d, eps=eps, param_dtype=pdt) for _ in range(n)])
    self.fc = nnx.Linear(n * d, d, use_bias=False, kernel_init=_INIT,
                         dtype=target_cfg.dtype, param_dtype=pdt, rngs=rngs)
    self.layers = nnx.List(
        [Eagle3FirstLayer(self.layer_cfg, cfg.norm_before_residual, rngs=rngs)] +
        [DecoderLayer(self.layer_cfg, rngs=rngs) for _ in range(cfg.num_layers - 1)])
    self.norm = RMSNorm(d, eps=eps, param_dtype=pdt)
    self.lm_head = nnx.Linear(d, self.draft_vocab_size, use_bias=False, kernel_init=_INIT,
                              dtype=target_cfg.dtype, param_dtype=pdt, rngs=rngs)

  @property
  def draft_vocab_size(self) -> int:
    return len(self.cfg.draft_vocab) or self.target_cfg.vocab_size

  def init_head_from(self, target) -> None:
    """Copies the target's head rows of the draft vocabulary into `lm_head`."""
    ids = jnp.asarray(self.cfg.draft_vocab, jnp.int32) if self.cfg.draft_vocab else None
    eye = jnp.eye(self.target_cfg.embed_dim, dtype=jnp.float32)[None]
    self.lm_head.kernel[...] = target.logits(eye, ids)[0].astype(self.lm_head.kernel.dtype)

  # ---------------------------------------------------------------------- forward parts

  def fuse(self, taps_BTND, target=None):
    """Tapped target features [B, T, n, H] -> g [B, T, H]."""
    if self.cfg.final_tap_normed:
      taps_BTND = final_normed_taps(taps_BTND, self.cfg.target_layer_ids,
                                    self.target_cfg.num_layers, target, 'eagle3')
    taps_BTND = taps_BTND.astype(self.target_cfg.dtype)
    if self.cfg.fc_norm:
      taps_BTND = jnp.stack([norm(taps_BTND[:, :, j]) for j, norm in
                             enumerate(self.fc_norm)], axis=2)
    b, t, n, d = taps_BTND.shape
    x = taps_BTND.reshape(b, t, n * d)
    if self.cfg.norm_before_fc:
      x = self.input_norm(x)
    return self.fc(x)

  def embed(self, target, tokens_BT):
    """Token embeddings [B, T, H]: the drafter's own (`own_embedding`) or the target's."""
    if not self.cfg.own_embedding:
      return target.embed(tokens_BT)
    return jnp.take(self.embed_tokens[...], tokens_BT, axis=0).astype(self.target_cfg.dtype)

  def block(self, target, g_BTD, tokens_BT, positions_BT,
            kv_fn_of: Callable[[int], Callable]):
    """Raw output x [B, T, H] of the layers; `kv_fn_of(i)` is layer i's kv_fn."""
    sin, cos = rope_tables(positions_BT, self.layer_cfg.head_dim, self.layer_cfg.rope_theta)
    x = self.layers[0](self.embed(target, tokens_BT), g_BTD.astype(self.target_cfg.dtype),
                       sin, cos, kv_fn_of(0))
    for i, layer in enumerate(self.layers[1:], start=1):
      x = layer(x, sin, cos, kv_fn_of(i))
    return x

  def logits(self, x_BTD):
    """Draft-vocabulary logits [B, T, V'] (fp32) of raw outputs."""
    return self.lm_head(self.norm(x_BTD)).astype(jnp.float32)

  def next_hidden(self, x_BTD):
    """What an entry hands to the next chained entry."""
    return self.norm(x_BTD) if self.cfg.norm_output else x_BTD

  def ttt_logits(self, target, g_BTD, tokens_BS, steps: int, own_drafts: bool = False):
    """Training-time test: logits [B, T, V'] of each of `steps` steps. tokens_BS holds
    x_0.. (S >= T); step s at index t reads x_{t+1+s} (0 past the end) and predicts
    x_{t+2+s}. Indices whose inputs run past the data are the caller's to mask. With
    `own_drafts`, step s >= 1 reads step s−1's argmax at its index instead: index t then
    is the T = 0 decode chain from the committed tokens x_0..x_{t+1}."""
    b, t, _ = g_BTD.shape
    pos_T = jnp.arange(t, dtype=jnp.int32)
    causal_TT = pos_T[None, :] <= pos_T[:, None]
    causal_BTT = [jnp.broadcast_to(causal_TT & self.cfg.window_mask(
        i, pos_T[:, None], pos_T[None, :]), (b, t, t)) for i in range(len(self.layers))]
    first = [None for _ in self.layers]   # per layer: step 0's (k, v), attended causally
    later = [[] for _ in self.layers]     # per layer: steps 1..s's (k, v), on the diagonal
    out, g = [], g_BTD
    for s in range(steps):
      if own_drafts and s:
        tokens_BT = self.token_ids(jnp.argmax(out[-1], axis=-1))
      else:
        tokens_BT = tokens_BS[:, 1 + s:1 + s + t]
        tokens_BT = jnp.pad(tokens_BT, ((0, 0), (0, t - tokens_BT.shape[1])))

      def kv_fn_of(i, s=s):
        def kv_fn(k_new, v_new):
          if s == 0:
            first[i] = (k_new, v_new)
            return k_new, v_new, causal_BTT[i]
          later[i].append((k_new, v_new))
          return (*first[i], causal_BTT[i], (jnp.stack([k for k, _ in later[i]], axis=2),
                                          jnp.stack([v for _, v in later[i]], axis=2)))
        return kv_fn

      x = self.block(target, g, tokens_BT, jnp.broadcast_to(pos_T + s, (b, t)), kv_fn_of)
      out.append(self.logits(x))
      g = self.next_hidden(x)
    return out


def save_eagle3(path, model: Eagle3Model, *, storage_dtype: str = 'float32',
                force: bool = False, extra: Optional[dict] = None) -> None:
  """`checkpoint.save_model` with the EAGLE-3 and target configs (kind 'eagle3')."""
  checkpoint.save_model(path, model, kind=CHECKPOINT_KIND,
                        config={CHECKPOINT_KIND: model.cfg.to_dict(),
                                'target': model.target_cfg.to_dict()},
                        storage_dtype=storage_dtype, extra=extra, force=force)
