"""The docs stay a product page: RESULTS.md short with its headline table first, every link
(pages and result reports) resolving, docs/ holding only what the page cites, and no path
outside the repo anywhere."""

import os
import re
import subprocess

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(REPO_ROOT, 'docs')
PAGES = ('README.md', 'docs/RESULTS.md', 'docs/DESIGN.md', 'docs/SCALE.md')
SCANNED = ('.py', '.md', '.sh', '.ipynb', '.json', '.toml', '.cfg', '.yaml', '.yml')
# Paths outside the repo (built from parts so that this file does not match itself).
OUTSIDE = ('/' + 'work/', '..' + '/shared', 'DESIGN ' + '§')


def _read(rel: str) -> str:
  with open(os.path.join(REPO_ROOT, rel), encoding='utf-8') as f:
    return f.read()


def _anchors(text: str) -> set:
  """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
  return {re.sub(r'[^\w\- ]', '', m.group(1).strip().lower()).replace(' ', '-')
          for m in re.finditer(r'^#+\s+(.+)$', text, re.MULTILINE)}


def _links(text: str) -> list:
  """Relative link targets of markdown links and images, outside code blocks."""
  text = re.sub(r'```.*?```', '', text, flags=re.DOTALL)
  return [t for t in re.findall(r'\]\(([^)\s]+)\)', text) if not re.match(r'\w+:', t)]


def _repo_files() -> list:
  """Tracked files (git), else every file outside hidden folders, runs/ and demo/."""
  try:
    out = subprocess.run(['git', 'ls-files'], cwd=REPO_ROOT, capture_output=True,
                         text=True, check=True).stdout.split('\n')
    return [f for f in out if f and os.path.exists(os.path.join(REPO_ROOT, f))]
  except (OSError, subprocess.CalledProcessError):
    files = []
    for folder, dirs, names in os.walk(REPO_ROOT):
      dirs[:] = [d for d in dirs if not d.startswith('.') and d not in ('runs', 'demo')]
      files += [os.path.relpath(os.path.join(folder, n), REPO_ROOT) for n in names]
    return files


def test_results_page_is_short_and_opens_with_the_headline_table():
  text = _read('docs/RESULTS.md')
  assert len(text.splitlines()) <= 400
  first_section = re.search(r'^## (.+)$', text, re.MULTILINE).group(1)
  assert first_section.startswith('Headline')
  headline = text[text.index('## Headline'):].split('\n## ')[0]
  for drafter in ('MTP', 'EAGLE-3', 'DFlash', 'DFlash-2', 'DSpark', 'n-gram', 'suffix'):
    assert re.search(rf'^\| {re.escape(drafter)} \(', headline, re.MULTILINE), drafter
  for column in ('T=0, B=1', 'T=0, B=16', 'T=1, B=1', 'T=1, B=16', 'lossless'):
    assert column in headline


def test_every_link_resolves():
  """Against the tracked files where git is there: a clean clone has nothing else."""
  tracked = set()
  for rel in _repo_files():
    parts = rel.split('/')
    tracked |= {os.path.join(REPO_ROOT, *parts[:i]) for i in range(1, len(parts) + 1)}
  broken = []
  reports = sorted(os.path.relpath(os.path.join(folder, name), REPO_ROOT)
                   for folder, _, names in os.walk(os.path.join(DOCS, 'results'))
                   for name in names if name.endswith('.md'))
  for page in PAGES + tuple(reports):
    text = _read(page)
    for link in _links(text):
      path, _, anchor = link.partition('#')
      target = os.path.normpath(os.path.join(os.path.dirname(os.path.join(REPO_ROOT, page)),
                                             path)) if path else os.path.join(REPO_ROOT, page)
      if not os.path.exists(target) or target.rstrip(os.sep) not in tracked:
        broken.append(f'{page}: {link}')
      elif anchor and anchor not in _anchors(open(target, encoding='utf-8').read()):
        broken.append(f'{page}: {link} (no such heading)')
  assert not broken, broken


def test_sections_the_code_cites_exist():
  """A section name quoted after docs/DESIGN.md or docs/RESULTS.md in code is a heading."""
  headings = {page: {m.group(1).strip() for m in re.finditer(r'^#+\s+(.+)$', _read(page),
                                                             re.MULTILINE)}
              for page in ('docs/DESIGN.md', 'docs/RESULTS.md')}
  cited, missing = 0, []
  for rel in _repo_files():
    if not rel.endswith(('.py', '.sh', '.ipynb')):
      continue
    for m in re.finditer(r'(docs/(?:DESIGN|RESULTS)\.md),?\s*\(?"([^"]+)"', _read(rel)):
      page, section = m.group(1), ' '.join(m.group(2).split())
      cited += 1
      if not any(h == section or h.startswith(section + ':') for h in headings[page]):
        missing.append(f'{rel}: {page} "{section}"')
  assert cited and not missing, missing


def test_docs_hold_only_what_the_page_cites():
  assert sorted(os.listdir(DOCS)) == ['DESIGN.md', 'RESULTS.md', 'SCALE.md', 'results']
  results = _read('docs/RESULTS.md')
  folders = sorted(os.listdir(os.path.join(DOCS, 'results')))
  assert folders
  uncited = [f for f in folders if not re.search(rf'results/{re.escape(f)}\b', results)]
  assert not uncited, uncited


def test_no_path_outside_the_repo():
  offending = []
  for rel in _repo_files():
    # demo/ is shipped too: its checkpoints' orbax markers (*.txt) must not name the writer.
    if not rel.endswith(SCANNED + ('.txt',)) or rel.startswith('runs/'):
      continue
    try:
      text = _read(rel)
    except UnicodeDecodeError:
      continue
    offending += [f'{rel}: {s!r}' for s in OUTSIDE if s in text]
  assert not offending, offending
