"""Tiny models built from configs (no download) for tests in every distribution."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from peft import PeftModel
    from transformers import GPT2LMHeadModel, LlamaForCausalLM

__all__ = ["causal_lm_loss", "tiny_gpt2", "tiny_llama", "tiny_mlp", "with_lora"]


def tiny_mlp(
    in_features: int = 8, hidden: int = 16, classes: int = 4, *, seed: int = 0
) -> torch.nn.Sequential:
    """A two-layer tanh MLP (``torch.nn.Sequential``), deterministic for ``seed``.

    >>> tiny_mlp()[0]
    Linear(in_features=8, out_features=16, bias=True)
    """
    import torch

    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(in_features, hidden),
        torch.nn.Tanh(),
        torch.nn.Linear(hidden, classes),
    )


def tiny_llama(
    *,
    hidden_size: int = 32,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    intermediate_size: int = 64,
    vocab_size: int = 128,
    attn_implementation: str = "eager",
    seed: int = 0,
    **config: Any,
) -> LlamaForCausalLM:
    """A randomly initialised ``LlamaForCausalLM`` from a ``LlamaConfig`` (eval mode).

    Needs ``transformers``. Extra keyword arguments go to the config.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    options: dict[str, Any] = {
        "hidden_size": hidden_size,
        "num_hidden_layers": num_hidden_layers,
        "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_key_value_heads,
        "intermediate_size": intermediate_size,
        "vocab_size": vocab_size,
        "max_position_embeddings": 256,
        "attn_implementation": attn_implementation,
        **config,
    }
    model = LlamaForCausalLM(LlamaConfig(**options))
    model.train(False)  # eval(), which transformers leaves unannotated
    return model


def tiny_gpt2(
    *,
    n_embd: int = 32,
    n_layer: int = 2,
    n_head: int = 4,
    vocab_size: int = 128,
    n_positions: int = 64,
    attn_implementation: str = "eager",
    seed: int = 0,
    **config: Any,
) -> GPT2LMHeadModel:
    """A randomly initialised ``GPT2LMHeadModel`` (tied ``lm_head``/``wte``), dropout off."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    options: dict[str, Any] = {
        "n_embd": n_embd,
        "n_layer": n_layer,
        "n_head": n_head,
        "vocab_size": vocab_size,
        "n_positions": n_positions,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "attn_implementation": attn_implementation,
        **config,
    }
    model = GPT2LMHeadModel(GPT2Config(**options))
    model.train(False)  # eval(), which transformers leaves unannotated
    return model


def with_lora(
    model: torch.nn.Module,
    *,
    r: int = 4,
    target_modules: tuple[str, ...] = ("q_proj", "v_proj"),
    seed: int = 0,
) -> PeftModel:
    """Wrap ``model`` with PEFT LoRA adapters; only the adapters are trainable.

    The adapters get random (not zero) ``lora_B`` weights so every adapter receives a
    non-trivial gradient — tests compare real numbers, not zeros. Needs ``peft``.
    """
    import torch
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    cfg = LoraConfig(
        r=r, lora_alpha=2 * r, target_modules=list(target_modules), init_lora_weights=False
    )
    return get_peft_model(model, cfg)


def causal_lm_loss(fmodel: Callable[..., Any]) -> Callable[..., torch.Tensor]:
    """Per-example loss ``loss_fn(trainable, frozen, input_ids, labels)`` for a causal LM.

    ``input_ids`` and ``labels`` are one example (``[S]``); no attention mask is passed (a
    2-D mask does not work under ``vmap``).
    """

    def loss_fn(
        trainable: dict[str, torch.Tensor],
        frozen: dict[str, torch.Tensor],
        input_ids: torch.Tensor,
        labels: torch.Tensor,
    ) -> torch.Tensor:
        out = fmodel(
            (trainable, frozen),
            input_ids=input_ids[None],
            labels=labels[None],
            use_cache=False,
        )
        loss: torch.Tensor = out.loss
        return loss

    return loss_fn
