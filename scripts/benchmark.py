"""Benchmark datasets × methods × sweep against AR: python scripts/benchmark.py --config=...

  python scripts/benchmark.py --config=configs/bench_demo.py:quick --out_dir=runs/bench_quick
  python scripts/benchmark.py --config=configs/bench_tiny.py --out_dir=/tmp/bench_tiny
  python scripts/benchmark.py --render=runs/bench_quick   # docs/RESULTS.md section to stdout
  python scripts/benchmark.py --config=configs/bench_demo.py:family --out_dir=runs/bench_family \
      --resume   # an interrupted run: keeps the finished sweep points (same config only)

Writes DIR/results.json (one row per dataset × method × temperature × batch × size, plus the
transformers peer rows), DIR/results.md, DIR/meta.json and PNG plots (docs/DESIGN.md); results.json
appears only when the run finished; until then DIR/results.partial.json holds every finished
(dataset, temperature, batch size) sweep point, which --resume does not run again (each
point's speedups compare with the AR run of the same point and process). A DIR holding files
dspec did not write is refused unless --force (and then nothing in it is deleted), and so is
a DIR inside an input of the config (its model, drafters, tokenizer or data folder). Library
code: dspec/bench/harness.py.
"""

import os
import shlex
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import flags  # noqa: E402

from dspec import cli, config_checks, console  # noqa: E402

_CONFIG = cli.define_config('configs/bench_demo.py', 'Benchmark config file.')
_OUT_DIR = flags.DEFINE_string('out_dir', None, 'Directory for results and plots.')
_RENDER = flags.DEFINE_string('render', None, 'Print the docs/RESULTS.md section of a '
                              'finished run directory and exit.')
_RESUME = flags.DEFINE_bool('resume', False, 'Continue an interrupted run of the same config '
                            'in --out_dir from its partial results.')
_DOCS_DIR = flags.DEFINE_string('docs_dir', 'docs', 'Plot links are relative to this (--render).')
_FORCE = flags.DEFINE_bool('force', False, 'Write into an --out_dir that holds files dspec did '
                           'not write (nothing in it is deleted; results.json is replaced).')


def main(argv):
  del argv
  status = console.configure()
  from dspec import files
  from dspec.bench import harness, report  # heavy imports after flag parsing
  if _RENDER.value:
    if not os.path.exists(os.path.join(_RENDER.value, report.RESULTS)):
      raise cli.UserError(f'{_RENDER.value} has no {report.RESULTS} (unfinished run?)')
    print(report.render_results_section(_RENDER.value, _DOCS_DIR.value))
    return
  if not _OUT_DIR.value:
    raise cli.UserError('give --out_dir=DIR')
  config_checks.require_sections(_CONFIG.value, ('bench',), 'scripts/benchmark.py',
                                 flags.FLAGS['config'].config_filename)
  files.check_outputs({'--out_dir': _OUT_DIR.value}, files.config_inputs(_CONFIG.value),
                      force=_FORCE.value, dirs={'--out_dir': report.is_benchmark_dir})
  command = 'python ' + ' '.join(shlex.quote(a) for a in sys.argv)
  status(f'benchmark into {_OUT_DIR.value}: loading the target and drafters')
  rows = harness.run_benchmark(_CONFIG.value, _OUT_DIR.value, command, _RESUME.value)
  print(f'{len(rows)} rows -> {os.path.join(_OUT_DIR.value, report.RESULTS)}, '
        f'{report.MARKDOWN}, plots')


if __name__ == '__main__':
  cli.run(main)
