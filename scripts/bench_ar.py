"""AR decoding roofline and peer comparison (issue: foundation performance).

  python scripts/bench_ar.py --out=docs/results/ar_roofline/bench_ar.json

1. Roofline: a ~100M-parameter random target (configs/common.py `roofline100m`), fp32,
   batch 1. The AR step time (decode wall time / new tokens, after warm-up, median of runs)
   is compared with the time to read the weights once at the read bandwidth measured in the
   same process. Goal: step <= 1.3x weight-read time.
2. Peer: the same weights exported to `transformers` (torch CPU, same threads), greedy
   `generate` of the same number of new tokens from the same prompt. Goal: dspec >= HF.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
from absl import flags  # noqa: E402
from flax import nnx  # noqa: E402

from configs import common  # noqa: E402
from dspec import cli, files  # noqa: E402

_OUT = flags.DEFINE_string('out', None, 'Write the results JSON here.')
_FORCE = flags.DEFINE_bool('force', False, 'Replace an --out file that dspec did not write.')
_PRESET = flags.DEFINE_string('preset', 'roofline100m', 'Model preset in configs/common.py.')
_NEW_TOKENS = flags.DEFINE_integer('new_tokens', 64, 'Tokens to generate.')
_PROMPT_LEN = flags.DEFINE_integer('prompt_len', 32, 'Prompt length (random ids).')
_REPEATS = flags.DEFINE_integer('repeats', 5, 'Timed runs (median reported).')
_HF = flags.DEFINE_bool('hf', True, 'Also time transformers generate.')


def main(argv):
  del argv
  files.check_outputs({'--out': _OUT.value}, force=_FORCE.value)
  from dspec.bench.timing import median_time, read_bandwidth_bytes_per_s
  from dspec.decoding.runner import speculative_engine
  from dspec.models.config import TransformerConfig
  from dspec.models.transformer import Transformer

  cfg = TransformerConfig(**common.MODEL_PRESETS[_PRESET.value])
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(model)
  weight_bytes = sum(x.nbytes for x in __import__('jax').tree.leaves(params))
  prompt = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, _PROMPT_LEN.value))
  prompt = prompt.astype(np.int32)
  lens = np.array([_PROMPT_LEN.value], np.int32)
  engine = speculative_engine(graphdef)
  n = _NEW_TOKENS.value

  def prefill():
    return engine.prefill(params, None, prompt, lens, max_new_tokens=n)

  def decode():
    return engine.generate(params, None, prefill())

  t_prefill = median_time(prefill, repeats=_REPEATS.value)
  t_total = median_time(decode, repeats=_REPEATS.value)
  step_s = (t_total - t_prefill) / n
  bandwidth = read_bandwidth_bytes_per_s(weight_bytes)
  read_s = weight_bytes / bandwidth
  result = {
      'preset': _PRESET.value, 'params_m': cfg.num_params() / 1e6,
      'weight_mb': weight_bytes / 2**20, 'read_bandwidth_gb_s': bandwidth / 1e9,
      'weight_read_ms': read_s * 1e3, 'ar_step_ms': step_s * 1e3,
      'roofline_ratio': step_s / read_s, 'dspec_tokens_per_s': 1.0 / step_s,
      'new_tokens': n, 'prompt_len': _PROMPT_LEN.value,
  }
  if _HF.value:
    import torch
    from dspec.hf_export import to_transformers_model
    torch.set_num_threads(os.cpu_count())
    hf_model = to_transformers_model(model)
    ids = torch.tensor(prompt, dtype=torch.long)
    kw = dict(max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0,
              eos_token_id=None)

    def hf_generate():
      with torch.inference_mode():
        return hf_model.generate(ids, **kw)

    def hf_prefill():
      with torch.inference_mode():
        return hf_model(ids)

    out = hf_generate()
    ours = np.asarray(decode().tokens_BL)[0, _PROMPT_LEN.value:_PROMPT_LEN.value + n]
    t_hf = median_time(hf_generate, repeats=_REPEATS.value)
    t_hf_prefill = median_time(hf_prefill, repeats=_REPEATS.value)
    hf_step = (t_hf - t_hf_prefill) / n
    result.update(hf_step_ms=hf_step * 1e3, hf_tokens_per_s=1.0 / hf_step,
                  dspec_over_hf=hf_step / step_s,
                  hf_same_tokens=bool(np.array_equal(out[0, _PROMPT_LEN.value:].numpy(),
                                                     ours)),
                  torch_threads=torch.get_num_threads())
  print(json.dumps(result, indent=1))
  if _OUT.value:
    files.write_json_atomic(_OUT.value, files.mark(result, 'bench_ar'))


if __name__ == '__main__':
  cli.run(main)
