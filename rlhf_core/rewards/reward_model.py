"""Score responses with a sequence-classification reward model (one scalar per sequence).

What the reward model reads follows verl's reward-model worker:

* ``reward_model.model.input_tokenizer`` null: the actor's own token ids (prompt + response, as
  generated), so the reward model must tokenize as the actor does (``check_same_vocabulary``);
* set: each response decoded with that tokenizer (special tokens kept, then its EOS text removed),
  appended to the prompt messages as an assistant turn, rendered with the reward model's own chat
  template and tokenized with its tokenizer (``rerendered_ids``), the first ``max_length`` tokens kept.

The score is the head's output at the LAST REAL token of each sequence.

Why not just call the model: transformers' ``*ForSequenceClassification`` picks "the rightmost
token that is not ``pad_token_id``", which is wrong whenever a real token equals the pad id (models
whose pad token is their EOS, and a conversation that ends in EOS, score one token too early or
read a pad). Here the position comes from the attention mask instead: batches are right-padded,
the backbone runs once, and the ``score`` head is applied only at each row's last real position.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional, Sequence

import torch
from tqdm.auto import tqdm
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from rlhf_core.config import ConfigError
from rlhf_core.config.resolve import MicroBatching
from rlhf_core.errors import CheckpointError
from rlhf_core.io.timing import MODEL_LOAD, timed
from rlhf_core.models.storage import load_pretrained
from rlhf_core.progress import bar_disabled
from rlhf_core.scoring.logprobs import micro_batch_indices
from rlhf_core.scoring.models import load_tokenizer
from rlhf_core.scoring.held import HeldModels


@dataclass
class RewardModel:
    model: torch.nn.Module  # AutoModelForSequenceClassification, num_labels = 1, eval mode
    tokenizer: object  # its tokenizer (a chat template is needed only to re-render conversations)
    device: torch.device
    path: Optional[Path] = None


def load_reward_model(path: str | Path, device: str | torch.device = "cpu",
                      dtype: torch.dtype = torch.float32) -> RewardModel:
    """Load ``AutoModelForSequenceClassification`` (one label) and its tokenizer from a local dir."""
    path, device = Path(path), torch.device(device)
    model = _read_model(path, device, dtype)
    return RewardModel(model=model, tokenizer=AutoTokenizer.from_pretrained(path), device=device, path=path)


@contextlib.contextmanager
def held_reward_model(path: str | Path, device: torch.device, dtype: torch.dtype, param_offload: bool = False,
                      *, session: HeldModels) -> Iterator[RewardModel]:
    """``load_reward_model``'s model on ``device`` for one scoring pass, held by the session for
    the run and placed by ``reward_model.model.fsdp_config.param_offload`` (``scoring.frozen``)."""
    path = Path(path)

    def load(where: torch.device) -> torch.nn.Module:
        with timed(MODEL_LOAD):
            return _read_model(path, where, dtype)

    with session.frozen.on_device("reward_model", path, device, param_offload, (str(dtype),), load) as model:
        yield RewardModel(model=model, tokenizer=load_tokenizer(path, session=session, shared=True), device=device,
                          path=path)


def _read_model(path: Path, where: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    if not (path / "config.json").is_file():
        raise CheckpointError(f"reward_model.model.path={str(path)!r} is not a Hugging Face model "
                              "directory (no config.json); give a local sequence-classification model")
    model = load_pretrained(AutoModelForSequenceClassification, path, num_labels=1, dtype=dtype,
                            attn_implementation="sdpa")
    if model.config.num_labels != 1:
        raise CheckpointError(f"reward model at {path} has {model.config.num_labels} labels; a reward "
                              "model must output one score")
    return model.to(where).eval()


def conversation_ids(rm: RewardModel, messages: Sequence[dict], response_text: str) -> list[int]:
    """Token ids of prompt messages + the response as an assistant turn, in the RM's template."""
    if getattr(rm.tokenizer, "chat_template", None) is None:
        raise CheckpointError(f"the reward model's tokenizer ({rm.path}) has no chat template, so a conversation "
                              "cannot be re-rendered for it; add one to its tokenizer_config.json, or set "
                              "reward_model.model.input_tokenizer=null if it tokenizes as the actor does")
    chat = [{"role": m["role"], "content": m["content"]} for m in messages]
    chat.append({"role": "assistant", "content": response_text})
    text = rm.tokenizer.apply_chat_template(chat, add_generation_prompt=False, tokenize=False)
    return rm.tokenizer(text, add_special_tokens=False)["input_ids"]


def decoded_response(input_tokenizer, response_ids: Sequence[int]) -> str:
    """A response as verl hands it to the reward model's template: decoded with special tokens
    kept, then every occurrence of the EOS token's text removed."""
    text = input_tokenizer.decode(list(response_ids))
    eos = getattr(input_tokenizer, "eos_token", None)
    return text.replace(eos, "") if eos else text


def rerendered_ids(rm: RewardModel, messages: Sequence[dict], response_ids: Sequence[int], input_tokenizer,
                   max_length: int) -> list[int]:
    """The RM's token ids for a response generated with ``input_tokenizer``: decoded, re-rendered
    in the RM's chat template, and cut to the first ``max_length`` tokens (verl's right truncation)."""
    return conversation_ids(rm, messages, decoded_response(input_tokenizer, response_ids))[:max_length]


def check_same_vocabulary(rm: RewardModel, actor_tokenizer, actor_path: object) -> None:
    """Refuse to feed the actor's token ids to a reward model whose tokenizer maps them to other
    tokens (verl would score garbage silently)."""
    if rm.tokenizer.get_vocab() != actor_tokenizer.get_vocab():
        raise ConfigError(
            f"reward_model.model.input_tokenizer is null, so the reward model reads the actor's token ids, but its "
            f"tokenizer differs from the actor's ({actor_path}); set reward_model.model.input_tokenizer to the "
            "actor's model path (verl's default) to decode responses and re-render them with the reward "
            "model's chat template")


def _right_padded(batch: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, L) input ids right-padded with ``pad_id`` and the (B, L) attention mask."""
    width = max(len(ids) for ids in batch)
    input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, ids in enumerate(batch):
        input_ids[row, :len(ids)] = torch.as_tensor(list(ids), dtype=torch.long)
        mask[row, :len(ids)] = 1
    return input_ids, mask


@torch.no_grad()
def score_token_batch(rm: RewardModel, batch: Sequence[Sequence[int]]) -> torch.Tensor:
    """(B,) scores at each sequence's last real token, for a batch of token-id lists."""
    pad_id = rm.tokenizer.pad_token_id if rm.tokenizer.pad_token_id is not None else 0
    input_ids, mask = _right_padded(batch, pad_id)
    input_ids, mask = input_ids.to(rm.device), mask.to(rm.device)
    last = mask.sum(dim=1) - 1  # (B,) index of the last real token (right padding)
    rows = torch.arange(len(batch), device=rm.device)
    head = getattr(rm.model, "score", None)
    backbone = getattr(rm.model, rm.model.base_model_prefix, None)
    if isinstance(head, torch.nn.Linear) and backbone is not None:
        hidden = backbone(input_ids=input_ids, attention_mask=mask, use_cache=False).last_hidden_state
        return head(hidden[rows, last]).float()[:, 0]  # (B, H) → (B,)
    # another head layout: let the model pool, after checking it can find the right token
    if bool((input_ids[rows, last] == pad_id).any()):
        raise CheckpointError("reward model: a sequence ends in the pad token and this model class pools "
                              "by pad id; give the tokenizer a pad token distinct from EOS")
    return rm.model(input_ids=input_ids, attention_mask=mask, use_cache=False).logits.float()[:, 0]


def score_sequences(rm: RewardModel, sequences: Sequence[Sequence[int]], batching: MicroBatching, *,
                    budget_key: str = "critic.forward_max_token_len_per_gpu",
                    progress: Optional[bool] = None) -> list[float]:
    """Scores of token-id sequences, one right-padded forward per micro-batch: by token budget
    with ``batching.use_dynamic_bsz``, else ``batching.micro_batch_size`` sequences at a time
    (taken in length order so each batch pads little). Scores come back in the input order."""
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
    lengths = [len(sequences[i]) for i in order]
    scores = [0.0] * len(sequences)
    batches = micro_batch_indices(lengths, batching, budget_key)
    for batch in tqdm(batches, desc="reward model", unit="batch", disable=bar_disabled(progress), leave=False):
        chunk = [order[k] for k in batch]
        for i, value in zip(chunk, score_token_batch(rm, [sequences[i] for i in chunk]).tolist()):
            scores[i] = value
    return scores


def score_conversations(rm: RewardModel, prompts: Sequence[Sequence[dict]], responses: Sequence[str],
                        micro_batch_size: int = 16, progress: Optional[bool] = None) -> list[float]:
    """Scores for (prompt messages, response text) pairs in the RM's template, ``micro_batch_size``
    at a time; scores come back in the input order."""
    ids = [conversation_ids(rm, p, r) for p, r in zip(prompts, responses)]
    return score_sequences(rm, ids, MicroBatching(False, 0, micro_batch_size), progress=progress)
