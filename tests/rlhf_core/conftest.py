"""Chat models for the end-of-turn tests (issue 48): the tiny model taught to end its answers with
``<|im_end|>``, in the two pad layouts a real chat model comes in, and SmolLM2's own template.

    tiny          ChatML, pad ``<|endoftext|>`` != EOS ``<|im_end|>``      (the tiny model's case)
    tiny_pad_eos  ChatML, pad == EOS == ``<|im_end|>``, same weights        (same sequences, other pad id)
    smol_like     SmolLM2-135M-Instruct's template (a default system message when none is given),
                  pad == EOS == ``<|im_end|>``, same weights                (SmolLM2's case)

The real SmolLM2 (``data/models/smollm2-135m-instruct``, `make smollm2`) is not in CI: ``smollm2_dir``
skips where it is absent, so the tiny variants carry the coverage.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

SMOLLM2_DIR = Path(__file__).resolve().parents[2] / "data" / "models" / "smollm2-135m-instruct"

SMOLLM2_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
SMOLLM2_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\n" + SMOLLM2_SYSTEM + "<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
"""SmolLM2-135M-Instruct's chat_template.jinja, character for character (a test checks it against the
real file where it exists)."""

CHAT_VARIANTS = ("tiny", "tiny_pad_eos", "smol_like")

# what the tiny model is taught to answer (prompts rendered with its ChatML template), each answer
# followed by <|im_end|>: two answer lengths, so a batch holds responses that stop at different steps
TEACH = (
    [([{"role": "user", "content": f"What is {i} + {2 * i}?"}], "#### 7") for i in range(4)]
    + [([{"role": "user", "content": f"Tom has {i} apples and eats 1. How many are left?"}],
        "He eats one apple, so #### 3") for i in range(2, 5)]
    + [([{"role": "user", "content": "What is 1 + 2?"}, {"role": "assistant", "content": "#### 3"},
         {"role": "user", "content": f"And {i} + 1?"}], "#### 7") for i in range(2)]
)
TEACH_STEPS = 100


def chat_variant(src: Path, out: Path, *, pad_is_eos: bool, chat_template: str | None = None) -> Path:
    """A copy of model directory ``src`` whose tokenizer's pad token is its EOS (``pad_is_eos``) and
    whose chat template is ``chat_template`` (None: kept); config.json and generation_config.json
    (where there is one) name the same pad id, as SmolLM2's do."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    shutil.copytree(src, out)
    tokenizer = AutoTokenizer.from_pretrained(src)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    if pad_is_eos:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.save_pretrained(out)
    config = AutoConfig.from_pretrained(src)
    config.pad_token_id = tokenizer.pad_token_id
    config.save_pretrained(out)
    if (src / "generation_config.json").is_file():  # a causal LM's; a value model has none
        generation = GenerationConfig.from_pretrained(src)
        generation.pad_token_id = tokenizer.pad_token_id
        generation.save_pretrained(out)
    return out


def teach_end_of_turn(src: Path, out: Path) -> Path:
    """``src`` after TEACH_STEPS full-batch Adam steps on TEACH's answers + ``<|im_end|>`` (loss on
    the answer tokens only): greedy responses then stop on the end-of-turn token by themselves,
    also under SmolLM2's template (the random-init model almost never emits it)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(src)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    pairs = []
    for messages, answer in TEACH:
        prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        pairs.append((tok(prompt, add_special_tokens=False)["input_ids"],
                      tok(answer, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]))
    width = max(len(p) + len(r) for p, r in pairs)
    ids = torch.full((len(pairs), width), tok.pad_token_id, dtype=torch.long)  # (B, L) right-padded
    mask = torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    for b, (p, r) in enumerate(pairs):
        ids[b, :len(p) + len(r)] = torch.tensor(p + r)
        mask[b, :len(p) + len(r)] = 1
        labels[b, len(p):len(p) + len(r)] = torch.tensor(r)
    torch.manual_seed(0)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # matmuls this small only lose time to a second thread
    try:
        for _ in range(TEACH_STEPS):
            model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
            optim.step()
            optim.zero_grad()
    finally:
        torch.set_num_threads(threads)
    shutil.copytree(src, out)
    model.save_pretrained(out, safe_serialization=True)
    return out


@pytest.fixture(scope="session")
def chat_models(tiny_model_dir, tmp_path_factory) -> dict[str, Path]:
    """CHAT_VARIANTS → model directory, all three with the same taught weights."""
    root = tmp_path_factory.mktemp("chat_models")
    taught = teach_end_of_turn(tiny_model_dir, root / "tiny")
    return {"tiny": taught,
            "tiny_pad_eos": chat_variant(taught, root / "tiny_pad_eos", pad_is_eos=True),
            "smol_like": chat_variant(taught, root / "smol_like", pad_is_eos=True,
                                      chat_template=SMOLLM2_CHAT_TEMPLATE)}


@pytest.fixture(scope="session")
def chat_critics(chat_models, tmp_path_factory) -> dict[str, Path]:
    """CHAT_VARIANTS → a value model on the taught backbone (one seeded head, saved as the init_critic
    stage saves it), with that variant's pad id."""
    import torch
    from transformers import AutoModelForTokenClassification, AutoTokenizer

    root = tmp_path_factory.mktemp("chat_critics")
    torch.manual_seed(0)
    critic = AutoModelForTokenClassification.from_pretrained(chat_models["tiny"], num_labels=1, dtype=torch.float32)
    critic.save_pretrained(root / "tiny", safe_serialization=True)
    AutoTokenizer.from_pretrained(chat_models["tiny"]).save_pretrained(root / "tiny")
    return {"tiny": root / "tiny",
            "tiny_pad_eos": chat_variant(root / "tiny", root / "tiny_pad_eos", pad_is_eos=True),
            "smol_like": chat_variant(root / "tiny", root / "smol_like", pad_is_eos=True,
                                      chat_template=SMOLLM2_CHAT_TEMPLATE)}


@pytest.fixture(params=CHAT_VARIANTS)
def chat_model(request, chat_models) -> tuple[str, Path]:
    """(variant name, model directory), once per CHAT_VARIANTS."""
    return request.param, chat_models[request.param]


@pytest.fixture(scope="session")
def smollm2_template() -> str:
    return SMOLLM2_CHAT_TEMPLATE


@pytest.fixture(scope="session")
def smollm2_system() -> str:
    """The system message SmolLM2's template inserts when a conversation has none."""
    return SMOLLM2_SYSTEM


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The real SmolLM2-135M-Instruct directory; skipped where it was never imported (CI)."""
    if not (SMOLLM2_DIR / "tokenizer_config.json").is_file():
        pytest.skip(f"SmolLM2-135M-Instruct not found at {SMOLLM2_DIR}; run `make smollm2` to import it")
    return SMOLLM2_DIR
