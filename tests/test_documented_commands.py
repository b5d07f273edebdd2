"""Every command the docs show works as written (README.md, docs/SCALE.md, docs/RESULTS.md,
docs/DESIGN.md): a reader copies them, so a renamed flag or config field, or a command that
stopped working, is a bug of the page or of the script.

Each command (shell blocks with their `\\` continuations joined; commands in backticks in
prose and tables, wrapped lines joined) is checked cheaply: the script exists and parses the
command's flags and config (`--config=configs/x.py:arg`, every `--config.<field>=...`)
exactly as it does when run, stopping before its work. The quick ones then run as written
(outputs under /tmp moved to a scratch folder, outputs inside the repository written into a
scratch copy of it); the others are in NOT_RUN with why, or SHORTENED.
"""

import argparse
import contextlib
import dataclasses
import functools
import io
import json
import os
import re
import runpy
import shlex
import signal
import subprocess
import sys
import time
import uuid

import pytest

from xla_flags import with_fast_compile

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ('README.md', 'docs/SCALE.md', 'docs/RESULTS.md', 'docs/DESIGN.md')
SHELL_FENCES = ('', 'bash', 'sh', 'shell', 'console')
SHELL_OPERATORS = ('&&', '||', ';', '|', '>', '>>', '<', '2>', '&')
# What a reader fills in: <x>, $VAR, a word in capitals (--config.mesh=MESH, --out_dir=DIR).
PLACEHOLDER = re.compile(r'<[^<>]*>|\$\{?[A-Za-z_]\w*|\b[A-Z]{3,}\b')
# Flags whose value is a path the command writes.
OUTPUT_FLAGS = ('out', 'out_dir', 'workdir', 'json', 'table', 'metrics_json', 'trace_json')

# Commands checked but not run (re.search on the command text), with why. Times are cold
# (empty compilation cache), one core of the 2-core development machine.
NOT_RUN = (
    (r'scripts/(train|distill|train_tokenizer)\.py', 'trains or distils: minutes to hours '
     '(the 2-process train in SCALE.md: 150 s, most of it the final evaluation)'),
    (r'scripts/benchmark\.py|\bbench_(ar|buckets|concurrency|draft_cost|engine|structured|trees)'
     r'\.py', 'a benchmark: minutes to an hour'),
    (r'scripts/redteam\.py', 'the red-team sweep: 45 minutes'),
    (r'^python scripts/decode\.py --config=configs/demo\.py( |$)',
     'the widened main job: 130 s (the verify tiers compile for a minute)'),
    (r'^python scripts/decode\.py --config=configs/demo\.py:small( |$)',
     'the demo target: 65-70 s (compiling its drafter\'s and verify programs); SCALE.md\'s '
     'two processes decode it, shortened'),
)
# Commands run with extra flags that keep their meaning but cut the work to a minute.
SHORTENED = (
    # As written, 2 processes sharing one core decode 128 tokens with AR alongside in over
    # 5 minutes; the mesh, the batch and the drafter stay the page's (a batch the mesh
    # cannot split failed at the first step).
    (r'launch_local\.py -n 2 --devices_per_process 2 -- scripts/decode\.py',
     ('--config.max_new_tokens=8', '--config.verify_length=fixed', '--config.compare_ar=False')),
)
RUN_TIMEOUT_S = 300   # a hang, not a slow machine: the quick ones take 5-120 s cold


@dataclasses.dataclass(frozen=True)
class Command:
  page: str
  line: int
  tokens: tuple        # as the shell splits it: [VAR=value ...] [taskset -c N] python script ...
  wrapped: bool        # inside a cluster launcher (srun, gcloud ... --command="..."): check only
  synopsis: bool       # a usage line with [optional] parts: check only

  @property
  def id(self) -> str:
    return f'{self.page}:{self.line}'

  @property
  def text(self) -> str:
    return shlex.join(self.tokens)


def _read(rel: str) -> str:
  with open(os.path.join(REPO_ROOT, rel), encoding='utf-8') as f:
    return f.read()


def _is_script(token: str) -> bool:
  """A bare script name as the docs write it inline (`bench_trees.py --shapes=...`)."""
  return (re.fullmatch(r'\w+\.py', token) is not None
          and os.path.isfile(os.path.join(REPO_ROOT, 'scripts', token)))


def _command_starts(tokens: list) -> list:
  """Indices where a command starts: `python x`, `python3 x`, `bash x`, a bare script name
  with arguments; an env assignment or `taskset -c N` just before it is part of it."""
  starts = []
  for i, tok in enumerate(tokens):
    named = tok in ('python', 'python3', 'bash') and i + 1 < len(tokens)
    bare = _is_script(tok) and i + 1 < len(tokens) and (i == 0 or tokens[i - 1] != 'python')
    if not (named or bare):
      continue
    j = i
    if j >= 3 and tokens[j - 3] == 'taskset' and tokens[j - 2] == '-c':
      j -= 3
    while j > 0 and re.fullmatch(r'[A-Z_][A-Z0-9_]*=.*', tokens[j - 1]):
      j -= 1
    starts.append((j, i))
  return starts


def _commands_in(text: str, page: str, line: int, variables: dict) -> list:
  """The commands in one logical line of shell text (continuations already joined)."""
  for name, value in variables.items():
    text = re.sub(rf'\${name}\b', value, text)
  # A placeholder may hold spaces (`<4-layer export>`): one word, as the reader means it.
  text = re.sub(r'<[^<>]*>', lambda m: m.group(0).replace(' ', '_'), text)
  try:
    tokens = shlex.split(text)
  except ValueError:   # prose in backticks with an odd quote: not a command
    return []
  synopsis = any(t.startswith('[-') for t in tokens)
  if synopsis:   # [--flag=X | --other=Y] [...]; configs/<x>.py[:preset]: the parts a reader keeps
    tokens = [re.sub(r'^\[|\]$', '', re.sub(r'(?<=.)\[[^\[\]]*\]$', '', t))
              for t in tokens if t not in ('|', '...', '...]')]
  commands = []
  for j, i in _command_starts(tokens):
    end = next((k for k in range(i, len(tokens)) if tokens[k] in SHELL_OPERATORS), len(tokens))
    commands.append(Command(page, line, tuple(tokens[j:end]), wrapped=j > 0 and
                            tokens[0] in ('srun', 'gcloud', 'mpirun'), synopsis=synopsis))
  if not commands:   # gcloud ... --command="cd dspec && python scripts/...": look inside
    for tok in tokens:
      inner = tok.split('=', 1)[1] if tok.startswith('--') and '=' in tok else None
      if inner and re.search(r'\bpython3? ', inner):
        commands += [dataclasses.replace(c, wrapped=True)
                     for c in _commands_in(inner, page, line, {})]
  return commands


def _fenced(text: str, page: str, variables: dict) -> list:
  """Commands in shell code blocks: `\\` continuations joined, comment lines skipped."""
  commands, fence, pending, start = [], None, '', 0
  for number, raw in enumerate(text.splitlines(), 1):
    stripped = raw.strip()
    if stripped.startswith('```'):
      fence = stripped[3:].strip() if fence is None else None
      continue
    if fence is None or fence not in SHELL_FENCES:
      continue
    if not pending:
      if not stripped or stripped.startswith('#'):
        continue
      start = number
    pending += ' ' + stripped
    if pending.endswith('\\'):
      pending = pending[:-1]
      continue
    commands += _commands_in(pending, page, start, variables)
    pending = ''
  return commands


def _inline(text: str, page: str, variables: dict) -> list:
  """Commands in `backticks` in prose and tables; a span wrapped over lines is one command.
  A span `... --flag` continues the last full command before it (RESULTS' tables)."""
  prose = re.sub(r'^```.*?^```', lambda m: '\n' * m.group(0).count('\n'), text,
                 flags=re.MULTILINE | re.DOTALL)
  commands, last = [], None
  for m in re.finditer(r'`([^`]+)`', prose):
    span = m.group(1)
    if '\n\n' in span:
      continue
    span = re.sub(r'\s*\n\s*', ' ', span).strip()
    line = prose.count('\n', 0, m.start()) + 1
    if span.startswith('... ') and last is not None:
      span = last + span[3:]
    found = _commands_in(span, page, line, variables)
    if found and not span.startswith('... '):
      last = span
    commands += found
  return commands


def _variables(text: str) -> dict:
  """Names a page defines for its commands: (`ARGS` = `--config=... --config.x=...`)."""
  return {m.group(1): re.sub(r'\s+', ' ', m.group(2)).strip()
          for m in re.finditer(r'`([A-Z][A-Z_]*)` = `([^`]+)`', text)}


@functools.lru_cache(maxsize=None)
def documented_commands() -> tuple:
  commands = []
  for page in PAGES:
    text = _read(page)
    variables = _variables(text)
    commands += _fenced(text, page, variables) + _inline(text, page, variables)
  return tuple(sorted(commands, key=lambda c: (PAGES.index(c.page), c.line)))


# ----------------------------------------------------------------------------------------
# A command taken apart.


@dataclasses.dataclass(frozen=True)
class Invocation:
  """A command taken apart: environment, CPU pinning, the script and its arguments."""
  env: tuple           # ('XLA_FLAGS=...', ...)
  cpus: tuple          # ('taskset', '-c', 'N') or ()
  script: str          # relative to the repository: scripts/decode.py
  args: tuple


def invocation(command: Command) -> Invocation:
  tokens = list(command.tokens)
  env = []
  while '=' in tokens[0] and not tokens[0].startswith('-'):
    env.append(tokens.pop(0))
  cpus = tuple(tokens[:3]) if tokens[0] == 'taskset' else ()
  tokens = tokens[len(cpus):]
  if tokens[0] in ('python', 'python3', 'bash'):
    tokens.pop(0)
  script = tokens[0] if '/' in tokens[0] else f'scripts/{tokens[0]}'
  return Invocation(tuple(env), cpus, script, tuple(tokens[1:]))


def _launched(inv: Invocation):
  """The script launch_local.py runs, with the flags it adds to each process, or None."""
  if inv.script != 'scripts/launch_local.py' or '--' not in inv.args:
    return None
  inner = list(inv.args[inv.args.index('--') + 1:])
  return Invocation((), (), inner[0], tuple(inner[1:]) + (
      '--coordinator=127.0.0.1:1', '--num_processes=2', '--process_id=0'))


def _checks(command: Command) -> list:
  """(script, args) pairs to parse for `command`: itself, and what a launcher starts."""
  inv = invocation(command)
  pairs = [(inv.script, list(inv.args))]
  inner = _launched(inv)
  if inner is not None:
    pairs.append((inner.script, list(inner.args)))
  return pairs


# ----------------------------------------------------------------------------------------
# The check: each script parses each command's arguments as it does when run. One process
# runs every script as __main__ with absl's app.run and argparse's parse_args replaced by
# "parse, then stop", so the script's own parsing (dspec.cli: default config, config file
# found, renamed and unknown fields in one `error:` line) is what is checked.


class _Parsed(Exception):
  """Raised where a script's parsing is done and its work would begin."""


def _split_placeholders(args: list) -> tuple:
  """(args to parse, args to check by name only). A `--config=` with a placeholder cannot
  load, so its `--config.<field>` overrides are dropped; any other argument whose value is a
  placeholder (`--process_id=$RANK`) is checked by its name alone."""
  unloadable = any(a.startswith('--config=') and PLACEHOLDER.search(a) for a in args)
  parse, by_name = [], []
  for arg in args:
    name, _, value = arg.partition('=')
    if unloadable and (name == '--config' or name.startswith('--config.')):
      continue
    if PLACEHOLDER.search(name):
      continue
    (by_name if PLACEHOLDER.search(value) else parse).append(arg)
  return parse, by_name


def _unknown_names(by_name: list) -> list:
  """The arguments among `by_name` that name no flag (or config field) of the parsed script."""
  from absl import flags
  unknown = []
  for arg in by_name:
    name = arg.split('=', 1)[0].lstrip('-')
    if name.startswith('config.'):
      node = flags.FLAGS['config'].value
      for part in name.split('.')[1:]:
        if not hasattr(node, 'keys') or part not in node:
          unknown.append(arg)
          break
        node = node[part]
    elif name not in flags.FLAGS and not (name.startswith('no') and name[2:] in flags.FLAGS
                                          and flags.FLAGS[name[2:]].boolean):
      unknown.append(arg)
  return unknown


def _parse_error(script: str, args: list) -> str:
  """'' if `script` parses `args` as it does when run, else what it said (its error line)."""
  from absl import app, flags   # imported in the checking process only
  from dspec import cli

  path = os.path.join(REPO_ROOT, script)
  if not os.path.isfile(path):
    return f'no such script: {script}'
  if not script.endswith('.py'):
    return ''
  parse, by_name = _split_placeholders(args)

  def parse_then_stop(main, argv=None, flags_parser=app.parse_flags_with_usage):
    del main
    positional = flags_parser(argv or sys.argv)[1:]
    raise _Parsed(positional)

  def parse_args_then_stop(self, args=None, namespace=None):
    self.allow_abbrev = False   # the docs spell flags out (`--devices_per` would pass)
    original_parse_args(self, args, namespace)
    raise _Parsed

  original_run, original_parse_args = app.run, argparse.ArgumentParser.parse_args
  flags_before, defaults_before = set(flags.FLAGS), list(cli._default_config)
  argv_before, stderr = sys.argv, io.StringIO()
  app.run, argparse.ArgumentParser.parse_args = parse_then_stop, parse_args_then_stop
  sys.argv = [path] + parse
  try:
    with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
      runpy.run_path(path, run_name='__main__')
    return f'{script} did not reach its argument parsing'
  except _Parsed as parsed:
    positional = parsed.args[0] if parsed.args else []
    if positional:   # an absl script passes these to main(), which ignores them
      return f'arguments that are not flags: {positional}'
    unknown = _unknown_names(by_name)
    return f'unknown flags or config fields: {unknown}' if unknown else ''
  except SystemExit as e:
    return stderr.getvalue().strip() or f'exit status {e.code}'
  finally:
    app.run, argparse.ArgumentParser.parse_args = original_run, original_parse_args
    sys.argv = argv_before
    for name in set(flags.FLAGS) - flags_before:   # the script's flags, `config.*` included
      delattr(flags.FLAGS, name)
    flags.FLAGS.unparse_flags()
    cli._default_config[:] = defaults_before   # define_config's record of the script's default


def _check_all(requests_path: str, results_path: str) -> None:
  """Entry point of the checking process: [[script, args], ...] in, [error, ...] out."""
  sys.path.insert(0, REPO_ROOT)
  # The library modules that define flags, imported once: a script's run only adds its own.
  from dspec import cli, console  # noqa: F401
  with open(requests_path) as f:
    requests = json.load(f)
  with open(results_path, 'w') as f:
    json.dump([_parse_error(script, args) for script, args in requests], f)


# ----------------------------------------------------------------------------------------
# Running a command as written.


def runnable(command: Command) -> bool:
  """Whether it can run here at all: no placeholder, model directory or cluster to fill in."""
  return not (command.wrapped or command.synopsis or PLACEHOLDER.search(command.text)
              or '/path/to/' in command.text)


def _not_run_reason(command: Command):
  return next((why for pattern, why in NOT_RUN if re.search(pattern, command.text)), None)


def _extra_args(command: Command) -> tuple:
  return next((extra for pattern, extra in SHORTENED if re.search(pattern, command.text)), ())


def _outputs_in_repo(args) -> list:
  """The repository-relative paths that output flags name (`--out_dir=runs/x`)."""
  outputs = []
  for arg in args:
    name, _, value = arg.partition('=')
    if name.lstrip('-') in OUTPUT_FLAGS and value and not os.path.isabs(value):
      outputs.append(os.path.normpath(value))
  return outputs


def _scratch_repo(root: str, outputs: list) -> str:
  """A copy of the repository made of links, in which each of `outputs` is absent and the
  folders above it are real: a command writing there leaves the repository as it was."""
  def link(src, dst):
    os.makedirs(dst, exist_ok=True)
    for name in os.listdir(src):
      rel = os.path.relpath(os.path.join(src, name), REPO_ROOT)
      if rel == '.git' or rel in outputs:
        continue
      if any(o.startswith(rel + os.sep) for o in outputs):
        link(os.path.join(src, name), os.path.join(dst, name))
      else:
        os.symlink(os.path.join(src, name), os.path.join(dst, name))
  link(REPO_ROOT, root)
  return root


def _processes_marked(marker: str) -> list:
  """Live processes (not zombies) whose environment holds `marker`."""
  found = []
  for pid in filter(str.isdigit, os.listdir('/proc')):
    try:
      with open(f'/proc/{pid}/environ', 'rb') as f:
        environ = f.read()
      with open(f'/proc/{pid}/stat') as f:
        state = f.read().rsplit(')', 1)[1].split()[0]
    except OSError:
      continue
    if marker.encode() in environ and state != 'Z':
      found.append(int(pid))
  return found


def run_as_written(command: Command, scratch: str) -> tuple:
  """(exit status, stdout, stderr, processes left behind) of `command`, run from the
  repository root, or from a scratch copy of it when it writes inside the repository."""
  inv = invocation(command)
  args = [re.sub(r'(^|=)/tmp/', rf'\g<1>{scratch}/', a) for a in inv.args]
  args += _extra_args(command)
  outputs = _outputs_in_repo(args)
  cwd = _scratch_repo(os.path.join(scratch, 'repo'), outputs) if outputs else REPO_ROOT
  interpreter = [sys.executable] if inv.script.endswith('.py') else ['bash']
  marker = f'dspec-documented-command-{uuid.uuid4()}'
  # JAX_PLATFORMS=cpu: the docs' figures are CPU runs, and on a GPU bench_kernels.py would
  # time for minutes and write into docs/results/.
  env = dict(os.environ, JAX_PLATFORMS='cpu', DSPEC_DOCUMENTED_COMMAND=marker,
             **dict(e.split('=', 1) for e in inv.env))
  env['XLA_FLAGS'] = with_fast_compile(env.get('XLA_FLAGS', ''))   # a command's own, and ours
  proc = subprocess.Popen([*inv.cpus, *interpreter, inv.script, *args], cwd=cwd, env=env,
                          stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, start_new_session=True)
  try:
    out, err = proc.communicate(timeout=RUN_TIMEOUT_S)
  except subprocess.TimeoutExpired:
    os.killpg(proc.pid, signal.SIGKILL)   # launch_local's processes die with it
    out, err = proc.communicate()
    err += (f'\n[took over {RUN_TIMEOUT_S} s: too slow for this test; add it to NOT_RUN '
            'with why]')
  deadline = time.monotonic() + 10
  while _processes_marked(marker) and time.monotonic() < deadline:
    time.sleep(0.2)
  left = _processes_marked(marker)
  for pid in left:
    os.kill(pid, signal.SIGKILL)
  return proc.returncode, out, err, left


# ----------------------------------------------------------------------------------------
# The tests.

COMMANDS = documented_commands()
# Each distinct command runs once (README and RESULTS share some), under its first place.
TO_RUN = list({c.text: c for c in reversed(COMMANDS)
               if runnable(c) and _not_run_reason(c) is None}.values())[::-1]


@pytest.fixture(scope='module')
def parse_errors(tmp_path_factory):
  """{(script, args): its error line or ''} for every check of every command, from one
  process (each script's imports are paid once)."""
  pairs = list(dict.fromkeys((s, tuple(a)) for c in COMMANDS for s, a in _checks(c)))
  folder = tmp_path_factory.mktemp('parse')
  requests, results = folder / 'requests.json', folder / 'results.json'
  requests.write_text(json.dumps(pairs))
  proc = subprocess.run([sys.executable, os.path.abspath(__file__), str(requests),
                         str(results)], cwd=REPO_ROOT, capture_output=True, text=True,
                        timeout=300, stdin=subprocess.DEVNULL,
                        env=dict(os.environ, JAX_PLATFORMS='cpu'))
  assert proc.returncode == 0, proc.stderr[-3000:]
  return dict(zip(pairs, json.loads(results.read_text())))


def test_every_page_has_its_commands():
  counts = {page: sum(c.page == page for c in COMMANDS) for page in PAGES}
  assert counts['README.md'] >= 8 and counts['docs/SCALE.md'] >= 4, counts
  assert counts['docs/RESULTS.md'] >= 25 and counts['docs/DESIGN.md'] >= 2, counts
  assert TO_RUN


def test_commands_are_taken_as_a_reader_copies_them():
  page = """Run it:

```bash
# a comment
pip install -e . && python scripts/decode.py --config=configs/tiny.py \\
    --config.drafter=ngram
```

Inline (`taskset -c 1
python scripts/decode.py --prompt="a b"`; `... --config.seed=3`), and where
`ARGS` = `--config=configs/tiny.py`: `python scripts/benchmark.py $ARGS --out_dir=<dir>`,
`bench_trees.py --shapes=32x8`.
"""
  found = _fenced(page, 'p', {}) + _inline(page, 'p', _variables(page))
  assert [(c.line, c.text) for c in found] == [
      (5, 'python scripts/decode.py --config=configs/tiny.py --config.drafter=ngram'),
      (9, "taskset -c 1 python scripts/decode.py '--prompt=a b'"),
      (10, "taskset -c 1 python scripts/decode.py '--prompt=a b' --config.seed=3"),
      (11, "python scripts/benchmark.py --config=configs/tiny.py '--out_dir=<dir>'"),
      (12, 'bench_trees.py --shapes=32x8')]
  assert not runnable(found[3])


def test_lists_of_commands_not_run_name_documented_commands():
  """A stale pattern would let a command of the same name slip by unrun."""
  for pattern, _ in NOT_RUN + SHORTENED:
    assert any(re.search(pattern, c.text) for c in COMMANDS), pattern


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize('command', COMMANDS, ids=[c.id for c in COMMANDS])
def test_command_is_well_formed(command, parse_errors):
  """The script exists and takes every flag, the config file loads and has every field."""
  for script, args in _checks(command):
    error = parse_errors[script, tuple(args)]
    assert not error, f'{command.id}: {command.text}\n{script}: {error}'


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize('command', TO_RUN, ids=[c.id for c in TO_RUN])
def test_quick_command_runs(command, tmp_path):
  status, _, err, left = run_as_written(command, str(tmp_path))
  assert status == 0 and 'Traceback' not in err, f'{command.text}\n{err[-3000:]}'
  assert not left, f'{command.text} left processes {left} behind'


if __name__ == '__main__':
  _check_all(*sys.argv[1:])
