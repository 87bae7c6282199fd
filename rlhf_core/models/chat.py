"""What a tokenizer's chat template says about a turn: the token that ends the assistant's.

A chat model stops a response with the token its template closes a turn with (``<|im_end|>`` in
ChatML), which need not be the tokenizer's EOS (Qwen2.5's base tokenizer ends text with
``<|endoftext|>`` and turns with ``<|im_end|>``). The supervised warm start trains the policy to end
its answers with it, and the GGUF import writes it as the generation config's EOS.
"""

from __future__ import annotations

from rlhf_core.errors import CheckpointError

_SENTINEL = "RLHF-END-OF-TURN-PROBE"


def end_of_turn_id(tokenizer) -> int:
    """The token the chat template closes an assistant turn with, read by rendering a turn: the first
    token after its content, when that is a special token; else the tokenizer's EOS. Raises
    ``CheckpointError`` when there is neither."""
    if getattr(tokenizer, "chat_template", None):
        chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _SENTINEL}]
        text = tokenizer.apply_chat_template(chat, tokenize=False)
        if _SENTINEL in text:
            after = text[text.rindex(_SENTINEL) + len(_SENTINEL):]
            ids = tokenizer(after, add_special_tokens=False)["input_ids"] if after else []
            special = {i for i, token in tokenizer.added_tokens_decoder.items() if token.special}
            if ids and ids[0] in special | set(tokenizer.all_special_ids):
                return int(ids[0])
    if tokenizer.eos_token_id is None:
        raise CheckpointError("the tokenizer has no EOS token and its chat template closes a turn with no special "
                              "token, so responses could never stop; use a chat model's tokenizer")
    return int(tokenizer.eos_token_id)


def train_every_token_embedding(model) -> None:
    """Let the pad token's embedding row learn like any other. Hugging Face builds the input embedding
    with ``padding_idx = config.pad_token_id``, which keeps that row's gradient at zero; when the pad
    id is a real token (SmolLM2 pads with its end-of-turn ``<|im_end|>``, which closes every turn of
    every prompt) its embedding would never train. Padding never needs it here: every mask comes from
    lengths, so a padded position's embedding gets no gradient anyway."""
    embedding = model.get_input_embeddings()
    if embedding is not None and getattr(embedding, "padding_idx", None) is not None:
        embedding.padding_idx = None
