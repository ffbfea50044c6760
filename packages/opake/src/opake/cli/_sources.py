"""Where ``--model`` comes from: a named config, a local directory, a GGUF file or a Hub id.

:func:`locate_model` turns the user's ``--model`` into a :class:`ModelSource` whose ``directory``
is a plain Hugging Face model directory (``config.json``, weights, tokenizer files), or ``None``
for a named config built from scratch:

- a **local directory** written by ``save_pretrained`` — also the ``--out`` directory of an
  ``opake train`` run (its ``model/``);
- a **GGUF file** (``*.gguf``, needs ``pip install 'opake[gguf]'``): de-quantised to fp32 once,
  with its tokenizer, and saved as a Hugging Face directory in Opake's cache
  (``$OPAKE_CACHE_DIR``, default ``~/.cache/opake``), keyed by the file's path, size and
  modification time; later runs load that directory in about a second;
- a **Hugging Face Hub id** (``org/name``): the model's files through the ordinary Hugging Face
  cache — downloaded when online, read from the cache offline (``HF_HUB_OFFLINE=1``); a model
  that is neither cached nor reachable is a one-line error.

>>> locate_model("llama-tiny").kind
'named'
>>> looks_like_hub_id("HuggingFaceTB/SmolLM2-135M"), looks_like_hub_id("./runs/model")
(True, False)
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import sys
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from opake.core.errors import ConfigurationError

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["ModelSource", "gguf_cache_dir", "locate_model", "looks_like_hub_id", "model_help"]

_LOG = logging.getLogger("opake.cli")

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
#: files of a Hub repository a causal LM needs (no other weight formats, no code)
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken"]


@dataclass(frozen=True)
class ModelSource:
    """A resolved ``--model``.

    Attributes:
        spec: what the user gave.
        kind: ``"named"``, ``"directory"``, ``"gguf"`` or ``"hub"``.
        directory: the Hugging Face model directory to load (``None`` for a named config).
    """

    spec: str
    kind: str
    directory: Path | None

    @property
    def pretrained(self) -> bool:
        """Weights come from the source (not a random initialisation)."""
        return self.directory is not None


def model_help(default: str, why: str = "") -> str:
    """The ``--model`` help of every command that takes one (``train``, ``audit``, ``tune``):
    the kinds of source :func:`locate_model` accepts, and the command's *default* (*why* it
    differs from another command's, when it does).

    >>> model_help("llama-small")[:60]
    'a named config built locally: llama-small (default), llama-t'
    """
    from opake.cli._models import NAMED_MODELS

    names = ", ".join(
        [f"{default} (default{why})", *(n for n in sorted(NAMED_MODELS) if n != default)]
    )
    return (
        f"a named config built locally: {names}; or a pretrained model: a local Hugging Face "
        "model directory (also an opake train --out directory), a .gguf file (de-quantised once, "
        "needs opake[gguf]), or a Hugging Face Hub id org/name (through the Hugging Face cache; "
        "offline only if cached)"
    )


def looks_like_hub_id(spec: str) -> bool:
    """``org/name`` with no local file of that name: a Hugging Face Hub model id."""
    return bool(_HUB_ID.match(spec)) and not Path(spec).exists()


def locate_model(spec: str) -> ModelSource:
    """Resolve *spec* to a :class:`ModelSource` (converting or downloading what is needed).

    Raises:
        ConfigurationError: one line saying what was wrong and what to pass instead.
    """
    from opake.cli._models import NAMED_MODELS

    if spec in NAMED_MODELS:
        return ModelSource(spec, "named", None)
    path = Path(spec)
    if path.suffix.lower() == ".gguf":
        return ModelSource(spec, "gguf", _gguf_directory(path, spec))
    if path.is_dir():
        return ModelSource(spec, "directory", _model_directory(path, spec))
    if looks_like_hub_id(spec):
        return ModelSource(spec, "hub", _hub_directory(spec))
    raise ConfigurationError(
        f"--model {spec}: not a local directory nor a named config "
        f"({', '.join(sorted(NAMED_MODELS))}), nor a .gguf file or a Hugging Face Hub id "
        "(org/name)"
    )


def _model_directory(path: Path, spec: str) -> Path:
    if (path / "config.json").is_file():
        return path
    if (path / "model" / "config.json").is_file() and (path / "settings.json").is_file():
        return path / "model"  # the --out directory of an opake train run
    if (path / "adapter_config.json").is_file():
        raise ConfigurationError(
            f"--model {spec}: a LoRA adapter alone (adapter_config.json, no config.json); pass "
            "the run's merged model directory (its model/), or the base model with --lora-r"
        )
    raise ConfigurationError(
        f"--model {spec}: the directory has no config.json; expected a Hugging Face model "
        "directory (save_pretrained output) or an opake train --out directory"
    )


# --------------------------------------------------------------------------- GGUF


def gguf_cache_dir() -> Path:
    """Where de-quantised GGUF models are kept: ``$OPAKE_CACHE_DIR/gguf`` (default
    ``$XDG_CACHE_HOME/opake/gguf``, i.e. ``~/.cache/opake/gguf``)."""
    root = os.environ.get("OPAKE_CACHE_DIR")
    if not root:
        xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        root = str(Path(xdg) / "opake")
    return Path(root) / "gguf"


def _gguf_directory(path: Path, spec: str) -> Path:
    if not path.is_file():
        raise ConfigurationError(f"--model {spec}: the GGUF file does not exist")
    if importlib.util.find_spec("gguf") is None:
        raise ConfigurationError(
            f"--model {spec}: reading GGUF files needs the gguf package: pip install 'opake[gguf]'"
        )
    stat = path.resolve().stat()
    key = hashlib.sha256(
        f"{path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()
    ).hexdigest()[:24]
    target = gguf_cache_dir() / f"{path.stem}-{key}"
    if (target / "config.json").is_file():
        return target
    return _convert_gguf(path.resolve(), target, spec)


def _convert_gguf(path: Path, target: Path, spec: str) -> Path:
    """De-quantise *path* to fp32 and save it with its tokenizer as an HF directory *target*."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from opake.cli._hf import quiet_transformers

    _LOG.info("de-quantising %s into %s (once)", path.name, target)
    print(
        f"model     de-quantising {path.name} to fp32 (once; later runs load {target})",
        file=sys.stderr,
        flush=True,
    )
    quiet_transformers()
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # transformers' notes on GGUF conversion
            try:
                tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
                quantized = AutoModelForCausalLM.from_pretrained(
                    str(path.parent), gguf_file=path.name, dtype=torch.float32
                )
            except (ValueError, OSError, KeyError, RuntimeError) as err:
                first = str(err).strip().splitlines()[0] if str(err).strip() else repr(err)
                raise ConfigurationError(
                    f"--model {spec}: cannot read this GGUF file as a causal LM ({first})"
                ) from None
            # the loaded model carries a GGUF quantization_config and refuses save_pretrained:
            # rebuild a plain fp32 model from the config and copy the de-quantised weights in
            config = quantized.config
            if hasattr(config, "quantization_config"):
                del config.quantization_config
            # transformers leaves from_config unannotated: its result, stated
            from_config: Callable[..., PreTrainedModel] = AutoModelForCausalLM.from_config
            plain = from_config(config, dtype=torch.float32)
            plain.load_state_dict(quantized.state_dict())
            del quantized
            plain.save_pretrained(scratch)
            tokenizer.save_pretrained(scratch)
        (scratch / "opake_source.json").write_text(
            json.dumps({"gguf_file": str(path)}) + "\n", encoding="utf-8"
        )
        try:
            os.replace(scratch, target)
        except OSError:  # another process converted it meanwhile
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return target


# --------------------------------------------------------------------------- Hub


@functools.lru_cache(maxsize=8)
def _hub_directory(repo_id: str) -> Path:
    """The local snapshot of *repo_id* through the ordinary Hugging Face cache."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
    )
    from huggingface_hub.utils.tqdm import disable_progress_bars

    disable_progress_bars()
    try:
        folder = Path(snapshot_download(repo_id, allow_patterns=_HUB_PATTERNS))
        if not any(folder.glob("*.safetensors")):  # an older repository: PyTorch pickles
            folder = Path(snapshot_download(repo_id, allow_patterns=[*_HUB_PATTERNS, "*.bin"]))
    except GatedRepoError:
        raise ConfigurationError(
            f"--model {repo_id}: the Hub model is gated; accept its terms and log in "
            "(hf auth login), or pass a local directory"
        ) from None
    except RepositoryNotFoundError:
        raise ConfigurationError(
            f"--model {repo_id}: no such model on the Hugging Face Hub (or it is private: "
            "log in with hf auth login), and no local directory of that name"
        ) from None
    except (LocalEntryNotFoundError, ConnectionError, OSError):
        raise ConfigurationError(
            f"--model {repo_id}: not in the local Hugging Face cache and the Hub cannot be "
            "reached (offline); download it once with network access, or pass a local directory"
        ) from None
    if not (folder / "config.json").is_file():
        raise ConfigurationError(
            f"--model {repo_id}: the Hub repository has no config.json; expected a "
            "transformers causal LM"
        )
    return folder
