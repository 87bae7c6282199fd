"""Fixed costs a score pass pays for the frozen reference before and after it is held for the run
(``rlhf_core.scoring.frozen``), and for telling an actor from its reference (``same_weights``),
at a real layer shape with random weights on CPU.

    python benchmarks/bench_frozen.py [--layers 24] [--repeats 3]

Reference, per score or guard pass, with the model cache off (``RLHF_MODEL_CACHE_MB=0``, its
default on CUDA):
    before   the reference read from disk (``load_causal_lm``), what every pass paid on CUDA
    after    the held reference's lookup (what each pass after the first pays; with param_offload on
             a GPU add one host-to-device copy, which this CPU cannot measure)

Actor against reference, once per score pass:
    before   sha256 of both directories (``weights_fingerprint`` twice)
    after    ``same_weights``: byte comparison, stopping at the first difference
for a trained actor (one weight changed in every tensor, as any optimizer step with weight decay
does) and for an identical copy (iteration 1, when the reference log-probs are reused).

Model: benchmarks/shapes.py's Qwen2.5-0.5B layer shape (tiny vocabulary) at ``--layers`` layers
(24 = the real depth, ~358 M parameters, 1.4 GB of fp32 safetensors).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

os.environ["RLHF_MODEL_CACHE_MB"] = "0"  # as on CUDA: before this change the reference was read every pass

from benchmarks.arguments import output_dir, positive_int  # noqa: E402  (stdlib only: the heavy imports wait for the arguments)


def seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def trained_copy(reference: Path, out: Path) -> Path:
    """The reference with every tensor nudged, saved as a checkpoint would be."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.999)
    model.save_pretrained(out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=positive_int, default=24)
    parser.add_argument("--repeats", type=positive_int, default=3)
    parser.add_argument("--model-cache", type=output_dir, default=REPO / ".rlhf" / "models" / "shapes")
    a = parser.parse_args()
    import torch

    from benchmarks.shapes import build_shape_model, parameter_count
    from rlhf_core.scoring.models import load_causal_lm, reference_policy, same_weights, weights_fingerprint
    from rlhf_core.run.session import RunSession

    cpu = torch.device("cpu")
    reference = build_shape_model(a.model_cache, "qwen2.5-0.5b", a.layers)
    size = sum(f.stat().st_size for f in reference.glob("*.safetensors")) / 1e9
    print(f"model: {reference.name}, {parameter_count(reference) / 1e6:.0f} M parameters, {size:.2f} GB safetensors")
    with tempfile.TemporaryDirectory() as tmp:
        trained = trained_copy(reference, Path(tmp) / "trained")
        identical = Path(tmp) / "identical"
        shutil.copytree(reference, identical)
        for d in (reference, trained, identical):  # every measurement reads from the page cache
            weights_fingerprint(d)

        session = RunSession()  # a flow run's: it holds the reference after the first pass

        def one_pass():
            with reference_policy(reference, cpu, torch.float32, "sdpa", param_offload=False, session=session):
                pass

        read = seconds(lambda: load_causal_lm(reference, cpu, torch.float32, attention="sdpa", session=RunSession()),
                       a.repeats)
        one_pass()  # the first pass reads it
        held = seconds(one_pass, a.repeats)
        session.frozen.drop()
        rows = [("reference per pass", read, held)]
        for name, actor in (("actor vs reference, trained", trained), ("actor vs reference, identical", identical)):
            hashed = seconds(lambda: weights_fingerprint(actor) == weights_fingerprint(reference), a.repeats)
            compared = seconds(lambda: same_weights(actor, reference), a.repeats)
            rows.append((name, hashed, compared))
        assert not same_weights(trained, reference) and same_weights(identical, reference)
    print(f"{'':32s} {'before s':>10s} {'after s':>10s} {'ratio':>8s}")
    for name, before, after in rows:
        print(f"{name:32s} {before:10.3f} {after:10.4f} {before / max(after, 1e-6):7.0f}x")


if __name__ == "__main__":
    main()
