"""The end-of-turn token read from a chat template, and the pad token's embedding trained like any other."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlhf_core.errors import CheckpointError
from rlhf_core.models.chat import end_of_turn_id, train_every_token_embedding


@pytest.fixture
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def test_the_end_of_turn_is_the_token_that_closes_an_assistant_turn(tokenizer):
    assert tokenizer.convert_ids_to_tokens(end_of_turn_id(tokenizer)) == "<|im_end|>"


def test_it_is_the_templates_token_even_when_the_tokenizer_ends_text_with_another(tokenizer):
    """Qwen2.5's base tokenizer: EOS <|endoftext|>, turns closed by <|im_end|>."""
    tokenizer.eos_token = "<|endoftext|>"
    assert tokenizer.convert_ids_to_tokens(end_of_turn_id(tokenizer)) == "<|im_end|>"


def test_without_a_template_it_is_eos_and_without_either_it_refuses(tokenizer):
    tokenizer.chat_template = None
    assert end_of_turn_id(tokenizer) == tokenizer.eos_token_id
    tokenizer.eos_token = None
    with pytest.raises(CheckpointError, match="could never stop"):
        end_of_turn_id(tokenizer)


def test_the_pad_tokens_embedding_row_gets_its_gradient(tiny_model_dir, tokenizer):
    """With pad == <|im_end|> (SmolLM2), Hugging Face's padding_idx would zero the gradient of the row
    every prompt's turn ends use; after ``train_every_token_embedding`` it is the row's true gradient."""
    end = end_of_turn_id(tokenizer)
    ids = torch.tensor([[5, end, 7, 9, end, 11]])

    def embedding_grad(pad_id: int, fix: bool) -> torch.Tensor:
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, pad_token_id=pad_id, dtype=torch.float32)
        if fix:
            train_every_token_embedding(model)
        model(input_ids=ids).logits.sum().backward()
        return model.get_input_embeddings().weight.grad

    other_pad = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert embedding_grad(end, fix=False)[end].abs().sum() < embedding_grad(other_pad, fix=False)[end].abs().sum()
    torch.testing.assert_close(embedding_grad(end, fix=True), embedding_grad(other_pad, fix=False))
