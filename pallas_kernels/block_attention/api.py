"""Public entry point: ``block_attention`` with backend selection and fallback.

Backends:

* ``'xla'``: ``reference.reference_attention`` (dense, any platform); the DFlash
  training mask goes through ``reference.blocked_train_attention`` (its blocks only).
* ``'pallas_gpu'``: ``kernel_gpu`` (Pallas Triton lowering) on GPU.
* ``'pallas_tpu'``: ``kernel_tpu`` (Pallas Mosaic) on TPU.
* ``'interpret'``: the ``kernel_gpu`` kernel bodies run with ``interpret=True``
  (CPU testing; slow). ``interpret=True`` with ``'pallas_tpu'`` runs the TPU
  kernels in interpret mode the same way.
* ``None``: ``pallas_tpu`` on TPU, ``pallas_gpu`` on GPU, ``xla`` elsewhere.

A Pallas backend that cannot run (wrong platform, unsupported dtype or tile
size) logs one warning per reason and falls back to ``'xla'``.

Under an active mesh (``jax.set_mesh``, see ``dspec/sharding.py``) a Pallas
call is wrapped in ``jax.shard_map``: batch over the ``data``/``fsdp`` axes and
heads over ``tensor`` where they divide, so each device runs the kernel on its
own rows and heads (kv-seq is never split).

Gradients: ``jax.custom_vjp`` around the Pallas forward kernel, with Pallas
backward kernels (dq, and dk/dv) that recompute probabilities from the saved
logsumexp and visit only non-empty tiles, like the forward pass.
"""

from __future__ import annotations

import dataclasses
import functools
import math

from absl import logging
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from pallas_kernels.block_attention import kernel_gpu
from pallas_kernels.block_attention import kernel_tpu
from pallas_kernels.block_attention import mask_info as mask_info_lib
from pallas_kernels.block_attention import masks as masks_lib
from pallas_kernels.block_attention.reference import blocked_train_attention
from pallas_kernels.block_attention.reference import reference_attention

IMPLEMENTATIONS = ('xla', 'pallas_gpu', 'pallas_tpu', 'interpret')
DEFAULT_BLOCKS = {'pallas_gpu': (64, 64), 'pallas_tpu': (128, 128)}
_KERNELS = {'pallas_gpu': kernel_gpu, 'pallas_tpu': kernel_tpu}
_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
_warned: set[str] = set()


def _warn_once(message: str) -> None:
  if message not in _warned:
    _warned.add(message)
    logging.warning('block_attention: %s', message)


@dataclasses.dataclass(frozen=True)
class _Config:
  backend: str
  scale: float
  block_q: int
  block_kv: int
  interpret: bool

  def call(self, fn_name: str, *args):
    fn = getattr(_KERNELS[self.backend], fn_name)
    return fn(*args, scale=self.scale, block_q=self.block_q,
              block_kv=self.block_kv, interpret=self.interpret)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _pallas_attention(q, k, v, info, config: _Config):
  return config.call('forward', q, k, v, info)[0]


def _pallas_attention_fwd(q, k, v, info, config: _Config):
  out, lse = config.call('forward', q, k, v, info)
  return out, (q, k, v, out, lse, info)


def _pallas_attention_bwd(config: _Config, residuals, do):
  q, k, v, out, lse, info = residuals
  dq, dk, dv = config.call('backward', q, k, v, out, lse, do, info)
  return dq, dk, dv, None


_pallas_attention.defvjp(_pallas_attention_fwd, _pallas_attention_bwd)


def _round_up(x: int, m: int) -> int:
  return -(-x // m) * m


def _next_pow2(x: int) -> int:
  return 1 << max(x - 1, 0).bit_length()


def _tiles(backend: str, q_len: int, kv_len: int, block_q, block_kv):
  """Tile sizes for a backend, clamped to short sequences; None if invalid."""
  default_q, default_kv = DEFAULT_BLOCKS[backend]
  block_q, block_kv = block_q or default_q, block_kv or default_kv
  if backend == 'pallas_gpu':
    ok = all(b >= 16 and b == _next_pow2(b) for b in (block_q, block_kv))
    block_q = min(block_q, max(16, _next_pow2(q_len)))
    block_kv = min(block_kv, max(16, _next_pow2(kv_len)))
  else:
    ok = block_q % 128 == 0 and block_kv % 128 == 0
    block_q = min(block_q, _round_up(q_len, 16))
  return (block_q, block_kv) if ok else None


def _platform() -> str:
  platform = jax.default_backend()
  return 'gpu' if platform in ('cuda', 'rocm') else platform


def _platform_backend() -> str:
  return {'tpu': 'pallas_tpu', 'gpu': 'pallas_gpu'}.get(_platform(), 'xla')


def _shard_axes(batch: int, num_heads: int, num_kv_heads: int):
  """(batch axes, head axes) of the active mesh to split a kernel call over."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return (), ()
  free = {n for n, t in zip(mesh.axis_names, mesh.axis_types)
          if t != jax.sharding.AxisType.Manual and mesh.shape[n] > 1}

  def fit(names, *dims):
    axes = tuple(n for n in names if n in free)
    size = math.prod(mesh.shape[a] for a in axes)
    return axes if axes and all(d % size == 0 for d in dims) else ()

  return fit(('data', 'fsdp'), batch), fit(('tensor',), num_heads, num_kv_heads)


def block_attention(q_BTHD: jax.Array, k_BSKD: jax.Array, v_BSKD: jax.Array,
                    mask: masks_lib.AttentionMask, offsets=None, *,
                    implementation: str | None = None,
                    block_q: int | None = None, block_kv: int | None = None,
                    scale: float | None = None,
                    interpret: bool = False) -> jax.Array:
  """Block-sparse masked attention, differentiable w.r.t. q, k and v.

  Args:
    q_BTHD: queries ``[batch, T, H, D]`` (fp32, bf16 or fp16; fp32 accumulate).
    k_BSKD, v_BSKD: keys/values ``[batch, S, K, D]``; H % K == 0 (GQA).
    mask: a mask from ``masks`` (CausalMask, DFlashTrainMask, TreeMask, ...).
    offsets: the mask's runtime offsets, int array (``q_offset [batch]``,
      ``anchors [batch, N]``, ``context_len [batch]``, ``[context_len, parents]
      [batch, 1 + N]`` for TreeMask; None for BD3LM).
    implementation: 'xla' | 'pallas_gpu' | 'pallas_tpu' | 'interpret' | None.
    block_q, block_kv: tile sizes (default 64/64 on GPU, 128/128 on TPU).
    scale: logit scale, default ``D ** -0.5``.
    interpret: run the chosen Pallas backend in interpret mode (CPU tests).

  Returns:
    ``[batch, T, H, D]`` in the dtype of ``q_BTHD``; fully masked rows are 0.
  """
  if implementation not in (None, *IMPLEMENTATIONS):
    raise ValueError(f'implementation must be one of {IMPLEMENTATIONS} or '
                     f'None, got {implementation!r}.')
  if q_BTHD.ndim != 4 or k_BSKD.ndim != 4 or k_BSKD.shape != v_BSKD.shape:
    raise ValueError(f'expected q [B,T,H,D] and k == v [B,S,K,D]; got '
                     f'{q_BTHD.shape}, {k_BSKD.shape}, {v_BSKD.shape}.')
  batch, q_len, num_heads, head_dim = q_BTHD.shape
  kv_len, num_kv_heads = k_BSKD.shape[1], k_BSKD.shape[2]
  if (k_BSKD.shape[0] != batch or k_BSKD.shape[3] != head_dim
      or num_heads % num_kv_heads):
    raise ValueError(f'incompatible q {q_BTHD.shape} and k/v {k_BSKD.shape}.')
  mask = mask.resolve(q_len, kv_len)
  scale = head_dim**-0.5 if scale is None else scale

  backend = implementation or _platform_backend()
  if backend == 'interpret':
    backend, interpret = 'pallas_gpu', True
  tiles = None
  if backend != 'xla':
    tiles = _tiles(backend, q_len, kv_len, block_q, block_kv)
    if not interpret and backend.removeprefix('pallas_') != _platform():
      _warn_once(f'{backend} cannot run on platform {_platform()!r}; '
                 'using xla.')
      backend = 'xla'
    elif q_BTHD.dtype not in _DTYPES or k_BSKD.dtype != q_BTHD.dtype:
      _warn_once(f'{backend} does not support dtypes {q_BTHD.dtype}/'
                 f'{k_BSKD.dtype}; using xla.')
      backend = 'xla'
    elif tiles is None:
      _warn_once(f'{backend} does not support tiles ({block_q}, {block_kv}); '
                 'using xla.')
      backend = 'xla'
  if backend == 'xla':
    if type(mask) is masks_lib.DFlashTrainMask:
      return blocked_train_attention(q_BTHD, k_BSKD, v_BSKD, mask, offsets, scale)
    return reference_attention(q_BTHD, k_BSKD, v_BSKD, mask, offsets, scale)

  block_q, block_kv = tiles
  if backend == 'pallas_gpu':
    padded_dim = max(16, _next_pow2(head_dim))
  else:
    padded_dim = _round_up(head_dim, 128)
  q_pad = _round_up(q_len, block_q) - q_len
  kv_pad = _round_up(kv_len, block_kv) - kv_len
  d_pad = padded_dim - head_dim
  config = _Config(backend=backend, scale=float(scale), block_q=block_q,
                   block_kv=block_kv, interpret=bool(interpret))

  def run(q, k, v, offsets_B):
    info = mask_info_lib.build_block_info(mask, offsets_B, q_len, kv_len,
                                          block_q, block_kv)
    q = jnp.pad(q, ((0, 0), (0, q_pad), (0, 0), (0, d_pad)))
    k = jnp.pad(k, ((0, 0), (0, kv_pad), (0, 0), (0, d_pad)))
    v = jnp.pad(v, ((0, 0), (0, kv_pad), (0, 0), (0, d_pad)))
    return _pallas_attention(q, k, v, info, config)[:, :q_len, :, :head_dim]

  offsets_B = mask.prepare_offsets(offsets, batch, q_len)
  batch_axes, head_axes = _shard_axes(batch, num_heads, num_kv_heads)
  if batch_axes or head_axes:
    spec = P(batch_axes or None, None, head_axes or None, None)
    run = jax.shard_map(run, in_specs=(spec, spec, spec, P(batch_axes or None)),
                        out_specs=spec, check_vma=False)
  return run(q_BTHD, k_BSKD, v_BSKD, offsets_B)
