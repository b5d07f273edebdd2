"""The controller on 4 simulated CPU devices (`data=2,tensor=2`): n-gram and suffix under
`auto`, n-gram trees under `tree` and `auto_tree`; prints `RESULT {json}`.

Run by `test_controller.py` in a subprocess (XLA_FLAGS must be set before jax starts):
  python tests/scale/controller_mesh_check.py
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from xla_flags import with_fast_compile  # noqa: E402
os.environ['XLA_FLAGS'] = with_fast_compile(os.environ.get('XLA_FLAGS', '') +
                                            ' --xla_force_host_platform_device_count=4')
os.environ.setdefault('JAX_PLATFORMS', 'cpu')
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__)))))

import jax  # noqa: E402
from flax import nnx  # noqa: E402

from configs import common  # noqa: E402
from dspec import loading, sharding  # noqa: E402
from dspec.decoding import runner  # noqa: E402
from dspec.decoding.costs import CostTable  # noqa: E402
from dspec.decoding.drafter import NoDrafter  # noqa: E402
from dspec.decoding.drafters.ngram import NgramDrafter  # noqa: E402
from dspec.decoding.drafters.suffix import SuffixDrafter  # noqa: E402
from dspec.decoding.policy import ControllerConfig  # noqa: E402
from dspec.decoding.prompts import generated_ids, pad_prompts  # noqa: E402
from dspec.decoding.tree_engine import TreeConfig  # noqa: E402
from dspec.sampling import SamplingSpec  # noqa: E402

PROMPTS = [[1, 2, 3, 1, 2, 3, 1, 2], [5, 6, 7], [9, 9, 9, 9, 9], [4, 5, 4, 5, 4]]


def main():
  cfg = common.decode_config('tiny')
  cfg.batch_size, cfg.max_new_tokens, cfg.timing_repeats = 4, 16, 0
  cfg.drafter, cfg.compare_ar, cfg.mesh = 'ngram', True, 'data=2,tensor=2'
  cfg.drafters.ngram.num_draft = 3
  cfg.verify_length = 'auto'
  cfg.controller.profile_steps, cfg.controller.profile_repeats = 2, 1
  report = runner.run_decode(cfg, PROMPTS)
  # The same on a table where verifying is cheap: the positive tiers run sharded.
  placement = sharding.placement_from_config(cfg)
  model, _, _ = loading.build_target(cfg.model, placement)
  placement = placement.for_model(model.cfg)
  graphdef, params = nnx.split(model)
  prompt_BP, lens_B = pad_prompts(PROMPTS)
  settings = runner.Settings(max_new_tokens=cfg.max_new_tokens)
  outs, tier_steps = {}, {}
  runs = (('ar', NoDrafter(), 'auto'), ('auto', NgramDrafter(num_draft=3), 'auto'),
          ('suffix', SuffixDrafter(num_draft=3, use_global_cache=False), 'auto'),
          ('tree', NgramDrafter(num_draft=3), 'tree'),
          ('auto_tree', NgramDrafter(num_draft=3), 'auto_tree'))
  for name, drafter, verify_length in runs:
    engine = runner.speculative_engine(graphdef, drafter, SamplingSpec(), (),
                                       placement=placement, verify_length=verify_length,
                                       controller=ControllerConfig(tiers=(0, 1, 3)),
                                       tree=TreeConfig(num_nodes=4, top_k=2))
    if engine.adaptive and name != 'ar':   # verifying is cheap: the positive tiers run
      engine.costs = CostTable({(4, g): 1.0 + 0.05 * g for g in engine.tiers}, {4: 0.0})
    state, _, _ = runner.run_generation(engine, params, None, prompt_BP, lens_B, settings)
    outs[name] = generated_ids(state)
    tier_steps[name] = {str(g): n for g, n in engine.tier_steps().items()}
  print('RESULT ' + json.dumps({
      'devices': jax.device_count(), 'lossless': report['lossless'],
      'verify_length': report['verify_length'],
      'tier_steps': {str(g): n for g, n in report['tier_steps'].items()},
      'equal_ar': {name: outs[name] == outs['ar'] for name in outs},
      'cheap_tier_steps': tier_steps}))


if __name__ == '__main__':
  main()
