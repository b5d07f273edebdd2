"""Decodes two prompts with several drafters in one run, alone or as one of N processes
(`scripts/launch_local.py`); process 0 writes every run's token ids to --out.

  python tests/scale/multiprocess_decode.py --config=configs/demo.py --out=ids.json \
      --runs=mtp:fixed:0,mtp:auto:0,ngram:fixed:1

A run is drafter:verify_length:temperature (`dflash2`: the dflash drafter with demo/dflash2).
Besides the ids, each run records a digest of row 0's step trace (the controller's tier at
every step; token trees on a mesh: the tier steps) from every process, so a test can check
that all processes decided alike.
`tests/scale/test_multiprocess.py` compares the files of 1 and 2 processes.
"""

import dataclasses
import hashlib
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from absl import flags  # noqa: E402

from dspec import cli  # noqa: E402

_CONFIG = cli.define_config('configs/demo.py', 'Decode config file.')
_OUT = flags.DEFINE_string('out', None, 'Where process 0 writes the ids (JSON).', required=True)
_RUNS = flags.DEFINE_list('runs', ['mtp:fixed:0'], 'drafter:verify_length:temperature, ...')
PROMPTS = ('def add(a, b):', 'Question: Tom has 3 apples and buys 4 more. How many')


def _digests_of_every_process(text: str) -> list:
  """sha256 of `text` on each process, in process order (a collective)."""
  import numpy as np
  from jax.experimental import multihost_utils
  from dspec import distributed
  digest = np.frombuffer(hashlib.sha256(text.encode()).digest(), np.uint8)
  if not distributed.active():
    return [digest.tobytes().hex()]
  every = multihost_utils.process_allgather(digest)
  return [bytes(row).hex() for row in np.asarray(every).reshape(-1, digest.size)]


def main(argv):
  del argv
  import jax
  from dspec import distributed, files, loading, sharding
  from dspec.decoding import runner
  from dspec.decoding.drafters import registry
  from dspec.decoding.policy import ControllerConfig
  from dspec.decoding.tree_engine import TreeConfig
  cfg = _CONFIG.value
  placement = sharding.placement_from_config(cfg)
  model, tokenizer, max_seq_len = loading.build_target(cfg.model, placement)
  placement = placement and placement.for_model(model.cfg)
  target = runner.Target(model, tokenizer, max_seq_len)
  dflash_path = cfg.drafters.dflash.path
  results = {}
  for run in _RUNS.value:
    name, verify_length, temperature = run.split(':')
    cfg.drafter = 'dflash' if name == 'dflash2' else name
    cfg.drafters.dflash.path = 'demo/dflash2' if name == 'dflash2' else dflash_path
    drafter, drafter_params = registry.build_drafter(cfg, model)
    settings = dataclasses.replace(runner.Settings.from_config(cfg),
                                   temperature=float(temperature), timing_repeats=0)
    traced = 'tree' not in verify_length or placement is None   # trees: no trace on a mesh
    out = runner.decode(target, list(PROMPTS), drafter, drafter_params, settings=settings,
                        batch_size=len(PROMPTS), verify_length=verify_length, trace=traced,
                        placement=placement, tree=TreeConfig.from_config(cfg.tree),
                        controller=ControllerConfig.from_config(cfg.get('controller', {})))
    trace = json.dumps(out['trace'] if traced else out['metrics'].get('tier_steps'),
                       sort_keys=True)
    results[run] = {'ids': out['ids'], 'trace_digests': _digests_of_every_process(trace),
                    'tier_steps': {str(k): v for k, v in
                                   out['metrics'].get('tier_steps', {}).items()}}
    print(f'{run}: {out["metrics"]["new_tokens"]} tokens, tau={out["metrics"]["tau"]:.2f}',
          flush=True)
  if distributed.is_main():
    files.write_json_atomic(_OUT.value, {'processes': jax.process_count(), 'runs': results})


if __name__ == '__main__':
  cli.run(main)
