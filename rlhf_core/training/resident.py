"""Resident training state: the actor and critic engines kept loaded for a whole flow run.

Without it every iteration loads its models in every stage, builds both DeepSpeed engines, and
writes (and hashes) a full checkpoint — at real sizes, most of the iteration. With it
(``trainer.resident_models``, one update process, no LoRA, the hf or vllm rollout engine):

    update k     the engines already hold the state k starts from; a host-memory snapshot of it is
                 taken (the rollback's), the RNG is set to that state's, PPO trains, and the new state
                 is served in memory for ``iter_k/checkpoint/{actor,critic}`` (the run session's ``live``): the
                 guard, the next rollout and score, and validation borrow these very modules.
                 ``iter_k/state.json`` records how to rebuild it (``training.lineage``).
    commit k     the snapshot is dropped; every ``trainer.save_freq`` iterations (and at the end of
                 the flow run) a full checkpoint is written by a background thread from a capture,
                 while the next iteration runs. Nothing else is written.
    rollback k   the snapshot is put back (no disk I/O): the engines hold k's starting state again.
    vLLM         the run's one vLLM engine (the session's ``live``) pauses for each update (on CUDA, sleeps
                 to free its memory) and takes each new or restored actor in place, checked
                 against the actor's own log-probs (``rollout.vllm_engine.VLLMEngine.sync_from``).
    crash        a resume rebuilds what was only in memory: from the newest checkpoint before it,
                 each later committed iteration's update is replayed on its recorded advantages table
                 with its recorded config and the RNG chain, which on CPU reproduces the weights bit
                 for bit (checked against each record's ``weights_sample``). ``ensure_state`` does
                 this for any stage — also a CLI rerun of one stage — and writes the rebuilt state
                 as a checkpoint, so it is rebuilt once.

The engine state lives in this process only, in the run session the flow hands to every stage
(``scoring.session.RunSession``: ``resident_models`` puts the trainer there for the iterations);
the run directory stays the durable lineage (tables, manifests, state records, checkpoints at save
points).

Every update runs in this one trainer. Where no flow run keeps one (`rlhf stage update`, or a run
that cannot keep its models: ``resident_possible``), ``update_once`` makes a trainer that is not
kept (``ResidentTrainer.kept``): it holds the start state the same way, trains with the same loop,
writes the checkpoint at once, takes no rollback snapshot, lends nothing, and is closed after.

With several update processes on one machine the same trainer runs on each of them: a worker
group of torchrun ranks started once per flow run (``GroupTrainer``, ``training.worker_group``,
``stages.group_entry``), which the flow process commands and which also runs the stages' model
passes, each rank borrowing its own module. A replay of such a state runs on as many ranks.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import gc
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional, Union

import torch

from rlhf_core.config import RLHFConfig, resolve, to_yaml
from rlhf_core.config.schema import TrainerConfig
from rlhf_core.config.machine import cuda_devices
from rlhf_core.notes import say_once
from rlhf_core.errors import CheckpointError, RLHFError, first_clause
from rlhf_core.io import timing
from rlhf_core.io.hashing import sha256_tree
from rlhf_core.models.live import LiveModel, LiveModels
from rlhf_core.run.layout import RunDir
from rlhf_core.run.lifecycle import committed_iterations, is_replayable, newest_durable
from rlhf_core.run.schedule import save_due
from rlhf_core.scoring.session import RunSession
from rlhf_core.training.checkpoint import (BackgroundWriter, can_write_in_background, prepare_staging, restore_rng,
                                          rng_state, save_checkpoint, seed_rng)
from rlhf_core.training.distributed import DistInfo, init_distributed
from rlhf_core.training.ds_config import resolve_device
from rlhf_core.training.engines import LoraSettings, TrainEngine, present
from rlhf_core.training.fingerprint import weights_sample
from rlhf_core.training.lineage import read_state_record, recorded_config, start_iteration, state_id
from rlhf_core.models.threads import module_largest_matrix, serial_background_thread
from rlhf_core.training.rank_update import (EngineSettings, UpdateSettings, UpdateSources, check_update_data,
                                            cpu_threads, engine_key, engine_settings, finish_update, open_engines,
                                            peak_rss_gb, reset_peak_rss, resolve_sources, trainer_state,
                                            schedule_needs_total_steps, train_iteration, training_steps, update_settings)
from rlhf_core.training.train_state import TrainState, capture, covers, restore
from rlhf_core.training.launch import GROUP_ENTRY
from rlhf_core.training.worker_group import RankFailure, RayPlacement, WorkerGroup

SNAPSHOT = "state_snapshot"
"""io.timing kind: copying the engines' state to host memory (the rollback snapshot, a save's capture)."""
REPLAY = "state_replay"
"""io.timing kind: rebuilding a state that was only in memory (after a crash, or for a CLI rerun)."""
PROCESS_LAUNCH = "process_launch"
"""io.timing kind: starting a worker group's processes (interpreters, imports, the process group)."""

Rng = tuple[dict, dict]
log = logging.getLogger("rlhf.resident")


class ReplayMismatch(CheckpointError):
    """A replayed update did not reproduce the weights its record fingerprints: the state cannot be
    rebuilt here (another machine, thread count or library version). A resume falls back to the
    newest checkpoint before it (``stages.repair``); nothing continues from different weights."""

    def __init__(self, iteration: int, record: Path):
        self.iteration = iteration
        super().__init__(f"replaying iteration {iteration}'s update did not reproduce its weights (the sample in "
                         f"{record} differs): the machine, the thread count or a library changed since it trained")


def replay_is_exact(device: str) -> bool:
    """Whether replaying an update reproduces its weights bit for bit on ``device``: on a CPU every
    reduction has a fixed order once the weights sit in aligned storage (``models.storage``); GPU
    kernels (atomics in backward, autotuned GEMMs) do not promise one. Where it is not, every commit
    is checkpointed (``settle_resident``), so a crash never needs a replay."""
    return device == "cpu"


def update_world(trainer: TrainerConfig) -> int:
    """The update's processes on this machine's devices (``config.resolve.update_world_size``)."""
    return resolve.update_world_size(trainer, cuda_devices() if trainer.device != "cpu" else 0)


def resident_possible(cfg: RLHFConfig) -> Optional[str]:
    """Why this config cannot keep its models resident (None: it can). With several update
    processes the models stay in a worker group of them (``GroupTrainer``)."""
    if not cfg.trainer.resident_models:
        return "trainer.resident_models=false"
    if LoraSettings.from_config(cfg.actor_rollout_ref.model) is not None:
        return "LoRA (the rollout samples from merged weights, built from the adapter checkpoint)"
    if update_world(cfg.trainer) > 1:  # the worker group's ranks generate (hf; vLLM: a rank of its engines each)
        r = cfg.actor_rollout_ref.rollout
        if r.name not in ("hf", "vllm"):
            return f"rollout engine {r.name!r} with several update processes (their worker group generates)"
        if r.name == "vllm" and cfg.trainer.nnodes > 1:
            return "the vllm rollout engine with an update across several machines (not supported yet)"
        if r.name == "vllm" and update_world(cfg.trainer) % r.tensor_model_parallel_size:
            return (f"rollout.tensor_model_parallel_size={r.tensor_model_parallel_size} does not divide the "
                    f"{update_world(cfg.trainer)} update processes (their worker group holds the vLLM engines)")
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


@dataclass
class Snapshot:
    """A state the engines held, in host memory: what a rollback puts back, or what a save writes."""

    iteration: int
    """The committed iteration whose update produced it (0: the initial models)."""
    state: TrainState
    rng: Optional[Rng]
    """The RNG right after that update (None: the initial state, seeded from trainer.seed)."""
    trainer_state: Optional[dict] = None


class ResidentTrainer:
    """The engines of one run, kept between iterations (see the module docstring)."""

    def __init__(self, run: RunDir, live: Optional[LiveModels] = None):
        self.run = run
        self.live = live
        """Where the held state is offered to the stages: the run session's ``LiveModels``."""
        self.kept = live is not None
        """Kept for a flow run (a session to offer the state to): each update keeps a rollback
        snapshot and writes no checkpoint until a save point. Not kept (one update or one rebuild,
        then closed): nothing is offered or snapshot, and each update writes its checkpoint at once
        (``update_once``)."""
        self.actor: Optional[TrainEngine] = None
        self.critic: Optional[TrainEngine] = None
        self.dist: Optional[DistInfo] = None
        self.device = "cpu"
        self.pad_id = 0
        self.key: Optional[str] = None
        self.tokenizer: Optional[Path] = None
        self.holds: Optional[int] = None
        """The iteration whose update produced the state the engines hold (0: the initial models)."""
        self.rng: Optional[Rng] = None
        """The RNG right after the update that produced ``holds`` (None: seeded, for the initial state)."""
        self.trainer_state: Optional[dict] = None
        """What ``holds``' checkpoint would save as trainer_state.json."""
        self.before: Optional[Snapshot] = None
        """The state the unsettled update started from (the rollback's snapshot)."""
        self.captured: Optional[Snapshot] = None
        """A capture of the held committed state (a save's), reused as the next update's snapshot."""
        self.writer = BackgroundWriter()
        self._capturing: Optional[tuple[int, concurrent.futures.Future]] = None
        """A capture of the just-committed state in progress, while the next rollout and score run."""
        self._copier = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlhf-capture",
                                                             initializer=serial_background_thread)
        self.rollout_sync: dict[str, float] = {}
        """The last sync of the kept rollout engine to the held actor: its seconds and log-prob gap."""
        self._saving: Optional[tuple[int, concurrent.futures.Future]] = None
        """The save of a committed state handed to the writer from the copier thread (``check_writes``)."""
        self._lent_flags: list[tuple[torch.nn.Parameter, bool]] = []
        """``requires_grad`` of each parameter of the engines' modules while they are lent frozen."""

    # -- the update ------------------------------------------------------------------------------

    def update(self, cfg: RLHFConfig, k: int, *, progress: Optional[bool] = None) -> dict[str, Any]:
        """Iteration ``k``'s PPO update in the resident engines; returns the update's metrics and
        writes iter_K/metrics.json and iter_K/state.json (no checkpoint: see ``settle``)."""
        reset_peak_rss()
        started = time.perf_counter()
        start = start_iteration(self.run, k)
        self.hold(cfg, start)
        settings = update_settings(cfg, self.dist.world_size)
        data = check_update_data(settings, self.run, k)
        if self.kept:
            with timing.timed(SNAPSHOT):
                self.before = self._snapshot_of_held()
        self.captured = None
        self._set_learning_rates(settings)
        self._start_rng(settings.trainer.seed)
        setup = time.perf_counter() - started
        self._withdraw()  # the weights are about to change: nobody may borrow them as ``start``'s
        freed = self._rollout_engine_sleeps()
        metrics, outcome = train_iteration(settings, k, data, self.actor, self.critic, self.dist, self.device,
                                           self.pad_id, progress=progress)
        sources = resolve_sources(cfg, self.run, k)
        identity = state_id(cfg, self.run, k, schedule_needs_total_steps(cfg))
        self._held_now(k, sources, settings, outcome, identity[0])
        metrics.update(self.rollout_sync)  # the kept vLLM engine's sync to the new weights, checked
        metrics["perf/setup_seconds"] = setup
        lora_base = sources.actor if self.actor.lora else None
        metrics["perf/checkpoint_seconds"] = 0.0 if self.kept else self._write_checkpoint(k, lora_base)
        metrics["perf/peak_rss_gb"] = max(metrics.get("perf/peak_rss_gb", 0.0), peak_rss_gb())
        if self.kept:
            metrics["perf/resident"] = 1.0
        if freed is not None:
            metrics["perf/rollout_engine_freed_gb"] = freed
        finish_update(cfg, self.run, k, metrics, outcome, self.actor, self.critic, self.dist, identity)
        return metrics

    def _write_checkpoint(self, k: int, lora_base: Optional[Path]) -> float:
        """Write the state update ``k`` just produced as ``iter_k/checkpoint`` now, every rank its
        part (the guard decides later whether it is kept; with LoRA the adapters, beside
        ``lora_base``); returns the seconds it took."""
        started = time.perf_counter()
        with timing.timed(timing.CHECKPOINT_WRITE), \
                cpu_threads(self.device, module_largest_matrix(self.actor.module), self.dist.world_size):
            save_checkpoint(self.run.checkpoint(k), actor=self.actor, critic=self.critic, tokenizer_path=self.tokenizer,
                            trainer_state=self.trainer_state or {}, dist=self.dist, lora_base=lora_base)
        return time.perf_counter() - started

    def _held_now(self, k: int, sources: UpdateSources, settings: UpdateSettings, outcome: Any, ident: str) -> None:
        self.rng = rng_state()
        self.holds = k
        self.trainer_state = trainer_state(settings, k, sources, len(outcome.steps.get("actor", [])), ident)
        self._offer()

    def settle(self, k: int, outcome: str, *, save: bool) -> None:
        """After the verdict on ``k``: a commit drops the snapshot (and saves when ``save``: a save
        point, ``run.schedule.save_due``); a rollback puts the snapshot back into the engines."""
        if self.holds != k or self.before is None:
            return  # not this trainer's update (a skipped, already settled or rebuilt one)
        if outcome == "commit":
            released, self.before = self.before, None
            if covers(released.state, present(self.actor, self.critic), pin_memory=self._pins):
                self._capture_soon(reuse=released)  # the next update's snapshot, copied while the next rollout runs
            else:
                self._capture_now()
            if save:
                self.save_held()
            return
        with timing.timed(SNAPSHOT):
            self._put_back(self.before)
        self.before = None

    # -- durable state ---------------------------------------------------------------------------

    def save_held(self, *, wait: bool = False) -> Optional[Path]:
        """Write the held (committed) state as ``iter_k/checkpoint`` from a capture, in the background
        unless ``wait``; the directory appears when complete. None when nothing is to be written."""
        k = self.holds
        if not k or (self.run.checkpoint(k) / "actor").is_dir():
            return None
        if self._saving is not None and self._saving[0] == k:
            # already being written (a save point that is also the run's end): a second save would
            # stage into the same directory as the first and remove the files it wrote there
            if wait:
                self.check_writes()
            return self.run.checkpoint(k)
        if self._capturing is None or self._capturing[0] != k:
            self._capture_soon()
        pending, actor, critic, tokenizer = self._capturing[1], self.actor, self.critic, self.tokenizer
        world = self.dist.world_size
        if not can_write_in_background(list(present(actor, critic)), world):  # ZeRO-3 ranks gather in step
            snap = pending.result()
            save_checkpoint(self.run.checkpoint(k), actor=actor, critic=critic, tokenizer_path=tokenizer,
                            trainer_state=snap.trainer_state or {}, dist=self.dist, state=_with_rng(snap.state, snap.rng))
            return self.run.checkpoint(k)
        # several ranks: each writes its part in the background into one directory made now, in step
        staging = prepare_staging(self.run.checkpoint(k), self.dist, f"saving{k}") if world > 1 else None

        def write() -> None:  # on the copier thread: after the capture, hand it to the writer
            snap = pending.result()
            self.writer.submit(self.run.checkpoint(k), _with_rng(snap.state, snap.rng), actor=actor, critic=critic,
                               tokenizer_path=tokenizer, trainer_state=snap.trainer_state or {}, dist=self.dist,
                               staging=staging)

        self._saving = (k, self._copier.submit(write))
        if wait:
            self.check_writes()
        return self.run.checkpoint(k)

    def check_writes(self) -> None:
        """Wait for the background save in flight (if any) and raise its failure as one line naming
        the checkpoint and the resume: called before every commit, so a save that failed stops the
        run before anything is committed on top of the state it did not make durable."""
        saving, self._saving = self._saving, None
        try:
            if saving is not None:
                saving[1].result()  # the hand-over to the writer (it re-raises an earlier write's failure)
            self.writer.wait()
        except Exception as exc:
            k = saving[0] if saving is not None else self.holds
            raise CheckpointError(f"{first_clause(exc)}; iteration {k} is committed but not durable and nothing after "
                                  f"it was committed: free the cause and resume with `rlhf run --resume "
                                  f"{self.run.root}` (it rebuilds iteration {k}'s state by replay)") from exc

    def _capture_now(self) -> None:
        """Copy the held state to fresh host memory now, on this thread. A capture that must fault in
        new pages (the first after update 1: Adam's moments are new) ran in the background at 4 layers
        of Qwen2.5-0.5B's shape (2 cores, a VM where a first-touched page costs 6-10 us) for 5.3 s, 3.9 s
        of CPU for 235,000 page faults, and took a core from the rollout's OpenMP team: that rollout
        took 4.1 s instead of 1.6 s and the score after it 1.7 s instead of 1.0 s. Here it takes
        2.8-3.6 s and nothing waits on a core: iteration 2 took 9.2-9.7 s instead of 10.8-10.9 s. The
        captures after it overwrite their buffers (``covers``) in the background, 0.4 s each."""
        with timing.timed(SNAPSHOT):
            snap = Snapshot(self.holds, capture(present(self.actor, self.critic), pin_memory=self._pins),
                            self.rng, self.trainer_state)
        done: concurrent.futures.Future = concurrent.futures.Future()
        done.set_result(snap)
        self._capturing = (self.holds, done)

    @property
    def _pins(self) -> bool:
        return self.device.startswith("cuda")  # pinned: faster copies back

    def _capture_soon(self, reuse: Optional[Snapshot] = None) -> None:
        """Start copying the held state to host memory on the copier thread. Safe while other
        stages borrow the modules: they only read the weights, and the next update waits for it.
        ``reuse``: a released snapshot whose buffers are overwritten (no fresh pages to fault in);
        a save still writing from it is waited for first, on the copier thread."""
        k, rng, held_state = self.holds, self.rng, self.trainer_state
        engines, pin = present(self.actor, self.critic), self._pins
        writer = self.writer

        def copy() -> Snapshot:
            if reuse is not None:
                writer.idle()  # its buffers may still be written from; a failure stays for check_writes
            return Snapshot(k, capture(engines, pin_memory=pin, reuse=reuse.state if reuse else None), rng,
                            held_state)

        self._capturing = (k, self._copier.submit(copy))

    def close(self, *, make_durable: bool = True) -> None:
        """End of the flow run: the last-good state written when it is only in memory (``make_durable``),
        every write finished, the modules withdrawn and freed."""
        try:
            if make_durable and self.holds and self.before is None and self.holds in committed_iterations(self.run):
                self.save_held()
            self.check_writes()
        finally:
            self._copier.shutdown(wait=True)
            self._capturing = self._saving = None
            self.writer.idle()
            self._withdraw()
            self.actor = self.critic = None
            self.before = self.captured = None
            gc.collect()

    # -- holding a state -------------------------------------------------------------------------

    def hold(self, cfg: RLHFConfig, j: int) -> None:
        """Make the engines hold the state committed iteration ``j`` produced (0: the initial
        models): already held, the pending update's snapshot, or built from the newest checkpoint at
        or before ``j`` and the recorded updates after it replayed."""
        device = resolve_device(cfg.trainer.device)
        dist = init_distributed(device)
        engines = engine_settings(cfg, device, dist.world_size, training_steps(cfg, self.run))
        key = engine_key(engines)
        if self.actor is not None and key == self.key:
            if self.holds == j:
                return
            if self.before is not None and self.before.iteration == j:
                self._put_back(self.before)
                self.before = None
                return
        self.drop_engines()
        base = newest_durable(self.run, j) if j else 0
        self._open(cfg, engines, base, dist)
        for i in [i for i in committed_iterations(self.run) if base < i <= j]:
            self.replay(i)

    def hold_recorded(self, k: int) -> None:
        """Make the engines hold iteration ``k``'s state as its state record describes it — also an
        update not settled yet (the guard's, after a crash): its start held, then its update replayed."""
        chain_end = read_state_record(self.run, k)
        self.hold(recorded_config(chain_end), int(chain_end.get("start") or 0))
        if self.holds != k:
            self.replay(k)

    def _open(self, cfg: RLHFConfig, engines: EngineSettings, base: int, dist: DistInfo) -> None:
        started = time.perf_counter()
        # resolve_sources(k) = the state k starts from: base's checkpoint, or the initial models
        sources = resolve_sources(cfg, self.run, base + 1)
        # kept: the engines stay beside the rollout and scoring of every iteration (on every rank of a group)
        self.actor, self.critic, self.pad_id = open_engines(cfg, engines, sources, resident=self.kept)
        self.dist, self.device, self.key = dist, engines.device, engine_key(engines)
        self.tokenizer = resolve_sources(cfg, self.run, 1).tokenizer  # never pruned, unlike a checkpoint's copy
        self.rng = rng_state() if base else None  # open_engines set the checkpoint's RNG (or seeded it)
        self.holds = base
        self.trainer_state = self.run.read_json(self.run.checkpoint(base) / "trainer_state.json") if base else None
        timing.add(timing.UPDATE_SETUP, time.perf_counter() - started)
        self._offer()

    def replay(self, i: int) -> None:
        """Rebuild iteration ``i``'s state from the held one (its start) by rerunning its recorded update."""
        record = read_state_record(self.run, i)
        if record.get("start") != self.holds:
            raise CheckpointError(f"{self.run.state_record(i)} says iteration {i} started from iteration "
                                  f"{record.get('start')}, but the state rebuilt so far is iteration {self.holds}'s; "
                                  f"rerun its stages: `rlhf rebuild {self.run.root}`")
        table = self.run.advantages(i)
        recorded = record["inputs"].get(str(table.relative_to(self.run.root)))
        if recorded is not None and sha256_tree(table) != recorded:
            raise CheckpointError(f"{table} changed since iteration {i}'s update trained on it: its state cannot be "
                                  f"rebuilt; rerun `rlhf stage update --run-dir {self.run.root} --iteration {i} --force`")
        cfg = recorded_config(record)
        settings = update_settings(cfg, self.dist.world_size)
        with timing.timed(REPLAY):
            data = check_update_data(settings, self.run, i)
            self._set_learning_rates(settings)
            self._start_rng(settings.trainer.seed)
            self._withdraw()
            _, outcome = train_iteration(settings, i, data, self.actor, self.critic, self.dist, self.device,
                                         self.pad_id, progress=False)
        sample = weights_sample([te.module for te in present(self.actor, self.critic)])
        if self.dist.is_main and sample != record.get("weights_sample"):  # rank 0's sample is recorded
            raise ReplayMismatch(i, self.run.state_record(i))
        self.rng = rng_state()
        self.holds = i
        self.trainer_state = trainer_state(settings, i, resolve_sources(cfg, self.run, i),
                                           len(outcome.steps.get("actor", [])), record["id"])
        self._offer()

    def drop_engines(self) -> None:
        self._settle_capture()
        self._withdraw()
        self.actor = self.critic = None
        self.holds = self.rng = self.trainer_state = None
        self.before = self.captured = None

    # -- internals -------------------------------------------------------------------------------

    def _settle_capture(self) -> Optional[Snapshot]:
        """Wait for a capture in progress; the snapshot it made (None: none was in progress)."""
        if self._capturing is None:
            return None
        k, pending = self._capturing
        self._capturing = None
        snap = pending.result()
        return snap if k == self.holds else None

    def _snapshot_of_held(self) -> Snapshot:
        done = self._settle_capture()
        if done is not None:
            self.captured = done
        if self.captured is not None and self.captured.iteration == self.holds:
            return self.captured
        return Snapshot(self.holds, capture(present(self.actor, self.critic), pin_memory=self._pins),
                        self.rng, self.trainer_state)

    def _put_back(self, snap: Snapshot) -> None:
        self._withdraw()
        restore(present(self.actor, self.critic), snap.state)
        self.holds, self.rng, self.trainer_state = snap.iteration, snap.rng, snap.trainer_state
        self._offer()

    def _set_learning_rates(self, settings: UpdateSettings) -> None:
        """Each update trains at its own config's base lr (a retry halves the actor's), at the
        schedule position the engine reached."""
        for te, lr in zip((self.actor, self.critic), settings.learning_rates):
            if te is None:
                continue
            te.base_lrs = [lr] * len(te.base_optimizer.param_groups)
            te.set_lr_schedule_step(te.lr_schedule_step)

    def _start_rng(self, seed: int) -> None:
        """The RNG an update starts from: the one right after the update that produced the held
        state (what its checkpoint saves), else trainer.seed — as a fresh update process sets it."""
        if self.rng is None:
            seed_rng(seed)
        else:
            restore_rng(*self.rng)

    def _offer(self) -> None:
        """Serve the held state for its checkpoint directory (the initial models are on disk already)."""
        self._withdraw()
        if not self.kept or not self.holds:
            return
        ckpt = self.run.checkpoint(self.holds)
        self.live.hold(ckpt / "actor", LiveModel(self._lend(self.actor), "causal_lm", self.tokenizer))
        if self.critic is not None:
            self.live.hold(ckpt / "critic", LiveModel(self._lend(self.critic), "critic", self.tokenizer))
        self._sync_rollout_engine(ckpt / "actor")

    def _lend(self, te: TrainEngine) -> torch.nn.Module:
        """``_servable(te)`` with gradients off until ``_withdraw``, as every model a stage loads
        from disk has them: ATen's matmul takes another summation path for a weight that requires
        grad, so a borrowed module would give other bits than its checkpoint reloaded after a crash
        (a resumed run's log-probs would differ from the uninterrupted run's in the last digit)."""
        module = self._servable(te)
        if module is te.module:
            self._lent_flags += [(p, p.requires_grad) for p in module.parameters()]
            module.requires_grad_(False)
        return module

    def _servable(self, te: TrainEngine) -> torch.nn.Module:
        """The module a stage may borrow: the engine's own, except a ZeRO-3 engine's on several
        ranks, whose parameters are partitioned (a forward would gather them with the other ranks,
        which are not running it): then a whole copy, dropped before the next update trains."""
        if te.zero_stage != 3 or self.dist.world_size == 1:
            return te.module
        with timing.timed(SNAPSHOT):
            return inference_copy(te)

    def _rollout_engine_sleeps(self) -> Optional[float]:
        """A kept vLLM engine pauses for the update and, where its platform can, gives its memory to it
        (CUDA: KV cache freed, weights offloaded); returns the GiB that freed, measured (None: no
        engine kept, or nothing freed: CPU)."""
        held = self.live.held_engine() if self.live is not None else None
        freed = held.engine.sleep() if held is not None else None
        return freed / 2 ** 30 if freed is not None else None

    def _sync_rollout_engine(self, actor_dir: Path) -> None:
        """The kept vLLM engine takes the held actor's weights in place (and wakes), checked against
        the actor's own log-probs; no disk round trip. A ZeRO-3 actor is gathered for it."""
        held = self.live.held_engine()
        if held is None or self.actor is None:
            return
        with _gathered(self.actor):
            self.rollout_sync = held.engine.sync_from(self.actor.module)
        self.live.hold_engine(held.engine, actor_dir)

    def _withdraw(self) -> None:
        if self.live is not None:
            self.live.drop(self.run.root)
        for param, requires_grad in self._lent_flags:  # the trainable parameters train again
            param.requires_grad_(requires_grad)
        self._lent_flags = []
        for te in present(self.actor, self.critic):  # a borrower left them in eval mode
            te.module.train()


# ---------------------------------------------------------------------------------------------
# several update processes: the engines kept by a worker group of them
# ---------------------------------------------------------------------------------------------

class GroupTrainer:
    """The engines of one run kept by a worker group of the update's processes
    (``training.worker_group``), for a flow run whose update spans several processes of this
    machine. Each rank holds a ``ResidentTrainer`` of its own and serves its module to the stages'
    model passes it runs: score, guard, rollout and validation are dealt to the group's ranks
    (``stages.ranks``), each rank borrowing the weights it trained. This object is the flow
    process's handle on them and holds no model; anything the flow process must load itself is
    published for it on first ask (a ``models.live.Provider``)."""

    def __init__(self, cfg: RLHFConfig, run: RunDir, *, one_update: int = 0):
        """``one_update``: K for a group started for iteration K's update alone (its ranks' trainers
        are not kept: ``ResidentTrainer.kept``); 0 for the group keeping a flow run's models."""
        self.run = run
        self.world = update_world(cfg.trainer)
        device = resolve_device(cfg.trainer.device)
        args = ["--run-dir", str(run.root), "--device", device, *(["--one-update"] if one_update else [])]
        what = (f"update of iteration {one_update} on {self.world} processes" if one_update
                else f"worker group of {self.world} update processes")
        started = time.perf_counter()
        self.group = WorkerGroup(GROUP_ENTRY, self.world, args, what=what,
                                 placement=_placement(cfg.trainer, device),
                                 log=run.launch_log(f"update-iter_{one_update}" if one_update else "worker-group"))
        timing.add(PROCESS_LAUNCH, time.perf_counter() - started)
        self.holds: Optional[int] = None
        """The iteration whose state the ranks hold (None: none built yet; 0: the initial models)."""
        self._published: Optional[tuple[int, Path]] = None
        self._copies = 0

    def update(self, cfg: RLHFConfig, k: int, *, progress: Optional[bool] = None) -> dict[str, Any]:
        """Iteration ``k``'s PPO update on every rank (``ResidentTrainer.update``; ``progress``: rank
        0's bars); rank 0's metrics."""
        self._unpublish()
        result = self._call("update", cfg, iteration=k, progress=progress)[0]
        self.holds = result["holds"]
        timing.add(timing.UPDATE_SETUP, float(result["metrics"].get("perf/setup_seconds", 0.0)))
        timing.add(timing.CHECKPOINT_WRITE, float(result["metrics"].get("perf/checkpoint_seconds", 0.0)))
        return result["metrics"]

    def settle(self, k: int, outcome: str, *, save: bool) -> None:
        """``ResidentTrainer.settle`` on every rank (a rollback puts each rank's snapshot back)."""
        holds = self._call("settle", None, iteration=k, outcome=outcome, save=save)[0]["holds"]
        if holds != self.holds:
            self._unpublish()
        self.holds = holds

    def check_writes(self) -> None:
        """``ResidentTrainer.check_writes`` on every rank (each writes its own shard in the background)."""
        self._call("writes", None)

    def ensure(self, k: int) -> bool:
        """Make the ranks hold iteration ``k``'s state; when they did not, it is rebuilt there by
        replay (as its record describes it) and written as a checkpoint. Returns whether it was."""
        if self.holds == k:
            return False
        self._unpublish()
        self.holds = self._call("hold", None, iteration=k)[0]["holds"]
        return True

    def run_shares(self, cfg: RLHFConfig, k: int, stage: str, world: int) -> None:
        """Ranks 0..world-1 each write their share of ``stage``'s model passes (``stages.ranks``), at
        this process's intra-op thread count: CPU reductions then split as in one process."""
        self._call("share", cfg, stage=stage, iteration=k, world=world, threads=torch.get_num_threads())

    def close(self, *, make_durable: bool = True) -> None:
        """The ranks write the last-good state when it is only in memory (``make_durable``), then
        leave; without it (Ctrl-C) they are just stopped: a resume replays what was only in memory."""
        try:
            if self.group.alive and make_durable:
                self._call("close", None, durable=True)
        finally:
            self.group.close()
            self._unpublish()

    # -- models.live.Provider ------------------------------------------------------------------

    def provides(self, directory: Path) -> bool:
        if not self.holds:
            return False
        ckpt = self.run.checkpoint(self.holds).resolve()
        return directory in (ckpt / "actor", ckpt / "critic") and not directory.is_dir()

    def publish(self, directory: Path) -> Path:
        if self._published is None or self._published[0] != self.holds:
            self._unpublish()
            self._copies += 1  # a new name each time: the scoring cache keys loaded models by path
            out = self.run.published_weights(self.holds, self._copies)
            with timing.timed(timing.CHECKPOINT_WRITE):
                self._call("publish", None, iteration=self.holds, out=str(out))
            self._published = (self.holds, out)
        return self._published[1] / directory.name

    def _unpublish(self) -> None:
        if self._published is not None:
            shutil.rmtree(self._published[1], ignore_errors=True)
            self._published = None

    def _call(self, op: str, cfg: Optional[RLHFConfig], **payload: Any) -> list[Any]:
        try:
            return self.group.call(op, config=to_yaml(cfg) if cfg is not None else None, **payload)
        except RankFailure as exc:
            if exc.user_error:
                raise RLHFError(exc.message) from None
            raise RuntimeError(f"rank {exc.rank} of the {self.group.what} failed in {op!r}:\n{exc.message}") from None


def _placement(trainer: TrainerConfig, device: str) -> Optional[RayPlacement]:
    """Where the group's ranks go when the update spans machines: a Ray cluster (None: this one alone)."""
    nnodes, per_node = resolve.update_nodes(trainer, cuda_devices() if trainer.device != "cpu" else 0)
    if nnodes == 1:
        return None
    return RayPlacement(nnodes, per_node, device, resolve.ray_address(trainer, os.environ),
                        float(trainer.ray_placement_timeout_s))


@contextlib.contextmanager
def _gathered(te: TrainEngine) -> Iterator[None]:
    """``te``'s whole parameters for the block (ZeRO-3 keeps only partitions otherwise)."""
    if te.zero_stage != 3:
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(te.module.parameters()), modifier_rank=None):
        yield


def inference_copy(te: TrainEngine) -> torch.nn.Module:
    """A plain module (same class, config and attention) holding ``te``'s whole weights, on its
    device, gradients off. Every rank must call it: ZeRO-3 gathers the partitions."""
    import deepspeed

    module = te.module
    with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
        weights = {name: tensor.detach().clone() for name, tensor in module.state_dict().items()}
    first = next(iter(weights.values()))
    with torch.device(first.device):
        copy = type(module)._from_config(module.config, dtype=first.dtype)
    copy.load_state_dict(weights, strict=False)  # tied weights: one tensor under both names
    return copy.eval().requires_grad_(False)


def _rebuild_in_group(cfg: RLHFConfig, run: RunDir, k: int) -> bool:
    """``ensure_state`` for a run whose update spans several processes: the replay must run on as
    many ranks (their reductions split the batch as the update did), so a group is started for it."""
    trainer = GroupTrainer(cfg, run)
    try:
        return trainer.ensure(k)
    finally:
        trainer.close(make_durable=False)


# ---------------------------------------------------------------------------------------------
# one trainer per run session, for the length of a flow run
# ---------------------------------------------------------------------------------------------

Trainer = Union[ResidentTrainer, GroupTrainer]


def group_of(session: RunSession) -> Optional[GroupTrainer]:
    """The worker group keeping the session's models, when its flow run started one."""
    return session.trainer if isinstance(session.trainer, GroupTrainer) else None


@contextlib.contextmanager
def resident_models(cfg: RLHFConfig, run: RunDir, session: RunSession) -> Iterator[Optional[Trainer]]:
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
    if update_world(cfg.trainer) > 1:
        trainer: Trainer = GroupTrainer(cfg, run)
        session.live.provide_with(trainer)
        log.info("models are kept by a worker group of %d update processes for the whole run; the stages' model "
                 "passes run on them", trainer.world)
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
            and update_world(cfg.trainer) == 1)


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
    if update_world(recorded.trainer) > 1:
        return _rebuild_in_group(recorded, run, k)
    builder = ResidentTrainer(run)
    try:
        builder.hold_recorded(k)
        save_checkpoint(ckpt, actor=builder.actor, critic=builder.critic, tokenizer_path=builder.tokenizer,
                        trainer_state=builder.trainer_state or {}, dist=builder.dist,
                        state=_with_rng(capture(present(builder.actor, builder.critic)), builder.rng))
    finally:
        builder.close(make_durable=False)
    return True


def update_once(cfg: RLHFConfig, run: RunDir, k: int, *, progress: Optional[bool] = None) -> dict[str, Any]:
    """Iteration ``k``'s update where no flow run keeps the models (`rlhf stage update`, a run that
    cannot keep them: ``resident_possible``): the same trainer as a flow run's, made for this one
    update and closed after it — in this process, or as a worker group of the update's processes —
    which writes ``iter_k/checkpoint`` at once. Returns the update's metrics."""
    trainer: Trainer = (GroupTrainer(cfg, run, one_update=k) if update_world(cfg.trainer) > 1
                        else ResidentTrainer(run))
    try:
        return trainer.update(cfg, k, progress=progress)
    finally:
        trainer.close(make_durable=False)


def _with_rng(state: TrainState, rng: Optional[Rng]) -> TrainState:
    if rng is not None:
        state.rng_tensors, state.rng_json = rng
    return state
