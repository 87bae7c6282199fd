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
                 for bit (checked against each record's ``weights_sample``). ``run_trainer.ensure_state`` does
                 this for any stage — also a CLI rerun of one stage — and writes the rebuilt state
                 as a checkpoint, so it is rebuilt once.

The engine state lives in this process only, in the run session the flow hands to every stage
(``run.session.RunSession``: ``run_trainer.resident_models`` puts the trainer there for the iterations);
the run directory stays the durable lineage (tables, manifests, state records, checkpoints at save
points).

Every update runs in this one trainer. Where no flow run keeps one (`rlhf stage update`, or a run
that cannot keep its models: ``run_trainer.resident_possible``), ``run_trainer.one_update_trainer`` makes a trainer that is not
kept (``ResidentTrainer.kept``): it holds the start state the same way, trains with the same loop,
writes the checkpoint at once, takes no rollback snapshot, lends nothing, and is closed after.

With several update processes on one machine the same trainer runs on each of them: a worker
group of torchrun ranks started once per flow run (``group_trainer.GroupTrainer``, ``training.worker_group``,
``stages.group_entry``), which the flow process commands and which also runs the stages' model
passes, each rank borrowing its own module. A replay of such a state runs on as many ranks.

The pieces: this module holds the trainer (the update, holding and replaying a state, the saves);
``training.snapshot`` the host-memory copies a rollback puts back and a save writes;
``training.lending`` what a kept trainer lends the stages (its modules, the kept vLLM engine's
sync); ``training.run_trainer`` the trainer a run session keeps and what the stages ask of it.
"""

from __future__ import annotations

import concurrent.futures
import gc
import time
from pathlib import Path
from typing import Any, Optional

from rlhf_core.config import RLHFConfig
from rlhf_core.config.reads import build
from rlhf_core.errors import CheckpointError, first_clause
from rlhf_core.io import timing
from rlhf_core.io.hashing import sha256_tree
from rlhf_core.models.live import LiveModels
from rlhf_core.models.threads import module_largest_matrix, serial_background_thread
from rlhf_core.run.layout import RunDir
from rlhf_core.run.lifecycle import committed_iterations, newest_durable
from rlhf_core.training.checkpoint import (BackgroundWriter, can_write_in_background, prepare_staging, restore_rng,
                                          rng_state, save_checkpoint, seed_rng)
from rlhf_core.training.distributed import DistInfo, init_distributed
from rlhf_core.training.ds_config import resolve_device
from rlhf_core.training.engines import TrainEngine, present
from rlhf_core.training.fingerprint import weights_sample
from rlhf_core.training.lending import Lending
from rlhf_core.training.lineage import read_state_record, recorded_config, start_iteration, state_id
from rlhf_core.training.ppo import run_ppo
from rlhf_core.training.rank_update import (UpdateSources, check_update_data, cpu_threads, engine_key,
                                            finish_update, iteration_metrics, iteration_plan, open_engines, peak_rss_gb,
                                            reset_peak_rss, resolve_sources, trainer_state, training_steps)
from rlhf_core.training.settings import EngineSettings, UpdateSettings, engine_settings, update_keys, update_settings
from rlhf_core.training.snapshot import SNAPSHOT, Rng, Snapshot, take_snapshot, with_rng
from rlhf_core.training.train_state import covers, restore

REPLAY = "state_replay"
"""io.timing kind: rebuilding a state that was only in memory (after a crash, or for a CLI rerun)."""



class ReplayMismatch(CheckpointError):
    """A replayed update did not reproduce the weights its record fingerprints: the state cannot be
    rebuilt here (another machine, thread count or library version). A resume falls back to the
    newest checkpoint before it (``stages.repair``); nothing continues from different weights."""

    def __init__(self, iteration: int, record: Path):
        self.iteration = iteration
        super().__init__(f"replaying iteration {iteration}'s update did not reproduce its weights (the sample in "
                         f"{record} differs): the machine, the thread count or a library changed since it trained")


class ResidentTrainer:
    """The engines of one run, kept between iterations (see the module docstring)."""

    def __init__(self, run: RunDir, live: Optional[LiveModels] = None):
        self.run = run
        self.lending = Lending(run, live) if live is not None else None
        """What it lends the stages (``training.lending``): none when not kept."""
        self.kept = live is not None
        """Kept for a flow run (a session to offer the state to): each update keeps a rollback
        snapshot and writes no checkpoint until a save point. Not kept (one update or one rebuild,
        then closed): nothing is offered or snapshot, and each update writes its checkpoint at once
        (``run_trainer.one_update_trainer``)."""
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
        self._saving: Optional[tuple[int, concurrent.futures.Future]] = None
        """The save of a committed state handed to the writer from the copier thread (``check_writes``)."""

    # -- the update ------------------------------------------------------------------------------

    def update(self, cfg: RLHFConfig, k: int, *, progress: Optional[bool] = None) -> dict[str, Any]:
        """Iteration ``k``'s PPO update in the resident engines; returns the update's metrics and
        writes iter_K/metrics.json and iter_K/state.json (no checkpoint: see ``settle``)."""
        reset_peak_rss()
        started = time.perf_counter()
        start = start_iteration(self.run, k)
        self.hold(cfg, start)
        settings = build(update_settings, cfg, world_size=self.dist.world_size)
        data = check_update_data(settings, self.run, k)
        if self.kept:
            with timing.timed(SNAPSHOT):
                self.before = self._snapshot_of_held()
        self.captured = None
        self._set_learning_rates(settings)
        self._start_rng(settings.seed)
        setup = time.perf_counter() - started
        self._withdraw()  # the weights are about to change: nobody may borrow them as ``start``'s
        freed = self.lending.rollout_engine_sleeps() if self.lending is not None else None
        with iteration_plan(settings, k, self.actor, self.critic, self.dist, self.device) as plan:
            outcome = run_ppo(plan.roles, data, seed=plan.seed, dist=self.dist, pad_id=self.pad_id,
                              progress=progress, concurrent=plan.concurrent)
        metrics = iteration_metrics(settings, k, plan, data, outcome, self.device, self.dist)
        sources = resolve_sources(cfg, self.run, k)
        identity = state_id(cfg, self.run, k, update_keys(cfg))
        self._held_now(k, sources, settings, outcome, identity[0])
        if self.lending is not None:  # the kept vLLM engine's sync to the new weights, checked
            metrics.update(self.lending.rollout_sync)
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
                            trainer_state=snap.trainer_state or {}, dist=self.dist, state=with_rng(snap.state, snap.rng))
            return self.run.checkpoint(k)
        # several ranks: each writes its part in the background into one directory made now, in step
        staging = prepare_staging(self.run.checkpoint(k), self.dist, f"saving{k}") if world > 1 else None

        def write() -> None:  # on the copier thread: after the capture, hand it to the writer
            snap = pending.result()
            self.writer.submit(self.run.checkpoint(k), with_rng(snap.state, snap.rng), actor=actor, critic=critic,
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
            snap = take_snapshot(self.holds, present(self.actor, self.critic), self.rng, self.trainer_state,
                                 pin_memory=self._pins)
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
            return take_snapshot(k, engines, rng, held_state, pin_memory=pin, reuse=reuse)

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
        engines = build(engine_settings, cfg, device=device, world_size=dist.world_size,
                        total_steps=training_steps(cfg, self.run))
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
        settings = build(update_settings, cfg, world_size=self.dist.world_size)
        with timing.timed(REPLAY):
            data = check_update_data(settings, self.run, i)
            self._set_learning_rates(settings)
            self._start_rng(settings.seed)
            self._withdraw()
            with iteration_plan(settings, i, self.actor, self.critic, self.dist, self.device) as plan:
                outcome = run_ppo(plan.roles, data, seed=plan.seed, dist=self.dist, pad_id=self.pad_id,
                                  progress=False, concurrent=plan.concurrent)
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
        return take_snapshot(self.holds, present(self.actor, self.critic), self.rng, self.trainer_state,
                             pin_memory=self._pins)

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
        if self.lending is not None and self.holds:
            self.lending.offer(self.run.checkpoint(self.holds), self.actor, self.critic, self.tokenizer,
                               self.dist.world_size)

    def _withdraw(self) -> None:
        if self.lending is not None:
            self.lending.withdraw()
        for te in present(self.actor, self.critic):  # a borrower left them in eval mode
            te.module.train()
