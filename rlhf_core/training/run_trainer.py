"""The trainer a flow run keeps in its run session, and what the stages ask of it: a
``training.resident.ResidentTrainer`` in the flow process, or a ``training.group_trainer.GroupTrainer``
when the update spans several processes (``resident_models``); a state held nowhere else rebuilt by
replay before a stage reads it (``ensure_state``); an update where no flow run keeps the models
(``one_update_trainer``); each commit or rollback told to it (``settle_resident``). The lifecycle of a kept
state: ``training.resident``'s docstring."""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterator, Optional

from rlhf_core.config import RLHFConfig
from rlhf_core.config.reads import build
from rlhf_core.config.schema import TrainerConfig
from rlhf_core.notes import say_once
from rlhf_core.run.layout import RunDir
from rlhf_core.run.lifecycle import is_replayable
from rlhf_core.run.schedule import save_due
from rlhf_core.run.session import KeptTrainer, RunSession
from rlhf_core.training.checkpoint import save_checkpoint
from rlhf_core.training.ds_config import resolve_device
from rlhf_core.training.engines import LoraSettings, present
from rlhf_core.training.group_trainer import GroupTrainer, rebuild_in_group
from rlhf_core.training.lineage import read_state_record, recorded_config
from rlhf_core.training.resident import ResidentTrainer
from rlhf_core.training.settings import update_world
from rlhf_core.training.snapshot import with_rng
from rlhf_core.training.train_state import capture

log = logging.getLogger("rlhf.resident")


def replay_is_exact(device: str) -> bool:
    """Whether replaying an update reproduces its weights bit for bit on ``device``: on a CPU every
    reduction has a fixed order once the weights sit in aligned storage (``models.storage``); GPU
    kernels (atomics in backward, autotuned GEMMs) do not promise one. Where it is not, every commit
    is checkpointed (``settle_resident``), so a crash never needs a replay."""
    return device == "cpu"


def resident_possible(cfg: RLHFConfig) -> Optional[str]:
    """Why this config cannot keep its models resident (None: it can). With several update
    processes the models stay in a worker group of them (``GroupTrainer``)."""
    if not cfg.trainer.resident_models:
        return "trainer.resident_models=false"
    if LoraSettings.from_config(cfg.actor_rollout_ref.model) is not None:
        return "LoRA (the rollout samples from merged weights, built from the adapter checkpoint)"
    if build(update_world, cfg) > 1:  # the worker group's ranks generate (hf; vLLM: a rank of its engines each)
        r = cfg.actor_rollout_ref.rollout
        if r.name not in ("hf", "vllm"):
            return f"rollout engine {r.name!r} with several update processes (their worker group generates)"
        if r.name == "vllm" and cfg.trainer.nnodes > 1:
            return "the vllm rollout engine with an update across several machines (not supported yet)"
        if r.name == "vllm" and build(update_world, cfg) % r.tensor_model_parallel_size:
            return (f"rollout.tensor_model_parallel_size={r.tensor_model_parallel_size} does not divide the "
                    f"{build(update_world, cfg)} update processes (their worker group holds the vLLM engines)")
        return None
    if (cfg.trainer.stage_processes or 1) > 1:  # (null: one per GPU of the update: one here)
        return (f"trainer.stage_processes={cfg.trainer.stage_processes} with one update process: the stages' "
                "processes read the actor from disk")
    tp = cfg.actor_rollout_ref.rollout.tensor_model_parallel_size
    if cfg.actor_rollout_ref.rollout.name == "vllm" and tp > 1:  # its ranks are processes of their own
        return (f"rollout.tensor_model_parallel_size={tp} with one update process: the vLLM engines' processes read "
                "the actor from disk (an update of as many processes keeps them on its worker group)")
    if cfg.actor_rollout_ref.rollout.name not in ("hf", "vllm"):
        return f"rollout engine {cfg.actor_rollout_ref.rollout.name!r} reads the actor from disk"
    return None


def group_of(session: RunSession) -> Optional[GroupTrainer]:
    """The worker group keeping the session's models, when its flow run started one."""
    return session.trainer if isinstance(session.trainer, GroupTrainer) else None


@contextlib.contextmanager
def resident_models(cfg: RLHFConfig, run: RunDir, session: RunSession) -> Iterator[Optional[KeptTrainer]]:
    """Keep ``run``'s models resident in ``session`` for the block (the flow's iterations), when
    ``cfg`` allows (``resident_possible``); at the end the last-good state is made durable and the
    models freed. On an interrupt only the write in flight is finished: a resume replays the rest."""
    reason = resident_possible(cfg)
    if reason is not None or session.trainer is not None:
        if reason is not None and cfg.trainer.resident_models:
            log.info("models are reloaded by every stage and every iteration is checkpointed: %s", reason)
        yield session.trainer
        return
    device = resolve_device(cfg.trainer.device)
    if not replay_is_exact(device):
        say_once(f"a replay of an update is not bit-exact on {device}, so every committed iteration is "
                 f"checkpointed (in the background): a crash never needs one; trainer.save_freq="
                 f"{cfg.trainer.save_freq} still decides which are kept")
    if build(update_world, cfg) > 1:
        group = GroupTrainer(cfg, run)
        session.live.provide_with(group)
        log.info("models are kept by a worker group of %d update processes for the whole run; the stages' model "
                 "passes run on them", group.world)
        trainer: KeptTrainer = group
    else:
        trainer = ResidentTrainer(run, session.live)
        session.live.keep_engines(keeps_rollout_engine(cfg))  # one vLLM engine for the run
    session.trainer = trainer
    try:
        try:
            yield trainer
        except BaseException as exc:
            # a failed stage leaves the committed state intact: write it (not after Ctrl-C); a failure
            # of that write is logged, not raised over the error that ended the run
            try:
                trainer.close(make_durable=isinstance(exc, Exception))
            except Exception as closing:
                log.warning("while stopping after %s: %s", type(exc).__name__, closing)
            raise
        trainer.close(make_durable=True)  # a failed background write stops the run here, in one line
    finally:
        session.live.keep_engines(False)
        session.live.provide_with(None)
        session.trainer = None


def check_background_writes(session: RunSession) -> None:
    """Before a commit: the session's resident trainer's background save (if any) finished, or its
    failure raised (``ResidentTrainer.check_writes``)."""
    if session.trainer is not None:
        session.trainer.check_writes()


def keeps_rollout_engine(cfg: RLHFConfig) -> bool:
    """Whether the flow process keeps one vLLM engine for the run: vLLM, resident models, one update
    process (a worker group's ranks keep theirs: ``stages.group_entry``), no tensor parallel (that
    needs processes of its own: those rollouts run under torchrun, ``stages.ranks``)."""
    r = cfg.actor_rollout_ref.rollout
    return (r.name == "vllm" and r.tensor_model_parallel_size == 1 and resident_possible(cfg) is None
            and build(update_world, cfg) == 1)


@contextlib.contextmanager
def rollout_engine_kept(cfg: RLHFConfig, session: RunSession) -> Iterator[None]:
    """For the block (a flow run), the session keeps the vLLM rollout engine the first generation
    builds, for every later validation and rollout, when the resident trainer of ``resident_models``
    will sync it (one update process): one engine start per flow run. Closed at the end."""
    if not keeps_rollout_engine(cfg):
        yield
        return
    session.live.keep_engines(True)
    try:
        yield
    finally:
        session.live.keep_engines(False)


def settle_resident(trainer_cfg: TrainerConfig, session: RunSession, k: int, outcome: str) -> None:
    """Tell the session's resident trainer (if any) how iteration ``k`` settled: a commit is saved
    at a save point, and at every commit where a replay would not be exact (``replay_is_exact``)."""
    trainer = session.trainer
    if trainer is not None:
        exact = replay_is_exact(resolve_device(trainer_cfg.device))
        trainer.settle(k, outcome, save=save_due(trainer_cfg, k) or not exact)


def ensure_state(session: RunSession, run: RunDir, k: Optional[int]) -> bool:
    """Make iteration ``k``'s checkpoint directory loadable before a stage reads it: held in memory,
    on disk, or — when only its state record is left (a crash, a CLI rerun) — rebuilt by replay and
    written as a checkpoint. Returns whether it was rebuilt. A lookup first; it trains only when the
    state exists nowhere else (neither in ``session`` nor on disk)."""
    if not k:
        return False
    ckpt = run.checkpoint(k)
    group = group_of(session)
    if group is not None and group.holds == k:
        return False
    if session.live.lookup(ckpt / "actor") is not None or (ckpt / "actor").is_dir() or not is_replayable(run, k):
        return False
    if group is not None:
        return group.ensure(k)
    recorded = recorded_config(read_state_record(run, k))
    if build(update_world, recorded) > 1:
        return rebuild_in_group(recorded, run, k)
    builder = ResidentTrainer(run)
    try:
        builder.hold_recorded(k)
        save_checkpoint(ckpt, actor=builder.actor, critic=builder.critic, tokenizer_path=builder.tokenizer,
                        trainer_state=builder.trainer_state or {}, dist=builder.dist,
                        state=with_rng(capture(present(builder.actor, builder.critic)), builder.rng))
    finally:
        builder.close(make_durable=False)
    return True


@contextlib.contextmanager
def one_update_trainer(cfg: RLHFConfig, run: RunDir, k: int) -> Iterator[KeptTrainer]:
    """The trainer of iteration ``k``'s update where no flow run keeps the models (`rlhf stage update`,
    a run that cannot keep them: ``resident_possible``): the same trainer as a flow run's, made for this
    one update and closed after it — in this process, or as a worker group of the update's processes —
    which writes ``iter_k/checkpoint`` at once."""
    trainer: KeptTrainer = (GroupTrainer(cfg, run, one_update=k) if build(update_world, cfg) > 1
                        else ResidentTrainer(run))
    try:
        yield trainer
    finally:
        trainer.close(make_durable=False)

