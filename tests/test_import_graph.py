"""The import graph of `dspec` and `pallas_kernels` (parsed, nothing imported): no cycles,
and no module imports one of a higher layer. Every import counts, at module level or
inside a function: a lazy import is a dependency all the same."""

import ast
import collections
import functools
import os

from conftest import REPO_ROOT

PACKAGES = ('dspec', 'pallas_kernels')

# Layers, lowest first: a module may import its own layer and the ones below. A pattern
# is a module, or `package.*` for a package and everything in it; a module belongs to the
# layer of its longest matching pattern.
LAYERS = (
    ('kernels', ('pallas_kernels.*',)),
    ('base', ('dspec.errors', 'dspec.files', 'dspec.pytrees', 'dspec.console',
              'dspec.compiled_programs', 'dspec.metrics',
              'dspec.drafter_kinds')),   # the drafter kinds' table: names, imports nothing
    ('core', ('dspec.checkpoint', 'dspec.config_checks', 'dspec.sampling', 'dspec.tokenizer',
              'dspec.datasets', 'dspec.distributed')),
    ('models', ('dspec.models.*',)),
    ('formats', ('dspec.models.formats.*',)),     # the models' checkpoint formats
    ('loading', ('dspec.hf_import', 'dspec.hf_export', 'dspec.sharding', 'dspec.loading')),
    ('structured', ('dspec.structured.*',)),    # constraints and their matchers
    ('decoding', ('dspec.decoding.*',)),
    ('training and bench', ('dspec.training.*', 'dspec.bench.*')),
    ('api', ('dspec.api', 'dspec')),
    ('cli', ('dspec.cli',)),
)


def _modules() -> tuple:
  """({dotted module name: file}, the names that are packages)."""
  modules, packages = {}, set()
  for top in PACKAGES:
    for folder, _, files in os.walk(os.path.join(REPO_ROOT, top)):
      for file in files:
        if not file.endswith('.py'):
          continue
        path = os.path.join(folder, file)
        name = os.path.relpath(path, REPO_ROOT)[:-len('.py')].replace(os.sep, '.')
        if file == '__init__.py':
          name = name[:-len('.__init__')]
          packages.add(name)
        modules[name] = path
  return modules, packages


def _imported(node: ast.AST, module: str, is_package: bool, modules: dict) -> list:
  """The project modules an Import / ImportFrom node imports (`from p import m` is module
  p.m when there is one, else p)."""

  def known(name: str):
    while name and name not in modules:
      name = name.rpartition('.')[0]
    return name or None

  if isinstance(node, ast.Import):
    return [known(alias.name) for alias in node.names]
  base = node.module or ''
  if node.level:
    parts = module.split('.')
    parts = parts[:len(parts) - node.level + is_package]
    base = '.'.join(parts + ([base] if base else []))
  return [f'{base}.{alias.name}' if f'{base}.{alias.name}' in modules else known(base)
          for alias in node.names]


@functools.cache
def _graph() -> tuple:
  """({module: the project modules it imports}, the package names)."""
  modules, packages = _modules()
  graph = {}
  for module, path in modules.items():
    with open(path) as f:
      tree = ast.parse(f.read(), path)
    graph[module] = set()
    for node in ast.walk(tree):
      if isinstance(node, (ast.Import, ast.ImportFrom)):
        graph[module].update(_imported(node, module, module in packages, modules))
    graph[module] -= {None, module}
  return graph, packages


def _layer(module: str):
  """(index, name) of the module's layer, or None when no pattern matches it."""
  best = None
  for index, (name, patterns) in enumerate(LAYERS):
    for pattern in patterns:
      package = pattern[:-len('.*')] if pattern.endswith('.*') else None
      if module == pattern or package and (module == package or
                                           module.startswith(package + '.')):
        length = len(package or pattern)
        if best is None or length > best[0]:
          best = (length, index, name)
  return best and best[1:]


def _cycle(graph: dict):
  """One import cycle as a list of modules (first = last), or None."""
  state = collections.defaultdict(int)   # 0 unseen, 1 on the path, 2 done
  path = []

  def visit(module):
    state[module] = 1
    path.append(module)
    for dep in sorted(graph[module]):
      if state[dep] == 1:
        return path[path.index(dep):] + [dep]
      if state[dep] == 0:
        found = visit(dep)
        if found:
          return found
    path.pop()
    state[module] = 2
    return None

  for module in sorted(graph):
    if state[module] == 0:
      found = visit(module)
      if found:
        return found
  return None


def test_the_graph_covers_the_project():
  graph, _ = _graph()
  assert len(graph) > 80 and 'dspec.models.formats.registry' in graph
  assert 'dspec.models.formats.dflash' in graph['dspec.models.formats.dspark']
  assert 'dspec.decoding.drafter' in graph['dspec.decoding.drafters.eagle3']


def test_every_module_has_a_layer():
  graph, _ = _graph()
  unplaced = [m for m in sorted(graph) if _layer(m) is None]
  assert not unplaced, f'modules in no layer of LAYERS: {unplaced}'


def test_no_import_cycles():
  graph, _ = _graph()
  cycle = _cycle(graph)
  assert cycle is None, 'import cycle: ' + ' -> '.join(cycle)


def test_no_module_imports_a_higher_layer():
  graph, packages = _graph()
  upward = []
  for module, deps in sorted(graph.items()):
    for dep in sorted(deps):
      if module in packages and dep.startswith(module + '.'):
        continue   # a package's __init__ gathering its own modules
      (low, low_name), (high, high_name) = _layer(module), _layer(dep)
      if high > low:
        upward.append(f'{module} ({low_name}) imports {dep} ({high_name})')
  assert not upward, 'imports from a lower layer to a higher one:\n' + '\n'.join(upward)


ENGINES = ('SpeculativeEngine', 'TreeEngine', 'VerifyLengthController', 'HostEngine')
# Where an engine may be constructed: the builder, and the controller it builds, which
# makes its own tier engines (a host engine's tiers share its session: `with_width`).
ENGINE_BUILDERS = {('dspec/decoding/runner.py', 'speculative_engine'),
                   ('dspec/decoding/controller.py', '__init__'),
                   ('dspec/decoding/controller.py', 'make'),
                   ('dspec/decoding/host_loop.py', 'with_width')}


class _EngineCalls(ast.NodeVisitor):
  """(line, innermost enclosing function, engine class) of every engine construction."""

  def __init__(self):
    self.stack, self.calls = ['<module>'], []

  def visit_FunctionDef(self, node):
    self.stack.append(node.name)
    self.generic_visit(node)
    self.stack.pop()

  visit_AsyncFunctionDef = visit_FunctionDef

  def visit_Call(self, node):
    name = getattr(node.func, 'id', None) or getattr(node.func, 'attr', None)
    if name in ENGINES:
      self.calls.append((node.lineno, self.stack[-1], name))
    self.generic_visit(node)


def test_engines_are_built_only_by_speculative_engine():
  """The library, the benchmarks and the scripts build every engine through
  `runner.speculative_engine` (one builder: placement, fallback and controller stay in
  one place)."""
  found = []
  for top in ('dspec', 'scripts'):
    for folder, _, files in os.walk(os.path.join(REPO_ROOT, top)):
      for file in (f for f in files if f.endswith('.py')):
        path = os.path.join(folder, file)
        rel = os.path.relpath(path, REPO_ROOT)
        with open(path) as f:
          calls = _EngineCalls()
          calls.visit(ast.parse(f.read()))
        found += [f'{rel}:{line} ({func}) builds {name}' for line, func, name in calls.calls
                  if (rel, func) not in ENGINE_BUILDERS]
  assert not found, 'engines built outside runner.speculative_engine:\n' + '\n'.join(found)
