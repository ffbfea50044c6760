"""Every Python example in docs/ runs, so the documentation cannot rot.

Each page's ```python blocks run in order in one fresh interpreter (later blocks see what earlier
ones defined), in a temporary working directory. A block that cannot run as written — a sketch
that needs a GPU, a download, or a placeholder name — is marked **explicitly** on the line
before its fence::

    <!-- docs-test: skip (the reason) -->

Pages whose authors have not marked such a block yet are listed in :data:`SKIP` with the reason;
an entry that no longer matches a block fails the test, so the list cannot go stale.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
SKIP_MARK = re.compile(r"<!--\s*docs-test:\s*skip\b.*?-->")
FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>```+|~~~+)\s*(?P<info>[^\n`]*)$")

#: (page, start of the block's first line) -> why it does not run as written
SKIP: dict[tuple[str, str], str] = {
    ("design/fsdp2.md", "from torch.distributed.device_mesh import init_device_mesh"): (
        "sketch with elided arguments (`...`); needs a torch.distributed process group"
    ),
    ("guide/model-families.md", "# opake/models/granite.py (complete)"): (
        "excerpt of a family module with an elided config entry (`...`)"
    ),
    ("guide/model-families.md", "# tests/test_conformance.py of the plugin"): (
        "a plugin's pytest module; tests/test_example_plugin_conformance.py runs it with the "
        "example plugin installed"
    ),
    (
        "guide/model-patches.md",
        "def apply(model: PreTrainedModel, options: PatchOptions) -> FamilyPatch: ...",
    ): ("a signature, not code"),
    ("guide/distributed.md", "fmodel, params = make_functional(unwrap_ddp(ddp_model))"): (
        "fragment: needs a DDP-wrapped model in a torch.distributed process group"
    ),
    ("guide/distributed.md", "from opake.profiling import step_perf"): (
        "fragment: runs inside a torchrun worker (ctx, gather_metrics)"
    ),
}

_TINY_LLAMA = """
import torch
from transformers import LlamaConfig, LlamaForCausalLM

torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(
    vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
    num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32,
    attn_implementation="eager",
))
input_ids = torch.randint(0, 64, (4, 8))
labels = input_ids.clone()
"""

#: page -> code run before the page's examples: the placeholders the text calls "your model",
#: "your batch", ... (never an Opake import the page forgot: that would hide a broken example)
PRELUDE: dict[str, str] = {
    "guide/clipping.md": _TINY_LLAMA,
    "guide/model-patches.md": _TINY_LLAMA,
    "guide/bookkeeping.md": _TINY_LLAMA
    + """
ids = input_ids
mask4d = torch.ones(4, 8, dtype=torch.long)
""",
    "guide/checkpointing.md": _TINY_LLAMA
    + """
block1 = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Tanh())
block2 = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Tanh())
batch_x = torch.randn(5, 6)
from opake.dpsgd.clipping import clipped_grad
from opake.functional import make_functional
""",
    "guide/privacy.md": "N, q, T = 60_000, 256 / 60_000, 2_000\n",
    "guide/profiling.md": """
import torch

device = "cpu"
dataloader = [{"input_ids": torch.zeros(4, 8)} for _ in range(3)]
def train_step(batch):
    return batch["input_ids"].sum()
params = {"w": torch.zeros(3)}
batch_x, batch_y = torch.randn(8, 3), torch.randn(8)
def loss_fn(params, x, y):
    return (params["w"] @ x - y) ** 2
""",
}


@dataclass(frozen=True)
class Block:
    page: str
    line: int
    code: str
    skip: str | None

    @property
    def first_line(self) -> str:
        return next((ln.strip() for ln in self.code.splitlines() if ln.strip()), "")


def python_blocks(text: str, page: str) -> list[Block]:
    """The ```python blocks of a Markdown page, with their explicit skip marks."""
    lines = text.splitlines()
    blocks = []
    i = 0
    previous = ""  # last non-blank line before the current one
    while i < len(lines):
        match = FENCE.match(lines[i])
        if not match:
            if lines[i].strip():
                previous = lines[i].strip()
            i += 1
            continue
        fence, indent = match["fence"], match["indent"]
        language = (match["info"].split() or [""])[0].lower()
        start = i
        body = []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append(lines[i][len(indent) :] if lines[i].startswith(indent) else lines[i])
            i += 1
        i += 1
        if language in ("python", "py"):
            mark = SKIP_MARK.search(previous)
            blocks.append(
                Block(page, start + 1, "\n".join(body) + "\n", mark.group(0) if mark else None)
            )
        previous = ""
    return blocks


def _pages() -> list[Path]:
    return sorted(DOCS.rglob("*.md"))


def _page_blocks(path: Path) -> list[Block]:
    page = path.relative_to(DOCS).as_posix()
    blocks = python_blocks(path.read_text(encoding="utf-8"), page)
    return [Block(b.page, b.line, b.code, b.skip or _listed_skip(b)) for b in blocks]


def _listed_skip(block: Block) -> str | None:
    for (page, start), reason in SKIP.items():
        if page == block.page and block.first_line.startswith(start):
            return reason
    return None


PAGES_WITH_CODE = [p for p in _pages() if any(b.skip is None for b in _page_blocks(p))]


def test_the_parser_finds_blocks_and_marks():
    text = textwrap.dedent(
        """\
        Intro.

        ```python
        x = 1
        ```

        <!-- docs-test: skip (needs a GPU) -->

        ```python
        y = torch.cuda.current_device()
        ```

        ```bash
        opake info
        ```

        - a list item:

            ```python
            z = x + 1
            ```
        """
    )
    blocks = python_blocks(text, "page.md")
    assert [b.code for b in blocks] == [
        "x = 1\n",
        "y = torch.cuda.current_device()\n",
        "z = x + 1\n",
    ]
    assert [b.skip is not None for b in blocks] == [False, True, False]


def test_every_skip_entry_matches_a_block():
    blocks = [
        b
        for p in _pages()
        for b in python_blocks(p.read_text(encoding="utf-8"), p.relative_to(DOCS).as_posix())
    ]
    stale = sorted(
        (page, start)
        for page, start in SKIP
        if not any(b.page == page and b.first_line.startswith(start) for b in blocks)
    )
    assert not stale, f"SKIP entries that match no block any more: {stale}"


@pytest.mark.slow
@pytest.mark.parametrize("path", PAGES_WITH_CODE, ids=lambda p: p.relative_to(DOCS).as_posix())
def test_page_examples_run(path, tmp_path):
    blocks = [b for b in _page_blocks(path) if b.skip is None]
    page = path.relative_to(DOCS).as_posix()
    script = [f"# --- prelude of {page} (tests/test_docs_examples.py)\n", PRELUDE.get(page, "")]
    for block in blocks:
        script.append(f"# --- {block.page}:{block.line}\n")
        script.append(block.code)
    source = tmp_path / "page_examples.py"
    source.write_text("".join(script), encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPAKE_")}
    env.setdefault("MPLBACKEND", "Agg")
    env["PYTHONWARNINGS"] = "ignore::FutureWarning,ignore::DeprecationWarning"
    proc = subprocess.run(
        [sys.executable, str(source)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, (
        f"an example in docs/{path.relative_to(DOCS).as_posix()} failed (blocks start at lines "
        f"{[b.line for b in blocks]}; mark a block that cannot run with "
        f"'<!-- docs-test: skip (reason) -->'):\n{proc.stderr[-4000:]}"
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
