"""Every Python example in docs/ and README.md runs as shown, by itself, so the docs cannot rot.

The rules a page follows (what a reader who copies a block gets):

* A ```` ```python ```` block is a **complete program**. The test runs each block alone, exactly
  as shown, as ``example.py`` in its own empty temporary directory — a fresh namespace with
  nothing but what the block itself defines or imports: no prelude, no name from an earlier
  block of the page, no code from a (collapsed) admonition around or before it. A block that
  continues another repeats the setup it needs, visibly, in its own text; build the tiny model
  and batch the example needs in the block itself.
* A fragment that truly cannot run by itself — a signature, code that only runs inside a
  ``torchrun`` worker — carries a visible title starting with "Excerpt", which the page shows
  above the block: ```` ```python title="Excerpt: runs in every torchrun worker" ````. The test
  checks that it parses, never runs it.

There is no hidden skip list and no hidden mark: an HTML comment ``<!-- docs-test ... -->`` fails
the test. :func:`undefined_names` finds, without running anything, a name a block uses but
never defines (what a fresh interpreter reports as ``NameError``); running the blocks
(:data:`tests/_docs_runner.py`) finds everything else.
"""

from __future__ import annotations

import ast
import builtins
import json
import os
import re
import subprocess
import symtable
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
RUNNER = Path(__file__).resolve().parent / "_docs_runner.py"
FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>```+|~~~+)\s*(?P<info>[^\n`]*)$")
TITLE = re.compile(r"""\btitle=(?:"(?P<dq>[^"]*)"|'(?P<sq>[^']*)')""")
HIDDEN_MARK = re.compile(r"<!--\s*docs-test\b")
_MODULE_NAMES = {"__name__", "__file__", "__doc__", "__builtins__", "__spec__", "__loader__"}


@dataclass(frozen=True)
class Example:
    """One ```python block of a page."""

    page: str
    line: int
    code: str  # the block's text, as the page shows it: the whole program the test runs
    title: str = ""

    @property
    def is_excerpt(self) -> bool:
        return self.title.lower().startswith("excerpt")

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def python_blocks(text: str, page: str) -> list[Example]:
    """The ```python blocks of a Markdown page (indented ones too: lists, admonitions)."""
    lines = text.splitlines()
    blocks: list[Example] = []
    i = 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        fence, indent, info = match["fence"], match["indent"], match["info"]
        language = (info.split() or [""])[0].lower()
        start = i
        body = []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append(lines[i][len(indent) :] if lines[i].startswith(indent) else lines[i])
            i += 1
        i += 1
        if language not in ("python", "py"):
            continue
        code = "\n".join(body) + "\n"
        title_match = TITLE.search(info)
        title = (title_match["dq"] or title_match["sq"] or "") if title_match else ""
        blocks.append(Example(page, start + 1, code, title))
    return blocks


def undefined_names(source: str) -> set[str]:
    """Names the code reads at module level (directly or from a function) but never binds.

    What ``NameError`` would report in a fresh interpreter, found without running the code
    (the order of definitions is left to the run). Empty for code with ``import *``.

    >>> sorted(undefined_names("import torch\\nx = torch.ones(2)\\nprint(model(x), len(x))"))
    ['model']
    """
    tree = ast.parse(source)
    if any(
        isinstance(node, ast.ImportFrom) and any(a.name == "*" for a in node.names)
        for node in ast.walk(tree)
    ):
        return set()
    module = symtable.symtable(source, "<example>", "exec")
    defined = set(dir(builtins)) | _MODULE_NAMES
    used: set[str] = set()
    for symbol in module.get_symbols():
        if symbol.is_assigned() or symbol.is_imported():
            defined.add(symbol.get_name())
        elif symbol.is_referenced():
            used.add(symbol.get_name())
    tables = list(module.get_children())
    while tables:
        table = tables.pop()
        tables.extend(table.get_children())
        for symbol in table.get_symbols():
            if symbol.is_declared_global() and symbol.is_assigned():
                defined.add(symbol.get_name())
            elif symbol.is_global() and symbol.is_referenced():
                used.add(symbol.get_name())
    return used - defined


def _page_files() -> list[Path]:
    return [*sorted(DOCS.rglob("*.md")), ROOT / "README.md"]


def _page_name(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _examples() -> list[Example]:
    return [
        block
        for path in _page_files()
        for block in python_blocks(path.read_text(encoding="utf-8"), _page_name(path))
    ]


EXAMPLES = _examples()
RUNNABLE = [e for e in EXAMPLES if not e.is_excerpt]
EXCERPTS = [e for e in EXAMPLES if e.is_excerpt]


def run_programs(
    programs: dict[str, str], workdir: Path, **env_vars: str
) -> dict[str, dict[str, object]]:
    """Run each program alone (tests/_docs_runner.py): id -> {"rc", "output", "seconds", ...}."""
    jobs = workdir / "jobs.json"
    results = workdir / "results.json"
    jobs.write_text(json.dumps([{"id": k, "code": v} for k, v in programs.items()]), "utf-8")
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPAKE_")}
    env.setdefault("MPLBACKEND", "Agg")
    env["PYTHONWARNINGS"] = "ignore::FutureWarning,ignore::DeprecationWarning"
    env.update(env_vars)
    subprocess.run(
        [sys.executable, str(RUNNER), str(jobs), str(results)],
        cwd=workdir,
        env=env,
        stdin=subprocess.DEVNULL,
        timeout=3600,
        check=True,
    )
    return json.loads(results.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def example_results(tmp_path_factory) -> dict[str, dict]:
    return run_programs({e.id: e.code for e in RUNNABLE}, tmp_path_factory.mktemp("docs"))


def test_the_parser_finds_every_block_and_each_is_its_own_program():
    text = textwrap.dedent(
        """\
        Intro.

        ```python
        x = 1
        ```

        ```python title="Excerpt: a signature"
        def f(x: Model) -> None: ...
        ```

        ```bash
        opake info
        ```

        ??? example "Setup: a tiny model"

            ```python
            model = 2
            ```

        - a list item:

            ```python
            z = model + 1
            ```

        ```python
        w = 3
        ```
        """
    )
    blocks = python_blocks(text, "page.md")
    assert [b.code for b in blocks] == [
        "x = 1\n",
        "def f(x: Model) -> None: ...\n",
        "model = 2\n",
        "z = model + 1\n",
        "w = 3\n",
    ]
    assert [b.is_excerpt for b in blocks] == [False, True, False, False, False]
    # a (collapsed) "Setup" admonition lends nothing to the block after it: that block is run
    # alone, as shown, and fails (here: NameError) until it repeats the setup itself
    assert [b.line for b in blocks] == [3, 7, 17, 23, 27]
    assert undefined_names(blocks[3].code) == {"model"}


def test_undefined_names_finds_what_a_fresh_interpreter_would_not_know():
    assert undefined_names("grads = grad_fn(params, batch_x)") == {"grad_fn", "params", "batch_x"}
    assert undefined_names("def f(a):\n    return a + model\n") == {"model"}
    assert undefined_names("class C:\n    y = torch.ones(1)\n") == {"torch"}
    assert undefined_names("[b for b in batches]") == {"batches"}
    defined = """
import torch
from torch import nn as tnn
def f(x, *args, k=1, **kw):
    global G
    G = x
    return [y + k for y in args], len(kw), tnn
with open(__file__) as fh:
    first = fh.readline()
for i in range(2):
    pass
try:
    pass
except ValueError as err:
    print(err)
print(f(1), G, i, first, (n := 3), n, torch)
"""
    assert undefined_names(defined) == set()


def test_no_hidden_marks():
    """A block that cannot run is titled "Excerpt ..." on the page, never marked invisibly."""
    marked = [
        _page_name(p) for p in _page_files() if HIDDEN_MARK.search(p.read_text(encoding="utf-8"))
    ]
    assert not marked, (
        f"'<!-- docs-test ... -->' is not honoured (pages: {marked}): make the block complete, "
        "repeat the setup it needs in the block itself, or title it "
        '```python title="Excerpt: why it cannot run alone"'
    )


@pytest.mark.parametrize("example", EXCERPTS, ids=lambda e: e.id)
def test_excerpt_parses(example):
    ast.parse(example.code, f"{example.page}, line {example.line}")


@pytest.mark.parametrize("example", RUNNABLE, ids=lambda e: e.id)
def test_example_uses_only_names_it_defines(example):
    missing = undefined_names(example.code)
    assert not missing, (
        f"{example.id}: the example uses {sorted(missing)} without defining them; pasted "
        "into a fresh python it fails with NameError. Define them in the block itself (repeat "
        "the setup of the block it continues, visibly)."
    )


@pytest.mark.parametrize("fresh", ["", "1"], ids=["forked", "fresh-interpreter"])
def test_the_runner_runs_each_program_alone(tmp_path, fresh):
    """No prelude and nothing shared: a name from another program, or a module the runner
    imported but the program did not, is a NameError."""
    programs = {
        "defines": "import torch\nmodel = torch.nn.Linear(2, 3)\nprint(model.out_features)",
        "uses": "print(model)",
        "not_imported": "print(torch.ones(1))",
        "syntax": "f(a=1, ...)",
        "exits": "import sys\nsys.exit(3)",
        "at_exit": "import atexit\natexit.register(print, 'bye')",
    }
    results = run_programs(
        programs, tmp_path, DOCS_TEST_FRESH_INTERPRETER=fresh, DOCS_TEST_PRELOAD="torch"
    )
    assert {k: r["rc"] for k, r in results.items()} == {
        "defines": 0,
        "uses": 1,
        "not_imported": 1,
        "syntax": 1,
        "exits": 3,
        "at_exit": 0,
    }
    assert results["at_exit"]["output"].strip() == "bye"
    assert results["defines"]["output"].strip() == "3"
    assert "NameError: name 'model' is not defined" in results["uses"]["output"]
    assert "NameError: name 'torch' is not defined" in results["not_imported"]["output"]
    assert "SyntaxError" in results["syntax"]["output"]


def test_the_runner_stops_a_program_and_what_it_started_at_the_timeout(tmp_path):
    program = textwrap.dedent(
        """\
        import subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        print("child", child.pid, flush=True)
        time.sleep(60)
        """
    )
    results = run_programs(
        {"sleeps": program}, tmp_path, DOCS_TEST_TIMEOUT="2", DOCS_TEST_PRELOAD=""
    )
    output = results["sleeps"]["output"]
    assert results["sleeps"]["rc"] == 124
    assert "killed after 2 s" in output
    child = int(re.search(r"child (\d+)", output)[1])
    deadline = time.monotonic() + 10
    while _is_running(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _is_running(child)


def _is_running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


@pytest.mark.slow
@pytest.mark.parametrize("example", RUNNABLE, ids=lambda e: e.id)
def test_example_runs_alone(example, example_results):
    result = example_results[example.id]
    assert result["rc"] == 0, (
        f"the example at {example.id} fails when run alone in a fresh interpreter (exit "
        f"{result['rc']}); make it complete, or title a fragment "
        f'```python title="Excerpt: why"```:\n{result["output"]}'
    )


def test_documented_epsilon_tables_are_what_the_command_prints(capsys):
    """Each ```bash opake epsilon ...``` example in the CLI guide is followed by its output."""
    import shlex

    from opake.cli import main

    text = (DOCS / "guide" / "cli.md").read_text(encoding="utf-8")
    pairs = re.findall(r"```bash\n(opake epsilon [^\n]+)\n```\s*```text\n(.*?)```", text, re.S)
    assert len(pairs) >= 2
    for command, shown in pairs:
        assert main(shlex.split(command)[1:]) == 0
        assert capsys.readouterr().out.strip() == shown.strip(), command
