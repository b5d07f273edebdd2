"""`debug=True`: generation runs under jax.transfer_guard('disallow') for every drafter, both
verify-length modes (the controller included), and stays lossless."""

import pytest

from configs import tiny
from dspec.decoding import runner


@pytest.mark.parametrize('drafter,verify_length', [
    pytest.param('ngram', 'auto', marks=pytest.mark.slow),
    pytest.param('suffix', 'fixed', marks=pytest.mark.slow),
    pytest.param('oracle', 'auto', marks=pytest.mark.slow),
    ('self', 'fixed')])   # the module's quick test
def test_decode_has_no_implicit_transfers(drafter, verify_length):
  cfg = tiny.get_config()
  cfg.drafter, cfg.verify_length, cfg.debug, cfg.compare_ar = drafter, verify_length, True, True
  cfg.max_new_tokens, cfg.timing_repeats = 12, 0
  report = runner.run_decode(cfg, [[5, 6, 7, 5, 6, 7, 5]])
  assert report['lossless'] is True and report['new_tokens'] == 12
