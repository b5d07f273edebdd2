"""Benchmark pallas_kernels.block_attention against dense masked XLA attention.

  python scripts/bench_kernels.py [--out=docs/results/kernels_gpu/results.md] [--tiles=64x64,128x64]

On a GPU: for the DFlash training mask (B=16, 512 anchors, S=3072 context, 32
heads, head_dim 128, bf16, batch 1) and a causal mask (8192 tokens, same heads),
it first checks the Pallas kernel against the XLA reference on a smaller slice
(forward and gradients), then times forward and forward+backward (warm-up, then
the median of --iters runs, each ended by block_until_ready) for the Pallas
kernel and for dense masked XLA attention. TFLOP/s counts only visible (unmasked)
score entries: 4·nnz·D per head forward, 14·nnz·D per head forward+backward.
The markdown table is printed and written to --out (an existing file that is not an
earlier table is kept unless --force). Rows that would push the run past --max_minutes are
reported as skipped.

On CPU it makes no timing claims: it runs a tiny interpret-mode correctness check
and says that timing needs a GPU.
"""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import flags  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from dspec import cli, files  # noqa: E402
from pallas_kernels.block_attention import BD3LMMask  # noqa: E402
from pallas_kernels.block_attention import block_attention  # noqa: E402
from pallas_kernels.block_attention import CausalMask  # noqa: E402
from pallas_kernels.block_attention import DFlashTrainMask  # noqa: E402
from pallas_kernels.block_attention import mask_info  # noqa: E402
from pallas_kernels.block_attention import reference  # noqa: E402

_OUT = flags.DEFINE_string('out', 'docs/results/kernels_gpu/results.md',
                           'Markdown file for the results table.')
_TILES = flags.DEFINE_string('tiles', '64x64,128x64',
                             'Comma-separated block_q x block_kv to time.')
_HEADS = flags.DEFINE_integer('num_heads', 32, 'Query heads.')
_KV_HEADS = flags.DEFINE_integer('num_kv_heads', 8, 'Key/value heads (GQA).')
_HEAD_DIM = flags.DEFINE_integer('head_dim', 128, 'Head dimension.')
_ITERS = flags.DEFINE_integer('iters', 10, 'Timed runs per measurement.')
_MAX_MINUTES = flags.DEFINE_float('max_minutes', 7.5, 'Time budget.')
_FORCE = flags.DEFINE_bool('force', False, 'Replace an --out file that is not an earlier '
                           'table of this script.')
HEADING = '# block_attention GPU benchmark\n'


def _problem(name: str, num_heads: int, num_kv_heads: int, head_dim: int,
             small: bool, dtype, seed: int = 0):
  """(mask, q, k, v, cotangent, offsets) for 'dflash' or 'causal'."""
  rng = np.random.default_rng(seed)
  if name == 'dflash':
    block, context = 16, 3072
    num_blocks = 64 if small else 512
    mask = DFlashTrainMask(block_size=block, context_len=context)
    anchors = rng.integers(1, context, (1, num_blocks))
    anchors[0, -3:] = -1  # padded blocks, as in a real batch
    offsets = jnp.asarray(anchors, jnp.int32)
    q_len, kv_len = num_blocks * block, context + num_blocks * block
  else:
    mask, offsets = CausalMask(), None
    q_len = kv_len = 1024 if small else 8192
  def normal(shape):
    return jnp.asarray(rng.standard_normal(shape), dtype)
  q = normal((1, q_len, num_heads, head_dim))
  k = normal((1, kv_len, num_kv_heads, head_dim))
  v = normal((1, kv_len, num_kv_heads, head_dim))
  return mask, q, k, v, normal(q.shape), offsets


def _functions(mask, implementation: str, tiles=(None, None), interpret=False):
  """Jitted forward and forward+backward of one implementation."""
  block_q, block_kv = tiles

  def attention(q, k, v, offsets):
    return block_attention(q, k, v, mask, offsets,
                           implementation=implementation, block_q=block_q,
                           block_kv=block_kv, interpret=interpret)

  def fwd_bwd(q, k, v, cotangent, offsets):
    out, vjp = jax.vjp(lambda q, k, v: attention(q, k, v, offsets), q, k, v)
    return (out,) + vjp(cotangent)

  return jax.jit(attention), jax.jit(fwd_bwd)


def _max_errors(mask, q, k, v, cotangent, offsets, implementation: str,
                tiles=(None, None), interpret=False) -> list[float]:
  """Max |kernel - xla| of out, dq, dk, dv, relative to max |xla|."""
  _, got_fn = _functions(mask, implementation, tiles, interpret)
  _, want_fn = _functions(mask, 'xla')
  got = got_fn(q, k, v, cotangent, offsets)
  want = want_fn(q, k, v, cotangent, offsets)
  return [float(jnp.abs(g.astype(jnp.float32) - w.astype(jnp.float32)).max()
                / jnp.abs(w.astype(jnp.float32)).max())
          for g, w in zip(got, want)]


def _median_seconds(fn, *args, iters: int) -> float:
  for _ in range(2):
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(iters):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return float(np.median(times))


def _visible_entries(mask, offsets, q_len: int, kv_len: int) -> int:
  """Visible score entries of one head (< 2**31 for the benchmark shapes)."""
  count = jax.jit(lambda off: reference.dense_mask(
      mask, off, 1, q_len, kv_len).sum(dtype=jnp.int32))
  return int(count(offsets))


def _tile_fraction(mask, offsets, q_len, kv_len, tiles) -> str:
  block_q, block_kv = tiles
  resolved = mask.resolve(q_len, kv_len)
  info = jax.jit(mask_info.build_block_info, static_argnums=(0, 2, 3, 4, 5))(
      resolved, resolved.prepare_offsets(offsets, 1, q_len), q_len, kv_len,
      block_q, block_kv)
  visited = int(info.fwd.count.sum())
  total = info.fwd.count.size * -(-kv_len // block_kv)
  return f'{visited}/{total}'


def _cpu_check() -> None:
  print(f'platform is {jax.default_backend()!r}: timing needs a GPU, so no '
        'timing claims are made. Running a tiny interpret-mode check instead.')
  rng = np.random.default_rng(0)
  problems = [
      (DFlashTrainMask(block_size=4, context_len=20), 16, 36,
       jnp.asarray([[3, 11, -1, 20]], jnp.int32)),
      (CausalMask(window=9), 24, 40, jnp.asarray([16], jnp.int32)),
      (BD3LMMask(block_size=4, seq_len=16), 32, 32, None),
  ]
  for mask, q_len, kv_len, offsets in problems:
    q = jnp.asarray(rng.standard_normal((1, q_len, 4, 32)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((1, kv_len, 2, 32)), jnp.float32)
            for _ in range(2))
    cotangent = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
    errors = _max_errors(mask, q, k, v, cotangent, offsets, 'interpret',
                         (16, 16))
    status = 'ok' if max(errors) < 1e-4 else 'MISMATCH'
    print(f'{type(mask).__name__}: relative max error out/dq/dk/dv = '
          + ', '.join(f'{e:.1e}' for e in errors) + f' [{status}]')


def _gpu_bench() -> str:
  deadline = time.time() + 60 * _MAX_MINUTES.value
  heads, kv_heads, head_dim = _HEADS.value, _KV_HEADS.value, _HEAD_DIM.value
  tile_list = [tuple(int(x) for x in t.split('x'))
               for t in _TILES.value.split(',')]
  lines = [
      f'Device: {jax.devices()[0].device_kind}, jax {jax.__version__}. '
      f'Heads {heads} (kv {kv_heads}), head_dim {head_dim}, bf16, batch 1.',
      '',
      '| mask | Q x KV | tiles | pass | visited tiles | pallas ms | '
      'TFLOP/s (visible) | xla dense ms | speedup |',
      '|---|---|---|---|---|---|---|---|---|',
  ]
  for name in ('dflash', 'causal'):
    small = _problem(name, heads, kv_heads, head_dim, True, jnp.bfloat16)
    for tiles in tile_list:
      errors = _max_errors(*small, 'pallas_gpu', tiles)
      print(f'{name} {tiles} correctness (rel. max err out/dq/dk/dv): '
            + ', '.join(f'{e:.1e}' for e in errors), flush=True)
      if max(errors) > 5e-2:
        raise SystemExit(f'{name} {tiles}: kernel disagrees with XLA: {errors}')
    mask, q, k, v, cotangent, offsets = _problem(name, heads, kv_heads,
                                                 head_dim, False, jnp.bfloat16)
    q_len, kv_len = q.shape[1], k.shape[1]
    nnz = _visible_entries(mask, offsets, q_len, kv_len)
    flops = {'fwd': 4 * nnz * head_dim * heads,
             'fwd+bwd': 14 * nnz * head_dim * heads}
    xla_fwd, xla_fwd_bwd = _functions(mask, 'xla')
    xla_ms = {}
    for label, fn, args in (('fwd', xla_fwd, (q, k, v, offsets)),
                            ('fwd+bwd', xla_fwd_bwd,
                             (q, k, v, cotangent, offsets))):
      try:
        xla_ms[label] = 1e3 * _median_seconds(fn, *args, iters=_ITERS.value)
      except Exception as e:  # pylint: disable=broad-except
        print(f'xla dense {name} {label} failed: {type(e).__name__}')
        xla_ms[label] = None
    for tiles in tile_list:
      fwd, fwd_bwd = _functions(mask, 'pallas_gpu', tiles)
      fraction = _tile_fraction(mask, offsets, q_len, kv_len, tiles)
      for label, fn, args in (('fwd', fwd, (q, k, v, offsets)),
                              ('fwd+bwd', fwd_bwd,
                               (q, k, v, cotangent, offsets))):
        row = f'| {name} | {q_len} x {kv_len} | {tiles[0]}x{tiles[1]} | {label} '
        if time.time() > deadline:
          lines.append(row + '| skipped (time budget) | | | | |')
          continue
        ms = 1e3 * _median_seconds(fn, *args, iters=_ITERS.value)
        tflops = flops[label] / (ms * 1e-3) / 1e12
        dense = xla_ms[label]
        dense_cell = 'failed (OOM?)' if dense is None else f'{dense:.2f}'
        speedup = '' if dense is None else f'{dense / ms:.2f}x'
        lines.append(row + f'| {fraction} | {ms:.2f} | {tflops:.1f} | '
                     f'{dense_cell} | {speedup} |')
        print(lines[-1], flush=True)
  return '\n'.join(lines) + '\n'


def main(argv):
  del argv
  if jax.default_backend() not in ('gpu', 'cuda', 'rocm'):
    _cpu_check()
    return
  files.check_outputs({'--out': _OUT.value}, force=_FORCE.value,
                      ours={'--out': files.starts_with(HEADING)})
  table = _gpu_bench()
  print(table)
  files.write_text_atomic(_OUT.value, HEADING + '\nGenerated by `python '
                          'scripts/bench_kernels.py`.\n\n' + table)
  print(f'wrote {_OUT.value}')


if __name__ == '__main__':
  cli.run(main)
