"""DSpark: the DFlash backbone with a semi-autoregressive Markov head and a confidence head
(`reference/dflash.md` §7; speculators' `models/dspark`, SpecForge's `draft/dspark.py`).

Block. Anchor-first and all-predicting (speculators' `sample_from_anchor=True`): the block
[anchor, MASK×(B−1)] sits at positions a..a+B−1 and slot k predicts the token at a+k+1, so
one block of B proposes B drafts. The backbone (fusion, KV injection, per-layer masks) is
`DFlashModel`'s, unchanged.

Markov head. A rank-r logit bias from the previous token of the slot, x_{k−1} (x_{−1} =
the anchor, then the slot's predecessor draft), added to the backbone's draft logits:

  vanilla  bias = W2 · W1[x]
  gated    bias = W2 · (σ(G [h_k; W1[x]] + g) ⊙ W1[x])
  rnn      z = [s; W1[x]; h_k] → (gate, cand, out) = J z + j;
           s ← σ(gate) ⊙ s + (1 − σ(gate)) ⊙ tanh(cand) (s = 0 before slot 0);
           bias = W2 · tanh(out)

with W1 [V, r], W2 [r → V]. Drafting applies it slot by slot from the anchor (`walk`),
greedy or sampled; the sampled distribution q (the biased logits through the target's
temperature / top-k / top-p) is handed to rejection sampling, so sampling stays exactly
lossless. Training uses teacher forcing (x = the data's token at a+k).

Confidence head. c_k = σ(wᵀ[h_k; W1[x_{k−1}]] + b) (without the W1 part when
`confidence_head_with_markov` is off): the probability that slot k is accepted given the
prefix was. The calibrated prefix survival S_k = Π_{j≤k} σ(z_j / T_j) uses per-slot
temperatures fitted on held-out data (sequential temperature scaling,
`dspec.training.dspark_task`) and stored with the checkpoint: `confidence_temperatures`
for sampled acceptance (the head's own target), `greedy_confidence_temperatures` for
greedy acceptance (draft argmax = target argmax), used at T = 0.

From scratch W2 is zero, so an untrained head is exactly DFlash's logits.

Formats: a dspec checkpoint (kind 'dspark') or speculators' DSpark form (config.json with
`speculators_model_type: "dspark"`, `markov_rank`, `markov_head_type`,
`enable_confidence_head`, `confidence_head_with_markov`, `sample_from_anchor`; tensors
`markov_head.markov_w1.weight` [V, r], `markov_head.markov_w2.weight` [V, r],
`markov_head.gate_proj.{weight,bias}`, `markov_head.joint_proj.{weight,bias}`,
`confidence_head.proj.{weight,bias}` beside the DFlash body). dspec writes the calibration
as the extra keys `dspec_confidence_temperatures` / `dspec_greedy_confidence_temperatures`.
"""

from __future__ import annotations

import dataclasses
import os
from typing import NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp
from flax import nnx
from safetensors.flax import save_file

from dspec.checkpoint import CheckpointError, leaf_paths
from dspec.sampling import processed_probs, sample_from_probs
from dspec.files import write_atomic, write_json_atomic
from dspec.models import drafter_formats as formats
from dspec.models.config import TransformerConfig
from dspec.models.dflash import DFlashConfig, DFlashModel, load_dspec_checkpoint

CHECKPOINT_KIND = 'dspark'
HEAD_TYPES = ('vanilla', 'gated', 'rnn')
_INIT = nnx.initializers.normal(stddev=0.02)


@dataclasses.dataclass(frozen=True)
class DSparkConfig(DFlashConfig):
  """DFlashConfig plus the Markov head (rank r, variant), the confidence head and its
  calibration. `block_size` is B = the drafts of one block (anchor-first)."""

  markov_rank: int = 256
  markov_head_type: str = 'vanilla'
  enable_confidence_head: bool = True
  confidence_head_with_markov: bool = True
  sample_from_anchor: bool = True
  confidence_temperatures: Tuple[float, ...] = ()
  greedy_confidence_temperatures: Tuple[float, ...] = ()

  def __post_init__(self):
    super().__post_init__()
    for name in ('confidence_temperatures', 'greedy_confidence_temperatures'):
      temps = tuple(float(t) for t in getattr(self, name))
      object.__setattr__(self, name, temps)
      if temps and (len(temps) != self.block_size or min(temps) <= 0):
        raise ValueError(f'dspark {name} must be {self.block_size} positive values (one per '
                         f'slot) or empty, got {list(temps)}')
    if self.draft_vocab:
      raise ValueError('dspark needs the full vocabulary (draft_vocab must be empty)')
    if not self.sample_from_anchor:
      raise ValueError('dspark sample_from_anchor must be true (anchor-first blocks; a '
                       'block whose slot 0 only carries the anchor is DFlash)')
    if self.markov_rank < 0:
      raise ValueError(f'dspark markov_rank must be >= 0, got {self.markov_rank}')
    if self.markov_head_type not in HEAD_TYPES:
      raise ValueError(f'dspark markov_head_type must be one of {HEAD_TYPES}, got '
                       f'{self.markov_head_type!r}')
    if self.enable_confidence_head and self.confidence_head_with_markov and \
        self.markov_rank == 0:
      raise ValueError('dspark markov_rank is 0 but the confidence head reads the Markov '
                       'embedding (confidence_head_with_markov): set markov_rank > 0 or '
                       'confidence_head_with_markov=False')

  def to_dict(self) -> dict:
    d = super().to_dict()
    d['confidence_temperatures'] = list(self.confidence_temperatures)
    d['greedy_confidence_temperatures'] = list(self.greedy_confidence_temperatures)
    return d

  @property
  def confidence_input_dim_extra(self) -> int:
    return self.markov_rank if self.confidence_head_with_markov else 0


class _Table(nnx.Module):
  """An embedding table whose parameter is named `weight` (speculators' nn.Embedding)."""

  def __init__(self, rows: int, cols: int, cfg: TransformerConfig, *, rngs: nnx.Rngs):
    self.weight = nnx.Param(nnx.initializers.normal(stddev=0.01)(
        rngs.params(), (rows, cols), cfg.param_dtype))


class MarkovHead(nnx.Module):
  """W1 [V, r], W2 [r → V] and the gated / rnn variants' projection."""

  def __init__(self, vocab: int, rank: int, dim: int, head_type: str, cfg: TransformerConfig,
               *, rngs: nnx.Rngs):
    self.head_type = head_type
    self.rank = rank
    linear = lambda i, o, **kw: nnx.Linear(i, o, dtype=jnp.float32,
                                           param_dtype=cfg.param_dtype, rngs=rngs, **kw)
    self.markov_w1 = _Table(vocab, rank, cfg, rngs=rngs)
    self.markov_w2 = linear(rank, vocab, use_bias=False,
                            kernel_init=nnx.initializers.zeros_init())
    if head_type == 'gated':
      self.gate_proj = linear(dim + rank, rank, kernel_init=_INIT)
    elif head_type == 'rnn':
      self.joint_proj = linear(2 * rank + dim, 3 * rank, kernel_init=_INIT)

  def embed(self, tokens):
    """W1 rows of the previous tokens [..., r] (fp32)."""
    return jnp.take(self.markov_w1.weight[...], tokens, axis=0).astype(jnp.float32)

  def step(self, state_BR, emb_BR, hidden_BD):
    """(new rnn state, bias [.., V]) of one slot; vanilla/gated ignore the state."""
    hidden_BD = hidden_BD.astype(jnp.float32)
    if self.head_type == 'vanilla':
      latent = emb_BR
    elif self.head_type == 'gated':
      latent = jax.nn.sigmoid(self.gate_proj(jnp.concatenate([hidden_BD, emb_BR], -1))) * \
          emb_BR
    else:
      gate, cand, out = jnp.split(
          self.joint_proj(jnp.concatenate([state_BR, emb_BR, hidden_BD], -1)), 3, axis=-1)
      gate = jax.nn.sigmoid(gate)
      state_BR = gate * state_BR + (1.0 - gate) * jnp.tanh(cand)
      latent = jnp.tanh(out)
    return state_BR, self.markov_w2(latent)

  def block_bias(self, emb_BTR, hidden_BTD):
    """Teacher-forced bias [B, T, V] of one block per row (rnn state from zero at slot 0)."""
    if self.head_type != 'rnn':
      return self.step(None, emb_BTR, hidden_BTD)[1]
    state = jnp.zeros(emb_BTR.shape[:1] + (self.rank,), jnp.float32)
    out = []
    for k in range(emb_BTR.shape[1]):
      state, bias = self.step(state, emb_BTR[:, k], hidden_BTD[:, k])
      out.append(bias)
    return jnp.stack(out, axis=1)


class ConfidenceHead(nnx.Module):
  """proj: [h; W1[x]] (or h) → one acceptance logit."""

  def __init__(self, dim: int, cfg: TransformerConfig, *, rngs: nnx.Rngs):
    self.proj = nnx.Linear(dim, 1, dtype=jnp.float32, param_dtype=cfg.param_dtype,
                           kernel_init=_INIT, rngs=rngs)

  def __call__(self, features):
    return self.proj(features)[..., 0]


class DSparkWalk(NamedTuple):
  """One drafted block: tokens [B, G], confidence logits [B, G] (None without the head)
  and, when sampled, the processed biased distribution q [B, G, V] (None at T = 0)."""

  tokens_BG: jnp.ndarray
  conf_logits_BG: Optional[jnp.ndarray]
  q_BGV: Optional[jnp.ndarray]


class DSparkModel(DFlashModel):
  """DFlashModel plus the Markov head (markov_rank > 0) and the confidence head."""

  checkpoint_kind = CHECKPOINT_KIND

  def __init__(self, cfg: DSparkConfig, target_cfg: TransformerConfig, *, rngs: nnx.Rngs):
    super().__init__(cfg, target_cfg, rngs=rngs)
    d = target_cfg.embed_dim
    self.markov_head = (MarkovHead(target_cfg.vocab_size, cfg.markov_rank, d,
                                   cfg.markov_head_type, target_cfg, rngs=rngs)
                        if cfg.markov_rank else None)
    self.confidence_head = (ConfidenceHead(d + cfg.confidence_input_dim_extra, target_cfg,
                                           rngs=rngs)
                            if cfg.enable_confidence_head else None)

  def _embed_prev(self, prev):
    return None if self.markov_head is None else self.markov_head.embed(prev)

  def _confidence(self, hidden, emb):
    if self.confidence_head is None:
      return None
    feats = hidden.astype(jnp.float32)
    if self.cfg.confidence_head_with_markov:
      feats = jnp.concatenate([feats, emb], axis=-1)
    return self.confidence_head(feats)

  def heads(self, target, hidden_BTD, prev_BT):
    """Teacher-forced (biased logits [B, T, V] fp32, confidence logits [B, T] or None) of
    blocks of `cfg.block_size` slots laid out along T, given each slot's previous token."""
    logits = self.draft_logits(target, hidden_BTD).astype(jnp.float32)
    emb = self._embed_prev(prev_BT)
    if self.markov_head is not None:
      b, t, _ = hidden_BTD.shape
      n, big_b = t // self.cfg.block_size, self.cfg.block_size
      bias = self.markov_head.block_bias(emb.reshape(b * n, big_b, -1),
                                         hidden_BTD.reshape(b * n, big_b, -1))
      logits = logits + bias.reshape(logits.shape)
    return logits, self._confidence(hidden_BTD, emb)

  def walk(self, target, hidden_BGD, anchor_B, *, sampling=None, temperature=None,
           top_p=None, key=None) -> DSparkWalk:
    """Drafts the block slot by slot from the anchor: argmax of the biased logits
    (`sampling` None or greedy), else a sample of their processed distribution q."""
    greedy = sampling is None or sampling.greedy
    base_BGV = self.draft_logits(target, hidden_BGD).astype(jnp.float32)
    b, g, _ = base_BGV.shape
    head = self.markov_head
    state = None if head is None else jnp.zeros((b, head.rank), jnp.float32)
    keys = None if greedy else jax.random.split(key, g)
    prev_B = anchor_B.astype(jnp.int32)
    tokens, confs, qs = [], [], []
    for k in range(g):
      emb = self._embed_prev(prev_B)
      logits_BV = base_BGV[:, k]
      if head is not None:
        state, bias = head.step(state, emb, hidden_BGD[:, k])
        logits_BV = logits_BV + bias
      confs.append(self._confidence(hidden_BGD[:, k], emb))
      if greedy:
        prev_B = jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
      else:
        q_BV = processed_probs(logits_BV, sampling, temperature, top_p)
        qs.append(q_BV)
        prev_B = sample_from_probs(keys[k], q_BV).astype(jnp.int32)
      tokens.append(prev_B)
    conf = None if self.confidence_head is None else jnp.stack(confs, axis=1)
    return DSparkWalk(jnp.stack(tokens, axis=1), conf,
                      None if greedy else jnp.stack(qs, axis=1))

  def survival(self, conf_logits_BG, greedy: bool = False):
    """Calibrated prefix survival S_k = Π_{j≤k} σ(z_j / T_j) [B, G] with the temperatures
    of sampled or (`greedy`, when fitted) greedy acceptance; T = 1 uncalibrated."""
    z = conf_logits_BG.astype(jnp.float32)
    temps = (greedy and self.cfg.greedy_confidence_temperatures) or \
        self.cfg.confidence_temperatures
    if temps:
      z = z / jnp.asarray(temps[:z.shape[-1]], jnp.float32)
    return jnp.cumprod(jax.nn.sigmoid(z), axis=-1)


# ------------------------------------------------------------------------ loading

_HEAD_KEYS = {'markov_head': 'markov_rank', 'confidence_head': 'enable_confidence_head'}


def load_dspark(path, **overrides) -> DSparkModel:
  """Loads a `kind='dspark'` dspec checkpoint; `overrides` replace config fields. A head
  its config asks for but the checkpoint lacks is a FormatError (a ValueError)."""
  try:
    return load_dspec_checkpoint(path, DSparkModel, DSparkConfig, **overrides)
  except CheckpointError as e:
    for head, key in _HEAD_KEYS.items():
      if f"leaf '{head}." in str(e):
        raise formats.FormatError(f'{path}: the {head} weights are missing but its config '
                                  f'{key} asks for that head') from None
    raise


def load_drafter(path, *, num_target_layers: Optional[int] = None, dtype: str = 'float32',
                 **overrides) -> DSparkModel:
  """A DSpark drafter from a dspec checkpoint or a speculators directory (detected)."""
  path = os.fspath(path)
  kind = formats.detect(path)
  if kind == 'dspec':
    return load_dspark(path, **overrides)
  if kind == 'zlab':
    raise formats.FormatError(f'{path}/config.json: a z-lab DFlash config, not DSpark '
                              '(expected speculators_model_type "dspark")')
  return read_speculators(path, num_target_layers=num_target_layers, dtype=dtype,
                          **overrides)



def read_speculators(path, *, num_target_layers: Optional[int] = None,
                     dtype: str = 'float32', **overrides) -> DSparkModel:
  """A DSpark drafter from a speculators directory (speculators_model_type dspark)."""
  path = os.fspath(path)
  file = os.path.join(path, 'config.json')
  spec = formats._Keys(formats._read_json(file), file)
  kind = spec.config.get('speculators_model_type')
  if kind != 'dspark':
    raise spec.error('speculators_model_type', f'must be "dspark", got {kind!r}')
  depth = num_target_layers or formats._verifier_depth(spec)
  if depth is None:
    raise spec.error('speculators_config.verifier.name_or_path', 'is not a readable '
                     'directory: pass num_target_layers (the target depth)')
  layer = formats._Keys(spec.get('transformer_layer_config', dict, required=True), file,
                        'transformer_layer_config.')
  shapes, n, attention = formats._layer_shapes(layer, depth, dtype)
  if spec.get('target_hidden_size', int) not in (None, shapes.embed_dim):
    raise spec.error('target_hidden_size', f'differs from the draft width {shapes.embed_dim}')
  if spec.get('draft_vocab_size', int, shapes.vocab_size) != shapes.vocab_size:
    raise spec.error('draft_vocab_size', 'is a reduced vocabulary: dspec\'s DSpark needs '
                     'the full one')
  if spec.get('sliding_window_non_causal', bool, False):
    attention['is_causal'] = False
  aux = spec.int_list('aux_hidden_state_layer_ids', required=True)
  if not aux or min(aux) < 1:
    raise spec.error('aux_hidden_state_layer_ids', f'must be hidden-state indices >= 1, '
                     f'got {aux}')
  fields = dict(
      num_layers=n, block_size=spec.get('block_size', int, 8),
      target_layer_ids=tuple(a - 1 for a in aux),
      mask_token_id=spec.get('mask_token_id', int, required=True), final_tap_normed=True,
      markov_rank=spec.get('markov_rank', int, 256),
      markov_head_type=spec.config.get('markov_head_type', 'vanilla'),
      enable_confidence_head=spec.get('enable_confidence_head', bool, True),
      confidence_head_with_markov=spec.get('confidence_head_with_markov', bool, True),
      sample_from_anchor=spec.get('sample_from_anchor', bool, True),
      confidence_temperatures=tuple(spec.get('dspec_confidence_temperatures', list, [])),
      greedy_confidence_temperatures=tuple(
          spec.get('dspec_greedy_confidence_temperatures', list, [])),
      **attention)
  tensors = {k: v for k, v in formats._tensor_files(path).items()
             if k not in formats._SPECULATORS_IGNORED + ('t2d', 'd2t')}
  wanted = {'markov_head': fields['markov_rank'] > 0,
            'confidence_head': fields['enable_confidence_head']}
  for head, on in wanted.items():
    has = any(k.startswith(head + '.') for k in tensors)
    if on and not has:
      raise formats.FormatError(f'{path}: the {head} tensors are missing but config.json '
                                f'{_HEAD_KEYS[head]} asks for that head')
    if has and not on:
      raise formats.FormatError(f'{path}: {head} tensors are present but config.json '
                                f'{_HEAD_KEYS[head]} turns that head off')
  try:
    cfg = DSparkConfig(**fields, **overrides)
    drafter = nnx.eval_shape(lambda: DSparkModel(cfg, shapes, rngs=nnx.Rngs(0)))
  except (TypeError, ValueError) as e:
    raise formats.FormatError(f'{file}: {e}') from None
  formats._fill(drafter, path, tensors)
  return drafter


# ------------------------------------------------------------------------ writing


def speculators_config(drafter: DSparkModel) -> dict:
  """speculators' DSpark config.json of a drafter (ValueError when it has no such form)."""
  cfg, shapes = drafter.cfg, drafter.layer_cfg
  formats.check_exportable(drafter, 'speculators')
  layer_types = list(cfg.layer_types) or ['full_attention'] * cfg.num_layers
  sliding_causal = cfg.is_causal is None or cfg.is_causal
  if cfg.is_causal and 'full_attention' in layer_types:
    raise ValueError('causal full-attention layers have no speculators form')
  layer = formats.qwen3_layer_config(drafter, layer_types)
  config = dict(
      speculators_model_type='dspark', architectures=['DSparkSpeculator'],
      transformer_layer_config=layer, draft_vocab_size=shapes.vocab_size,
      block_size=cfg.block_size,
      aux_hidden_state_layer_ids=[i + 1 for i in cfg.target_layer_ids],
      mask_token_id=cfg.mask_token_id, target_hidden_size=None,
      sliding_window_non_causal=not sliding_causal, sample_from_anchor=True,
      markov_rank=cfg.markov_rank, markov_head_type=cfg.markov_head_type,
      enable_confidence_head=cfg.enable_confidence_head,
      confidence_head_with_markov=cfg.confidence_head_with_markov,
      speculators_config={
          'algorithm': 'dspark', 'default_proposal_method': 'greedy',
          'proposal_methods': [{'proposal_type': 'greedy',
                                'speculative_tokens': cfg.block_size}],
          'verifier': {'name_or_path': None, 'architectures': []}},
      speculators_version='0.9.0', tie_word_embeddings=False)
  if cfg.confidence_temperatures:
    config['dspec_confidence_temperatures'] = list(cfg.confidence_temperatures)
  if cfg.greedy_confidence_temperatures:
    config['dspec_greedy_confidence_temperatures'] = list(cfg.greedy_confidence_temperatures)
  return config


def save_speculators(path, drafter: DSparkModel, *, dtype: str = 'float32') -> None:
  """Writes `config.json` + `model.safetensors` in speculators' DSpark form."""
  path = os.fspath(path)
  config = speculators_config(drafter)
  tensors = {}
  for name, leaf in leaf_paths(nnx.to_pure_dict(nnx.state(drafter, nnx.Param))).items():
    torch_name, transpose = formats._torch_name(name, False)
    tensors[torch_name] = jnp.asarray(leaf.T if transpose else leaf, dtype)
  config['dtype'] = dtype
  os.makedirs(path, exist_ok=True)
  write_atomic(os.path.join(path, 'model.safetensors'),
               lambda tmp: save_file(tensors, tmp, metadata={'format': 'pt'}))
  write_json_atomic(os.path.join(path, 'config.json'), config, indent=2)
