"""Scoring throughput: actor + reference + critic passes over packed micro-batches vs padded batches.

    python benchmarks/bench_scoring.py [--prompts 256] [--budget 8192] [--repeats 3] [--seed 0]

Sequences are the embedded arithmetic problems (data/arith/train.jsonl) in the tiny model's chat
template, each followed by its reference solution + EOS as the response (the demo's shapes: prompts
~85-111 tokens, responses ~20-45). Three no-grad passes, as the score stage runs them when the
reference differs from the actor: actor log-probs, reference log-probs (a perturbed copy of the
tiny model, so nothing is reused), critic values. "tokens" counts every prompt + response token fed
to a model. The baseline is the same passes over plain right-padded batches of 16 sequences in file
order (no packing; full log-softmax over response positions). Best of --repeats; wall-clock on this
machine, so other load on the CPUs shows up in the numbers.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from arguments import positive_int  # noqa: E402


def load_sequences(tokenizer, n: int) -> tuple[list[list[int]], list[int]]:
    rows = [json.loads(line) for line in (REPO / "data/arith/train.jsonl").read_text().splitlines()[:n]]
    seqs, plens = [], []
    for r in rows:
        text = tokenizer.apply_chat_template([{"role": "user", "content": r["question"]}],
                                             add_generation_prompt=True, tokenize=False)
        prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
        response = tokenizer(r["answer"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        seqs.append(prompt + response)
        plens.append(len(prompt))
    return seqs, plens


def padded_passes(models, seqs, plens, batch: int = 16) -> float:
    """Seconds for the three passes over right-padded batches (the unpacked baseline)."""
    import torch

    started = time.perf_counter()
    with torch.no_grad():
        for s in range(0, len(seqs), batch):
            chunk = seqs[s:s + batch]
            width = max(map(len, chunk))
            ids = torch.zeros(len(chunk), width, dtype=torch.long)
            mask = torch.zeros(len(chunk), width, dtype=torch.long)
            for i, seq in enumerate(chunk):
                ids[i, :len(seq)] = torch.tensor(seq)
                mask[i, :len(seq)] = 1
            for model in models:
                out = model(input_ids=ids, attention_mask=mask).logits
                if out.shape[-1] > 1:  # a causal LM: log-probs of every position, then keep responses
                    torch.log_softmax(out.float(), dim=-1)
    return time.perf_counter() - started


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=positive_int, default=256)
    ap.add_argument("--budget", type=positive_int, default=8192, help="tokens per packed micro-batch")
    ap.add_argument("--repeats", type=positive_int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlhf_core.models.tiny import build_tiny_model
    from rlhf_core.run.session import RunSession
    from rlhf_core.scoring import (ROW_TOKENS, Throughput, compute_token_logprobs, compute_token_values,
                                   load_causal_lm, load_critic)

    cpu = torch.device("cpu")
    with tempfile.TemporaryDirectory() as tmp:
        actor_dir = build_tiny_model(Path(tmp) / "actor")
        ref_model = AutoModelForCausalLM.from_pretrained(actor_dir)
        torch.manual_seed(args.seed)
        with torch.no_grad():
            for p in ref_model.parameters():
                p.add_(0.01 * torch.randn_like(p))
        ref_model.save_pretrained(Path(tmp) / "ref")
        disk = RunSession()  # every model read from its directory
        actor = load_causal_lm(actor_dir, cpu, torch.float32, session=disk)
        ref = load_causal_lm(Path(tmp) / "ref", cpu, torch.float32, role="reference", session=disk)
        torch.manual_seed(args.seed)
        critic = load_critic(actor_dir, cpu, torch.float32, session=disk)
        seqs, plens = load_sequences(AutoTokenizer.from_pretrained(actor_dir), args.prompts)
    longest = max(map(len, seqs))  # known only once tokenized: checked before any pass is timed
    if longest > args.budget:
        ap.error(f"--budget {args.budget} cannot hold the longest sequence ({longest} tokens); give --budget "
                 f"{longest} or more")

    tokens = 3 * sum(map(len, seqs))
    packed_best, padded_best = 0.0, 0.0
    for _ in range(args.repeats):
        meter = Throughput()
        for model, desc in ((actor, "actor"), (ref, "reference")):
            compute_token_logprobs(model, seqs, plens, args.budget, 1.0, desc=desc, throughput=meter, progress=False)
        compute_token_values(critic, seqs, plens, args.budget, throughput=meter, progress=False)
        packed_best = max(packed_best, meter.tokens_per_s)
        padded_best = max(padded_best, tokens / padded_passes((actor, ref, critic), seqs, plens))
    rows = f"at least {ROW_TOKENS} tokens wide" if ROW_TOKENS else "as wide as the longest sequence"
    print(f"{len(seqs)} sequences, {tokens // 3:,} tokens each pass, budget {args.budget}, rows {rows}, "
          f"torch threads {torch.get_num_threads()}")
    print(f"packed   actor+ref+critic: {packed_best:10,.0f} tokens/s")
    print(f"padded16 actor+ref+critic: {padded_best:10,.0f} tokens/s   ratio packed/padded {packed_best / padded_best:.2f}")


if __name__ == "__main__":
    main()
