"""Per-rank memory of a PPO run, estimated from the models' config.json before any engine is built.

All sizes are bytes (GiB = 2**30 bytes only when printed). P = a model's parameters, T = its trained
parameters (P, or the LoRA adapters), N = the update's world size, b = bytes per element of the
training dtype (4 fp32, 2 bf16/fp16). What one rank holds of one trained model (``train_state``):

    parameters   P·b, divided by N at ZeRO-3 (on the host with offload_param)
    gradients    the model's T·b (divided by N at ZeRO-2, freed at ZeRO-3) and DeepSpeed's fp32
                 gradient buffer T·4/N (bf16 gradients accumulate in fp32: ``ds_config``); see
                 ``gradient_bytes`` for each stage
    optimizer    Adam moments 8·T plus the fp32 master copy 4·T that every ZeRO stage keeps (and
                 mixed precision at any stage), divided by N at ZeRO >= 1 (on the host with
                 offload_optimizer, with the fp32 gradient partition)

and of one micro-batch of ``tokens`` tokens (``RoleMemory.micro_batch_tokens``: the role's token
budget with use_dynamic_bsz, else micro-batch size × (max prompt + max response length), at most
the rank's share of a mini-batch):

    activations  tokens·L·A·b without gradient checkpointing; tokens·(L·H + A)·b with it (each
                 layer's input, plus one layer recomputed in backward). A = the values one decoder
                 layer keeps per token for backward (``ModelShape.activation_values``; ~132 k for
                 Qwen2.5-7B), L layers of width H.
    logits       actor only: n·V·2b for the response positions' logits and their gradient (the LM
                 head runs on response positions only), n = tokens × max_response / (max_prompt +
                 max_response), plus the log-prob kernel's fp32 chunks (LOGPROB_CHUNK_BYTES).

A run holds these at different times; the estimate is the largest of three phases:

    update       actor and critic state + the larger role's micro-batch (critic, then actor)
    rollout      with a vLLM engine beside resident trainer engines (trainer.resident_models, one
                 process on CUDA): actor and critic state + gpu_memory_utilization × device memory.
                 Otherwise the engine has the GPU to itself, and during the update it sleeps or is closed.
    scoring      the largest model a scoring pass has on the device (reference, actor, critic,
                 reward model: one at a time), whole in the compute dtype, and its log-prob
                 forward's logits; with resident engines beside it (a resident trainer, or every
                 rank of a worker group: there at ZeRO-3 the actor's scoring copy is the whole
                 gathered copy each rank serves).

In every phase: the frozen models the scoring process holds for the run (``scoring.frozen``: the
reference, and the reward model when enabled), whole in the compute dtype — on the device, or in
host memory with their role's ``fsdp_config.param_offload``. With resident engines also their
rollback snapshot (``training.resident``: the held state's parameters and optimizer state, copied
to host memory at each update's start and kept until the next), in host memory: on CPU the very
memory the rest is in (measured at 4 layers of Qwen2.5-0.5B: the resident set was 28 % above the
estimate without it, 6 % with it; docs/benchmarks.md).

On CPU all of it is in the host memory every rank shares; on CUDA each GPU is checked, and what is
offloaded is checked against the host memory of all ranks together.

Not counted: the CUDA context and allocator fragmentation (~1-3 GiB a GPU), DeepSpeed's bucket
buffers, the Python process itself. ``tests/rlhf_core/training/test_memory.py`` compares the state
terms with the measured peak of a real 2-rank CPU update, and with DeepSpeed's own model-state
estimators (``estimate_zero2/3_model_states_mem_needs``) where those apply: they cover ZeRO-2 and
ZeRO-3 in 16-bit mixed precision without offload, and agree byte for byte there; they do not model
fp32 training (how this runs on CPU), ZeRO-0/1, bf16 at ZeRO-1 (DeepSpeed's BF16 optimizer), the
activations, the logits or the scoring and rollout phases, which is why the estimate is ours.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal, Optional

import torch

from rlhf_core.config import RLHFConfig, effective_deepspeed, resolve
from rlhf_core.config.errors import ConfigError
from rlhf_core.config.schema import DeepSpeedConfig
from rlhf_core.models.threads import config_largest_matrix
from rlhf_core.training.ds_config import resolve_dtype

log = logging.getLogger("rlhf.memory")
GIB = 2 ** 30
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
LOGPROB_CHUNK_BYTES = 4 * (1 << 25) * 3
"""``rlhf_core.algos.logits`` walks the logits in chunks of 2**25 fp32 elements (~3 alive at once)."""


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a decoder-only transformer (Qwen2 / Llama layout), read from its config.json."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    """q/k/v projections with a bias (Qwen2 always; Llama when attention_bias is set)."""
    head_dim: Optional[int] = None

    @classmethod
    def from_dict(cls, config: dict, source: str = "config.json") -> "ModelShape":
        keys = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
        missing = [k for k in keys if k not in config]
        if missing:
            raise ConfigError(f"{source}: missing {missing}; the memory estimate needs a decoder-only "
                              "transformer's config.json (hidden_size, num_hidden_layers, ...)")
        return cls(hidden_size=int(config["hidden_size"]), num_hidden_layers=int(config["num_hidden_layers"]),
                   num_attention_heads=int(config["num_attention_heads"]),
                   num_key_value_heads=int(config.get("num_key_value_heads") or config["num_attention_heads"]),
                   intermediate_size=int(config["intermediate_size"]), vocab_size=int(config["vocab_size"]),
                   tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
                   attention_bias=bool(config.get("attention_bias", config.get("model_type") == "qwen2")),
                   head_dim=config.get("head_dim"))

    @classmethod
    def read(cls, model_dir: str | Path) -> "ModelShape":
        """From ``model_dir/config.json`` alone: no weights are opened."""
        path = Path(model_dir) / "config.json"
        try:
            return cls.from_dict(json.loads(path.read_text()), str(path))
        except (OSError, json.JSONDecodeError) as exc:
            raise ConfigError(f"{path}: cannot read the model's config ({exc})") from None

    @property
    def dim_per_head(self) -> int:
        return int(self.head_dim or self.hidden_size // self.num_attention_heads)

    @property
    def kv_dim(self) -> int:
        return self.num_key_value_heads * self.dim_per_head

    def layer_parameters(self) -> int:
        H, I, q, kv = self.hidden_size, self.intermediate_size, self.num_attention_heads * self.dim_per_head, self.kv_dim
        attention = H * q + 2 * H * kv + q * H + ((q + 2 * kv) if self.attention_bias else 0)
        return attention + 3 * H * I + 2 * H  # SwiGLU gate/up/down, two RMSNorms

    def parameters(self, head: Literal["lm", "value"] = "lm") -> int:
        """All parameters of the causal LM (``head='lm'``) or of the one-output value model."""
        H, V = self.hidden_size, self.vocab_size
        body = V * H + self.num_hidden_layers * self.layer_parameters() + H
        if head == "value":
            return body + H + 1  # score = Linear(H, 1) with a bias
        return body + (0 if self.tie_word_embeddings else V * H)

    def lora_parameters(self, rank: int) -> int:
        """LoRA A and B of rank ``rank`` on every linear layer of every block ('all-linear')."""
        H, I, q, kv = self.hidden_size, self.intermediate_size, self.num_attention_heads * self.dim_per_head, self.kv_dim
        in_plus_out = (H + q) + 2 * (H + kv) + (q + H) + 2 * (H + I) + (I + H)
        return rank * in_plus_out * self.num_hidden_layers

    def activation_values(self) -> int:
        """A: values one decoder layer keeps per token for backward, with sdpa/flash attention (no
        (L, L) score matrix): the two norms' inputs and outputs (4H), q and attention output before
        and after o_proj (3H), k and v before and after RoPE (4·kv), and the MLP's gate, up,
        SiLU(gate) and product (4I), plus the SiLU's saved sigmoid (I)."""
        return 7 * self.hidden_size + 4 * self.kv_dim + 5 * self.intermediate_size


@dataclass(frozen=True)
class Placement:
    """How one trained model is held: the engine's ZeRO settings as DeepSpeed gets them."""

    zero_stage: int
    world_size: int
    dtype: str
    """'fp32' | 'bf16' | 'fp16' (resolved, not 'auto')."""
    offload_optimizer: bool = False
    offload_param: bool = False

    @classmethod
    def of(cls, ds: DeepSpeedConfig, dtype: str, world_size: int) -> "Placement":
        stage = ds.zero_stage if dtype == "fp32" else max(ds.zero_stage, 1)  # as ds_config raises it
        return cls(stage, world_size, dtype, ds.offload_optimizer, ds.offload_param)


@dataclass
class Term:
    name: str
    """e.g. 'actor optimizer'."""
    device: int = 0
    """Bytes per rank on the training device."""
    host: int = 0
    """Bytes per rank in host memory (offloaded)."""


def train_state(role: str, params: int, trainable: int, where: Placement) -> list[Term]:
    """The parameters, gradients and optimizer state one rank holds of one trained model (bytes)."""
    b, n, stage = DTYPE_BYTES[where.dtype], max(1, where.world_size), where.zero_stage
    weights = params * b // (n if stage == 3 else 1)
    model_grads, accumulated = gradient_bytes(trainable, where)
    master = 4 * trainable if stage >= 1 or where.dtype != "fp32" else 0
    optimizer = (8 * trainable + master) // (n if stage >= 1 else 1)
    params_term = (Term(f"{role} parameters", host=weights) if where.offload_param
                   else Term(f"{role} parameters", device=weights))
    if where.offload_optimizer:  # the fp32 gradient partition lives beside the state it steps
        return [params_term, Term(f"{role} gradients", device=model_grads, host=accumulated),
                Term(f"{role} optimizer", host=optimizer)]
    return [params_term, Term(f"{role} gradients", device=model_grads + accumulated),
            Term(f"{role} optimizer", device=optimizer)]


def gradient_bytes(trainable: int, where: Placement) -> tuple[int, int]:
    """(the model's own gradients, DeepSpeed's fp32 gradient buffer) on one rank, as DeepSpeed 0.19
    holds them (bytes):

        stage 0   T·4 (fp32 only: mixed precision runs at ZeRO >= 1)     no buffer
        stage 1   T·b full                                               T·4/N; bf16 without offload
                                                                         trains with DeepSpeed's BF16
                                                                         optimizer: T·4 full
        stage 2   T·b/N (each rank keeps its reduced partition)          T·4/N
        stage 3   0 (reduced and freed bucket by bucket)                 T·4/N
    """
    b, n, stage = DTYPE_BYTES[where.dtype], max(1, where.world_size), where.zero_stage
    if stage == 0:
        return trainable * b, 0
    model = {1: trainable * b, 2: trainable * b // n, 3: 0}[stage]
    bf16_optimizer = stage == 1 and where.dtype == "bf16" and not where.offload_optimizer
    return model, trainable * 4 // (1 if bf16_optimizer else n)


def activations(shape: ModelShape, tokens: int, dtype: str, checkpointing: bool) -> int:
    """Bytes one micro-batch of ``tokens`` tokens keeps for backward (module docstring)."""
    b, L, A = DTYPE_BYTES[dtype], shape.num_hidden_layers, shape.activation_values()
    if checkpointing:
        return tokens * (L * shape.hidden_size + A) * b
    return tokens * L * A * b


def response_logits(shape: ModelShape, tokens: int, dtype: str, response_share: float, backward: bool = True) -> int:
    """Bytes of the LM head's output on the response positions of ``tokens`` tokens (with its
    gradient when ``backward``), plus the log-prob kernel's fp32 chunks."""
    n = int(tokens * response_share + 0.5)
    copies = 2 if backward else 1
    return n * shape.vocab_size * DTYPE_BYTES[dtype] * copies + LOGPROB_CHUNK_BYTES


@dataclass
class Estimate:
    """Per-rank bytes of each phase (module docstring) and where they go."""

    phases: dict[str, list[Term]] = field(default_factory=dict)
    device_kind: str = "cpu"
    world_size: int = 1

    def device_bytes(self, phase: str) -> int:
        return sum(t.device for t in self.phases[phase])

    def host_bytes(self, phase: str) -> int:
        return sum(t.host for t in self.phases[phase])

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=self.device_bytes)

    def peak_device(self) -> int:
        return self.device_bytes(self.peak_phase)

    def per_machine_host(self) -> int:
        """Host bytes of all ranks of this machine (the update's ranks share one host)."""
        return max(self.host_bytes(p) for p in self.phases) * self.world_size

    def biggest(self, phase: Optional[str] = None, k: int = 3) -> list[Term]:
        terms = self.phases[phase or self.peak_phase]
        return sorted(terms, key=lambda t: t.device + t.host, reverse=True)[:k]

    def table(self) -> str:
        """One line per phase: its total and every term, in GiB per rank."""
        lines = []
        for phase, terms in self.phases.items():
            parts = ", ".join(f"{t.name} {gib(t.device)}" + (f" (+{gib(t.host)} host)" if t.host else "")
                              for t in terms if t.device or t.host)
            lines.append(f"  {phase}: {gib(self.device_bytes(phase))} GiB per rank on {self.device_kind} = {parts}")
        return "\n".join(lines)


def gib(nbytes: int) -> str:
    return f"{nbytes / GIB:.2f}"


@dataclass(frozen=True)
class Shapes:
    """The three models' sizes (config.json of each)."""

    actor: ModelShape
    critic: Optional[ModelShape]
    """None in a run without a critic."""
    reference: ModelShape
    reward_model: Optional[ModelShape] = None
    """None without reward_model.enable."""

    @classmethod
    def read(cls, actor: Path, critic: Optional[Path], reference: Path,
             reward_model: Optional[Path] = None) -> "Shapes":
        return cls(ModelShape.read(actor), ModelShape.read(critic) if critic is not None else None,
                   ModelShape.read(reference), ModelShape.read(reward_model) if reward_model is not None else None)


@dataclass(frozen=True)
class RoleMemory:
    """What a trained role's terms depend on."""

    deepspeed: DeepSpeedConfig
    """Its DeepSpeed settings with verl's FSDP offload flags folded in (``config.effective_deepspeed``)."""
    checkpointing: bool
    """``model.enable_gradient_checkpointing``."""
    micro_batch_tokens: int
    """Tokens of its largest micro-batch: the token budget with use_dynamic_bsz, else sequences per
    micro-batch × the longest sequence; never more than the rank's share of a mini-batch of longest
    sequences."""


@dataclass(frozen=True)
class MemorySettings:
    """The values of a config the estimate reads, on ``world_size`` ranks (``memory_settings``)."""

    world_size: int
    actor: RoleMemory
    critic: RoleMemory
    scoring_tokens: int
    """Tokens of the log-prob passes' largest micro-batch (the reference's budget)."""
    response_share: float
    """max_response_length / (max_prompt_length + max_response_length): the positions with logits."""
    lora_rank: int
    rollout_engine: str
    gpu_memory_utilization: float
    reference_offload: bool
    reward_model_offload: bool
    """The frozen models' ``fsdp_config.param_offload`` (``config.resolve.frozen_param_offload``)."""


def memory_settings(cfg: RLHFConfig, world_size: int) -> MemorySettings:
    """What the estimate of ``cfg`` on ``world_size`` ranks reads, once."""
    d, arr = cfg.data, cfg.actor_rollout_ref
    longest = d.max_prompt_length + d.max_response_length

    def tokens(role: str) -> int:
        mb = resolve.micro_batching(cfg, role, world_size)
        train_role = "critic" if role == "critic" else "actor"
        per_rank = -(-resolve.mini_batch_sequences(cfg, train_role) // max(1, world_size)) * longest
        return min(mb.token_budget if mb.use_dynamic_bsz else mb.micro_batch_size * longest, per_rank)

    return MemorySettings(
        world_size=world_size,
        actor=RoleMemory(effective_deepspeed(cfg), arr.model.enable_gradient_checkpointing, tokens("actor")),
        critic=RoleMemory(effective_deepspeed(cfg, "critic"), cfg.critic.model.enable_gradient_checkpointing,
                          tokens("critic")),
        scoring_tokens=tokens("ref"), response_share=d.max_response_length / max(1, longest),
        lora_rank=arr.model.lora_rank, rollout_engine=arr.rollout.name,
        gpu_memory_utilization=arr.rollout.gpu_memory_utilization,
        reference_offload=resolve.frozen_param_offload(cfg, "ref"),
        reward_model_offload=resolve.frozen_param_offload(cfg, "reward_model"))


def estimate(settings: MemorySettings, shapes: Shapes, *, device: str, device_memory: int = 0,
             resident: bool = False) -> Estimate:
    """The per-rank estimate on ``settings.world_size`` ranks of ``device`` ('cpu' | 'cuda'); the
    dtypes are the resolved ones. ``device_memory``: one GPU's bytes (for the vLLM share);
    ``resident``: the trainer engines stay loaded beside the rollout and scoring, with their
    rollback snapshot in host memory."""
    s, world_size = settings, settings.world_size
    actor_dtype = resolve_dtype(s.actor.deepspeed.dtype, device, config_largest_matrix(asdict(shapes.actor)))
    critic_dtype = resolve_dtype(s.critic.deepspeed.dtype, device,
                                 config_largest_matrix(asdict(shapes.critic or shapes.actor)))
    actor_params = shapes.actor.parameters("lm")
    lora = s.lora_rank
    actor_trainable = shapes.actor.lora_parameters(lora) if lora > 0 else actor_params
    state = train_state("actor", actor_params + (actor_trainable if lora > 0 else 0), actor_trainable,
                        Placement.of(s.actor.deepspeed, actor_dtype, world_size))
    if shapes.critic is not None:
        critic_params = shapes.critic.parameters("value")
        state += train_state("critic", critic_params, critic_params,
                             Placement.of(s.critic.deepspeed, critic_dtype, world_size))
    actor_tokens, critic_tokens = s.actor.micro_batch_tokens, s.critic.micro_batch_tokens
    actor_mb = [Term("actor activations", activations(shapes.actor, actor_tokens, actor_dtype, s.actor.checkpointing)),
                Term("actor logits", response_logits(shapes.actor, actor_tokens, actor_dtype, s.response_share))]
    critic_mb = [] if shapes.critic is None else [
        Term("critic activations", activations(shapes.critic, critic_tokens, critic_dtype, s.critic.checkpointing))]
    larger = max(actor_mb, critic_mb, key=lambda terms: sum(t.device for t in terms))
    held = held_terms(s, shapes, actor_dtype)
    snapshot = snapshot_terms(state) if resident else []
    phases = {"update": state + larger + held + snapshot}
    kept = [Term(t.name, t.device, t.host) for t in state] + snapshot if resident else []
    if s.rollout_engine == "vllm" and device == "cuda" and resident:
        phases["rollout"] = kept + held + [Term("vLLM rollout", int(s.gpu_memory_utilization * device_memory))]
    phases["scoring"] = kept + scoring_terms(s, shapes, actor_dtype)
    return Estimate(phases, device, world_size)


def snapshot_terms(state: list[Term]) -> list[Term]:
    """A kept trainer's rollback snapshot, per trained model: the parameters and optimizer state
    this rank holds (its ``train_state`` terms less the gradients), copied to host memory."""
    roles: dict[str, int] = {}
    for t in state:
        role, what = t.name.rsplit(" ", 1)
        if what in ("parameters", "optimizer"):
            roles[role] = roles.get(role, 0) + t.device + t.host
    return [Term(f"{role} rollback snapshot", host=nbytes) for role, nbytes in roles.items()]


def _held_models(settings: MemorySettings, shapes: Shapes) -> list[tuple[str, int, bool]]:
    """(name, parameters, offloaded) of each frozen model held for the run (``scoring.frozen``)."""
    held = [("reference", shapes.reference.parameters("lm"), settings.reference_offload)]
    if shapes.reward_model is not None:
        held.append(("reward model", shapes.reward_model.parameters("value"), settings.reward_model_offload))
    return held


def held_terms(settings: MemorySettings, shapes: Shapes, dtype: str) -> list[Term]:
    """The frozen models held for the run, on the device or (param_offload) in host memory."""
    b = DTYPE_BYTES[dtype]
    return [Term(f"{name} (held)", host=params * b) if offloaded else Term(f"{name} (held)", params * b)
            for name, params, offloaded in _held_models(settings, shapes)]


def scoring_terms(settings: MemorySettings, shapes: Shapes, dtype: str) -> list[Term]:
    """The held frozen models, the largest model a pass has on the device beside them (one at a
    time; an offloaded frozen model's pass copy among them) and its log-prob forward's logits."""
    b = DTYPE_BYTES[dtype]
    models = [("actor (scoring)", shapes.actor.parameters("lm"))]
    if shapes.critic is not None:
        models.append(("critic (scoring)", shapes.critic.parameters("value")))
    models += [(f"{name} (pass copy)", params)
               for name, params, offloaded in _held_models(settings, shapes) if offloaded]
    name, params = max(models, key=lambda m: m[1])
    return held_terms(settings, shapes, dtype) + [
        Term(f"{name} weights", params * b),
        Term("log-prob logits", response_logits(shapes.reference, settings.scoring_tokens, dtype,
                                                settings.response_share, backward=False))]


def host_memory() -> int:
    """This machine's RAM in bytes (MemTotal)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def capacity(device: str) -> int:
    """Bytes one rank may use on its device: the first GPU's total memory, or on CPU the host RAM
    (shared by all ranks: ``check_fits`` multiplies the per-rank bytes by the world size there)."""
    if device == "cuda":
        return int(torch.cuda.get_device_properties(0).total_memory)
    return host_memory()


def remedies(settings: MemorySettings, est: Estimate) -> list[str]:
    """What would shrink the biggest terms, as the keys to set."""
    a_ds, c_ds = settings.actor.deepspeed, settings.critic.deepspeed
    fixes = []
    if a_ds.zero_stage < 3 or c_ds.zero_stage < 3:
        fixes.append("actor_rollout_ref.actor.deepspeed_config.zero_stage=3 and critic.deepspeed_config.zero_stage=3 "
                     "(splits parameters, gradients and optimizer state across the ranks)")
    if not (a_ds.offload_optimizer and c_ds.offload_optimizer):
        fixes.append("actor_rollout_ref.actor.deepspeed_config.offload_optimizer=true / "
                     "critic.deepspeed_config.offload_optimizer=true (Adam state to host memory)")
    if not (settings.actor.checkpointing and settings.critic.checkpointing):
        fixes.append("actor_rollout_ref.model.enable_gradient_checkpointing=true / "
                     "critic.model.enable_gradient_checkpointing=true")
    fixes.append("a smaller actor_rollout_ref.actor.ppo_max_token_len_per_gpu / critic.ppo_max_token_len_per_gpu "
                 "(with use_dynamic_bsz)")
    fixes.append("more GPUs (trainer.n_gpus_per_node)" if est.device_kind == "cuda" else
                 "fewer CPU ranks (trainer.nproc) or a machine with more memory")
    return fixes


def check_fits(settings: MemorySettings, est: Estimate, device_capacity: int, host_capacity: int) -> None:
    """Refuse (ConfigError, an RLHFError) an estimate that exceeds the device or the host, naming
    the biggest terms and what to change. On CPU every rank's bytes land in the one host memory."""
    phase = est.peak_phase
    on_cpu = est.device_kind == "cpu"
    # on CPU the device is the host: offloaded bytes land in the same memory, for every rank
    need = (est.peak_device() + est.host_bytes(phase)) * est.world_size if on_cpu else est.peak_device()
    host_need = 0 if on_cpu else est.per_machine_host()
    what = f"host memory for {est.world_size} rank(s)" if on_cpu else "GPU memory per rank"
    where = None
    if need > device_capacity:
        where = f"{gib(need)} GiB of {what} in the {phase} phase, but the device has {gib(device_capacity)} GiB"
    elif host_need > host_capacity:
        where = f"{gib(host_need)} GiB of host memory for offloaded state, but the machine has {gib(host_capacity)} GiB"
    if where is None:
        return
    big = "; ".join(f"{t.name} {gib(t.device + t.host)} GiB" for t in est.biggest(phase))
    raise ConfigError(f"this config does not fit: the estimate is {where} (biggest terms per rank: {big}). "
                      f"To fit, set: " + "; or ".join(remedies(settings, est)) + ".\nEstimate:\n" + est.table())


def check_update_memory(settings: MemorySettings, shapes: Shapes, device: str, *,
                        resident: bool = False, announce: bool = True) -> Estimate:
    """Estimate this run's per-rank memory and refuse it (``check_fits``) before any engine is built.
    ``resident``: the engines stay loaded beside the rollout and scoring (a resident trainer, or
    each rank of a worker group, which runs the stage passes too); ``announce``: log the estimate (rank 0)."""
    device_capacity = capacity(device)
    est = estimate(settings, shapes, device=device, device_memory=device_capacity, resident=resident)
    if announce:
        # on a GPU the headline is shown by default (the table with --verbose); on the CPU it is noise
        log.log(logging.WARNING if device.startswith("cuda") else logging.INFO,
                "memory estimate (%s, %d rank(s)): %s GiB per rank at its peak (%s)", device, settings.world_size,
                gib(est.peak_device()), est.peak_phase)
        log.info("memory estimate by term:\n%s", est.table())
    check_fits(settings, est, device_capacity, host_memory())
    return est
