"""Model sources of ``opake train`` (directories, run outputs, GGUF files, Hub ids) and LoRA
outputs that load back as they were trained."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import pytest
import torch

from opake.cli import ByteTokenizer
from opake.cli import _sources as sources
from opake.cli._saving import save_trained_model
from opake.core.errors import ConfigurationError


def _tiny_llama(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=257,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM._from_config(config, attn_implementation="eager").eval()


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_lora_outputs_reload_to_the_trained_model(tmp_path):
    """PEFT's own save of the base kept its wrapped names (``q_proj.base_layer.weight``):
    ``from_pretrained`` re-initialised every adapted layer. Both reloads must give the logits of
    the trained model."""
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        model = peft.get_peft_model(
            _tiny_llama(),
            peft.LoraConfig(r=2, target_modules="all-linear", task_type="CAUSAL_LM"),
        )
    torch.manual_seed(1)
    with torch.no_grad():  # a "trained" adapter: B is zero at initialisation
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.5)
    ids = torch.randint(0, 257, (2, 12), generator=torch.Generator().manual_seed(2))
    expected = _logits(model, ids)

    saved = save_trained_model(tmp_path, model, ByteTokenizer(), base=None, save_base=True)
    assert set(saved) == {"model", "adapter", "base_model"}

    merged, info = AutoModelForCausalLM.from_pretrained(
        tmp_path / "model", output_loading_info=True
    )
    assert not info["missing_keys"]
    assert not info["unexpected_keys"]
    torch.testing.assert_close(_logits(merged.eval(), ids), expected, rtol=1e-4, atol=1e-5)

    base, info = AutoModelForCausalLM.from_pretrained(
        tmp_path / "base_model", output_loading_info=True
    )
    assert not info["missing_keys"]
    assert not info["unexpected_keys"]
    torch.testing.assert_close(_logits(base.eval(), ids), _logits(_tiny_llama(), ids))
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str((tmp_path / "base_model").resolve())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        rebuilt = peft.PeftModel.from_pretrained(base.eval(), tmp_path / "adapter")
    torch.testing.assert_close(_logits(rebuilt, ids), expected, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(_logits(_tiny_llama(), ids), expected, atol=1e-3)  # adapter moved it
    assert ByteTokenizer.from_pretrained(tmp_path / "model").vocab_size == 257


def test_a_run_output_is_a_model_source(tmp_path):
    model = tmp_path / "run" / "model"
    _tiny_llama().save_pretrained(model)
    (tmp_path / "run" / "settings.json").write_text("{}")
    assert sources.locate_model(str(model)).directory == model
    assert sources.locate_model(str(tmp_path / "run")).directory == model  # the --out folder
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    with pytest.raises(ConfigurationError, match="LoRA adapter alone"):
        sources.locate_model(str(adapter))


def test_gguf_errors_are_one_line(tmp_path, monkeypatch):
    with pytest.raises(ConfigurationError, match="the GGUF file does not exist"):
        sources.locate_model(str(tmp_path / "absent.gguf"))
    present = tmp_path / "model.gguf"
    present.write_bytes(b"GGUF")
    real_find_spec = sources.importlib.util.find_spec
    monkeypatch.setattr(
        sources.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "gguf" else real_find_spec(name, *a),
    )
    with pytest.raises(ConfigurationError, match=r"pip install 'opake\[gguf\]'"):
        sources.locate_model(str(present))


def test_unknown_source_names_every_kind():
    with pytest.raises(ConfigurationError) as err:
        sources.locate_model("no-such-model")
    message = str(err.value)
    for kind in ("local directory", "named config", ".gguf", "Hub id"):
        assert kind in message


def _fill_hub_cache(cache, repo_id: str) -> None:
    """The layout ``huggingface_hub`` writes: ``models--org--name/{refs/main,snapshots/SHA}``."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    _tiny_llama().save_pretrained(snapshot)
    ByteTokenizer().save_pretrained(snapshot)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)


@pytest.mark.slow
def test_hub_id_from_the_cache_and_one_line_offline_error(tmp_path, tiny_args):
    cache = tmp_path / "hub"
    _fill_hub_cache(cache, "opake-test/tiny-llama")
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    env.pop("HF_HOME", None)
    out = tmp_path / "run"
    argv = tiny_args("--model", "opake-test/tiny-llama", "--steps", "1", out=out)
    absent = tiny_args("--model", "opake-test/absent", out=tmp_path / "r2")
    code = (
        f"import sys; from opake.cli import main; sys.exit(main({argv!r}) * 10 + main({absent!r}))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    # the cached model trains (rc 0); the absent one fails in one line (rc 2)
    assert proc.returncode == 2, proc.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["model_source"] == "opake-test/tiny-llama"
    errors = [line for line in proc.stderr.splitlines() if "error" in line]
    assert errors == [
        (
            "opake train: error: --model opake-test/absent: not in the local Hugging Face cache "
            "and the Hub cannot be reached (offline); download it once with network access, or "
            "pass a local directory"
        )
    ]
