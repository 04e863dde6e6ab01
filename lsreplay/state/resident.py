"""State that stays put: the models a process holds between stages and steps.

A process serving devices (the flow's own process under the thread runner; a Ray actor
per device under Ray, lsreplay.distributed.hosts) keeps per device one copy of the policy, tagged with
the step it acts in, plus, where the update runs, its trainable state (float32 masters and
AdamW, lsreplay.models.train_state), and the frozen reference. The policy update changes that copy
in place. A stage asking for the policy of a step gets, in this order:

1. the copy this device holds, if it acts in that step;
2. the weights of another device's copy in this process that does (a device-to-device copy);
3. the base model (step 0), or the complete checkpoint of the step before (lsreplay.state.checkpointing);
4. otherwise StateLost: the flow rewinds to the newest complete checkpoint and recomputes
   the steps after it (flows/train.py). The store stays the source of truth after a crash.

`checkpoint.resident=false` keeps nothing: every request loads from the store, as a
process that serves one stage and exits must.

Asynchronous rollouts (rollout.max_staleness > 0) sample with older versions of the policy
while the update changes its copy in place (`sampler`): each update publishes a frozen copy
of the policy it made (`updated`), rollouts on any device of the process read it, and the
newest max_staleness + 1 versions are kept; one not held is loaded from its checkpoint.

With `rollout.engine=vllm` a process also holds one vLLM engine per (run, device)
(`Resident.engine`): started once, it takes the weights of the policy each step acts in
from this process's copy, in memory, and the newest drafter, in place.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from lsreplay.algos.critic import attach_value_head
from lsreplay.core.config import Config
from lsreplay.core.layout import CheckpointError
from lsreplay.core.run import InputCorrupt, Run
from lsreplay.models.loading import load_model, resolve_model_dir
from lsreplay.models.lora import add_adapters
from lsreplay.models.train_state import TrainState, master_dtype
from lsreplay.rollout.vllm_engine import VLLMEngine, engine_spec, same_engine
from lsreplay.state import checkpointing
from lsreplay.state.checkpoint import load_module, load_optimizer, load_weights

log = logging.getLogger(__name__)


class StateLost(RuntimeError):
    """The policy after update `step` is neither held by this process nor in a complete checkpoint."""

    def __init__(self, step: int, why: str = ""):
        self.step = step
        super().__init__(why or f"the policy after step {step} is neither held in memory nor checkpointed; "
                                "the run restarts from the newest complete checkpoint")

    def __reduce__(self):  # keep the step when the exception crosses a process or a pickle
        return (type(self), (self.step, str(self)))


# A copy's acts_in while an optimizer step may have changed it part of the way.
UPDATING = -1


@dataclass
class _Copy:
    model: PreTrainedModel  # the compute weights, on the copy's device
    acts_in: int  # the step this policy acts in: updates 0 .. acts_in - 1 applied
    train: TrainState | None = None  # where the update runs: masters and AdamW of this copy


@dataclass
class _Engine:
    engine: VLLMEngine
    acts_in: int  # the step of the policy whose weights it holds
    drafter_step: int | None  # the step of the drafter it speculates with
    run_id: str
    asleep: bool = False  # its weights and KV cache released (rest_engine) until the next request


class Resident:
    """The copies this process holds, one per (run, device)."""

    def __init__(self):
        self._copies: dict[tuple[str, str], _Copy] = {}
        self._references: dict[tuple[str, str], PreTrainedModel] = {}
        # Asynchronous rollouts: (run id, version) -> {device: a frozen copy of that policy},
        # and per (run id, device) the copies of versions let go, whose memory the next take.
        self._versions: dict[tuple[str, int], dict[str, PreTrainedModel]] = {}
        self._spare: dict[tuple[str, str], list[PreTrainedModel]] = {}
        self._engines: dict[str, _Engine] = {}  # by device
        self._lock = threading.RLock()  # stages of one process run on several threads
        # An engine starts and takes weights for a while: per device (the devices of a process
        # start and load side by side), not under the models' lock. _engines_lock guards only
        # the lookups: closing the engines takes neither, so it waits on no start or call.
        self._device_locks: dict[str, threading.Lock] = {}
        self._engines_lock = threading.Lock()
        # Per device: the policy version its engine serves and how many shards sample with it
        # (`serving`); a shard of another version waits for them.
        self._serving: dict[str, list[int]] = {}
        self._serving_changed = threading.Condition()
        # (run id, step) -> the weights of that policy from another process that holds it, or
        # None: set by a host whose peers are processes of their own (lsreplay.distributed.hosts).
        self.peer_weights: Callable[[str, int], dict[str, torch.Tensor] | None] | None = None

    # -- what stages ask for ---------------------------------------------------------------
    def policy(self, run: Run, step: int, device: torch.device) -> PreTrainedModel:
        """The policy that acts in `step` (after updates 0 .. step - 1), on `device`."""
        with self._lock:
            if not run.cfg.checkpoint.resident:
                return self._load(run, step, device)
            copy = self._copies.get(_key(run, device))
            if copy is not None and copy.acts_in == step:
                return copy.model
            self._drop_other_runs(run, device)
            if (weights := self._held_weights(run, step)) is not None:
                model = copy.model if copy is not None else policy_model(run.cfg, device)
                model.load_state_dict(weights)
            else:
                if copy is not None:
                    del self._copies[_key(run, device)]  # free it before loading another
                model = self._load(run, step, device)
            self._copies[_key(run, device)] = _Copy(model, step)
            return model

    def sampler(self, run: Run, version: int, device: torch.device) -> PreTrainedModel:
        """The policy of `version` (after updates 0 .. version - 1) as the rollouts sample
        with it on `device`. Synchronous steps (rollout.max_staleness = 0) sample with the
        copy the update changes (`policy`: nothing changes it while they run). Asynchronous
        ones with a frozen copy that no update changes: published by the update that made
        it, copied to `device` if it is on another, else loaded from the base model or that
        version's checkpoint."""
        if not run.cfg.rollout.max_staleness:
            return self.policy(run, version, device)
        if not run.cfg.checkpoint.resident:
            return self._load(run, version, device)
        with self._lock:
            copies = self._versions.setdefault((_run_id(run), version), {})
            if (model := copies.get(str(device))) is None:
                if copies:
                    model = self._frozen_copy(run, next(iter(copies.values())), device)
                else:  # not another copy's weights: an update may be changing them
                    model = self._load(run, version, device).requires_grad_(False)
                copies[str(device)] = model
            return model

    def _publish(self, run: Run, version: int, model: PreTrainedModel) -> None:
        """Keep a frozen copy of `model`, the policy of `version`, for the rollouts that sample
        with it; let go of the versions no rollout asks for any more (older than version -
        max_staleness: the flow submits none of them after this update, and the rollouts of
        the steps it trained before have ended)."""
        oldest, run_id = version - run.cfg.rollout.max_staleness, _run_id(run)
        for key in [k for k in self._versions if k[0] == run_id and k[1] < oldest]:
            for device, old in self._versions.pop(key).items():
                self._spare.setdefault((run_id, device), []).append(old)
        device = next(model.parameters()).device
        self._versions[(run_id, version)] = {str(device): self._frozen_copy(run, model, device)}

    def _frozen_copy(self, run: Run, model: PreTrainedModel, device: torch.device) -> PreTrainedModel:
        """A copy of `model`'s weights on `device` that takes no gradient, in the memory of a
        version let go where there is one (building a model reads the base from disk)."""
        spare = self._spare.get((_run_id(run), str(device)))
        frozen = spare.pop() if spare else policy_model(run.cfg, device).requires_grad_(False)
        frozen.load_state_dict(model.state_dict())
        return frozen

    def train_state(self, run: Run, step: int, device: torch.device) -> TrainState:
        """The trainable state that acts in `step`, on `device` (the policy update's)."""
        with self._lock:
            copy = self._copies.get(_key(run, device))
            if copy is not None and copy.acts_in == step and copy.train is not None:
                return copy.train
            elsewhere = next((c for c in self._run_copies(run) if c.acts_in == step and c.train is not None), None)
            model = self.policy(run, step, device)
            if elsewhere is not None:
                train = elsewhere.train.moved_to(model)
                elsewhere.train = None
            else:
                train = self._load_train_state(run, step, model)
            if run.cfg.checkpoint.resident:
                self._copies[_key(run, device)].train = train
            return train

    def reference(self, run: Run, device: torch.device, policy: PreTrainedModel) -> PreTrainedModel:
        """The frozen base model (the KL penalty's reference). With model.lora that is
        `policy` itself, the copy on `device`, to run with its adapters off
        (lsreplay.models.lora.adapters_off): no second copy of the base."""
        if run.cfg.model.lora.enabled:
            return policy
        with self._lock:
            key = _key(run, device)
            if key not in self._references:
                self._references = {k: m for k, m in self._references.items() if k[1] != key[1]}
                self._references[key] = load_model(run.cfg.model, trainable=False, device=device)
            return self._references[key]

    @contextlib.contextmanager
    def serving(self, device: torch.device, version: int):
        """Hold `device`'s engine at policy `version` from a rollout shard's first request to
        its last: shards of the same version share it, one of another version waits until
        they end. So new weights reach the engine between shards, never while a shard's
        requests (a dynamic sampling round, an episode's turns) are under way, and every
        token a shard records was drawn by the version it records."""
        key = str(device)
        with self._serving_changed:
            while (held := self._serving.get(key)) is not None and held[0] != version:
                self._serving_changed.wait()
            held = self._serving.setdefault(key, [version, 0])
            held[1] += 1
        try:
            yield
        finally:
            with self._serving_changed:
                held[1] -= 1
                if not held[1]:
                    del self._serving[key]
                    self._serving_changed.notify_all()

    def engine(self, run: Run, step: int, device: torch.device, drafter: tuple[int, str] | None,
               span: tuple = ()) -> VLLMEngine:
        """The vLLM engine of `device` (with rollout.vllm.tensor_parallel_size, of the devices
        `span`, `device` first), holding the weights of policy version `step` (the policy that
        acts in that step: `sampler`) and speculating with `drafter` ((its step, its exported
        folder), or None). Started if none serves this run's config there (the first drafter
        needs a start of its own)."""
        with self._device_lock(device):
            spec = engine_spec(run.cfg, device, str(resolve_model_dir(run.cfg.model)), run.seed(step, "vllm") % 2**32,
                               drafter[1] if drafter else None, span)
            with self._engines_lock:
                held = self._engines.get(str(device))
            if held is not None and not (held.engine.alive() and same_engine(held.engine.spec, spec)
                                         and held.run_id == _run_id(run)):
                held.engine.close()  # a failed engine is never reused
                held = None
            if held is None:
                # Started from the base model's folder: the policy of step 0.
                held = _Engine(VLLMEngine(spec), 0, drafter and drafter[0], _run_id(run))
                with self._engines_lock:
                    self._engines[str(device)] = held
            if held.asleep:
                held.engine.wake_up()
                held.asleep = False
            if held.acts_in != step:
                policy = self.sampler(run, step, device)
                if run.cfg.model.lora.enabled:
                    seconds, what = held.engine.load_adapters(policy, run.cfg.model), "adapters"
                else:
                    seconds, what = held.engine.load_policy(policy), "weights"
                log.info("vLLM engine on %s: %s of the policy of step %d loaded in %.1f s", device, what, step,
                         seconds)
                held.acts_in = step
            if drafter is not None and held.drafter_step != drafter[0]:
                held.engine.load_drafter(drafter[1])
                held.drafter_step = drafter[0]
            return held.engine

    def rest_engine(self, device: torch.device) -> None:
        """After a shard's rollouts: an engine started with vLLM's sleep mode (CUDA) releases
        its weights and KV cache, so that the caching pass and the update have the device;
        the next `engine` call wakes it and loads the weights again."""
        with self._device_lock(device):
            with self._engines_lock:
                held = self._engines.get(str(device))
            if held is not None and held.engine.spec.sleeps and held.engine.alive() and not held.asleep:
                held.engine.sleep()
                held.asleep, held.acts_in = True, -1

    def _device_lock(self, device: torch.device) -> threading.Lock:
        with self._engines_lock:
            return self._device_locks.setdefault(str(device), threading.Lock())

    def close_engines(self, run: Run | None = None) -> None:
        """Stop the engines held for `run` (all of them if None), without waiting on their calls."""
        with self._engines_lock:
            closing = [self._engines.pop(d) for d, e in list(self._engines.items())
                       if run is None or e.run_id == _run_id(run)]
        for held in closing:
            held.engine.close()

    # -- what the policy update reports ----------------------------------------------------
    def updating(self, run: Run, device: torch.device) -> None:
        """The copy on `device` is about to be changed by an optimizer step: until `updated`,
        it acts in no step, so that a try interrupted anywhere between the two (a stage
        timeout raises at any line) leaves nothing a retry would step again."""
        with self._lock:
            if copy := self._copies.get(_key(run, device)):
                copy.acts_in = UPDATING

    def updated(self, run: Run, step: int, device: torch.device) -> None:
        """The copy on `device` now holds the policy after update `step` (published, for
        asynchronous rollouts: `sampler`)."""
        with self._lock:
            if copy := self._copies.get(_key(run, device)):
                copy.acts_in = step + 1
                if run.cfg.rollout.max_staleness:
                    self._publish(run, step + 1, copy.model)

    def drop(self, run: Run, device: torch.device) -> None:
        """Forget the copy on `device` (an update that failed half-way leaves it unusable)."""
        with self._lock:
            self._copies.pop(_key(run, device), None)

    def release(self, run: Run) -> None:
        """Free everything held for `run` (its flow ended)."""
        self.close_engines(run)
        with self._lock:
            for key in [k for k in self._copies if k[0] == _run_id(run)]:
                del self._copies[key]
            for key in [k for k in self._references if k[0] == _run_id(run)]:
                del self._references[key]
            self._versions = {k: v for k, v in self._versions.items() if k[0] != _run_id(run)}
            self._spare = {k: v for k, v in self._spare.items() if k[0] != _run_id(run)}

    def held(self, run: Run) -> dict[str, int]:
        """{device: step its policy acts in} for `run`."""
        with self._lock:
            return {k[1]: c.acts_in for k, c in self._copies.items() if k[0] == _run_id(run)}

    def weights(self, run_id: str, step: int) -> dict[str, torch.Tensor] | None:
        """The weights of run `run_id`'s policy acting in `step` on the CPU, if held here.
        Read without the lock: a peer asks while this process may be busy loading."""
        published = self._versions.get((run_id, step))
        model = next(iter(published.values()), None) if published else None
        if model is None:
            copy = next((c for k, c in list(self._copies.items()) if k[0] == run_id and c.acts_in == step), None)
            model = None if copy is None else copy.model
        return None if model is None else {k: v.cpu() for k, v in model.state_dict().items()}

    # -- loading ---------------------------------------------------------------------------
    def _held_weights(self, run: Run, step: int) -> dict[str, torch.Tensor] | None:
        """The weights of the policy acting in `step` from another device of this process,
        else from a peer process; None if neither holds it."""
        if (source := next((c for c in self._run_copies(run) if c.acts_in == step), None)) is not None:
            return source.model.state_dict()
        return self.peer_weights(_run_id(run), step) if self.peer_weights else None

    def _run_copies(self, run: Run) -> list[_Copy]:
        return [c for k, c in self._copies.items() if k[0] == _run_id(run)]

    def _drop_other_runs(self, run: Run, device: torch.device) -> None:
        """One run's copy per device: another run's goes when this one needs the device."""
        for key in [k for k in self._copies if k[1] == str(device) and k[0] != _run_id(run)]:
            del self._copies[key]

    @staticmethod
    def _load(run: Run, step: int, device: torch.device) -> PreTrainedModel:
        model = policy_model(run.cfg, device)
        if step > 0:
            manifest = _checkpoint(run, step - 1)
            with _verified(run, step - 1):
                load_module(run.store, manifest["prefix"], model, manifest)
        return model

    @staticmethod
    def _load_train_state(run: Run, step: int, model: PreTrainedModel) -> TrainState:
        """Masters and AdamW for `model`: float32 masters of the base (step 0), or the
        checkpoint of step - 1's masters and optimizer state."""
        train = policy_train_state(run.cfg, model)
        if step == 0:
            if train.mixed:  # masters from the float32 weights, not from their bf16 rounding
                base = policy_model(run.cfg, "cpu", dtype=master_dtype(run.cfg.model.dtype))
                train.load_masters(dict(base.named_parameters()))
            return train
        manifest = _checkpoint(run, step - 1)
        with _verified(run, step - 1):
            train.load_masters(load_weights(run.store, manifest["prefix"], manifest))
            load_optimizer(run.store, manifest["prefix"], train.optimizer, manifest)
        return train


def policy_model(cfg: Config, device: torch.device | str, dtype: str | None = None) -> PreTrainedModel:
    """The base policy on `device` (models.load_model), with its LoRA adapters (model.lora,
    seeded by the run's seed) and its critic's value head where the run has them
    (algo.critic): every copy of a run's policy has the same parameters."""
    model = load_model(cfg.model, device=device, dtype=dtype)
    if cfg.model.lora.enabled:
        add_adapters(model, cfg.model.lora, cfg.seed)
    return attach_value_head(model) if cfg.algo.critic else model


def policy_train_state(cfg: Config, model: PreTrainedModel) -> TrainState:
    """The trainable state of a run's policy `model`: the value head in a group of its own."""
    return TrainState(model, cfg.optim, cfg.algo.value_lr if cfg.algo.critic else None)


def _run_id(run: Run) -> str:
    return f"{run.store.uri}#{run.config_hash}"


def _key(run: Run, device: torch.device) -> tuple[str, str]:
    return _run_id(run), str(torch.device(device))


def _checkpoint(run: Run, step: int) -> dict:
    """The complete checkpoint of `step` (waiting for this process's writer if it is still
    writing it); StateLost if there is none."""
    if (manifest := checkpointing.manifest(run, step)) is None:
        checkpointing.WRITER.wait()
        if (manifest := checkpointing.manifest(run, step)) is None:
            raise StateLost(step)
    return manifest


@contextlib.contextmanager
def _verified(run: Run, step: int):
    """Reads of a checkpoint: damage (a sha256 mismatch, a missing file) makes it
    incomplete, and the state of that step lost (the run restarts from an older checkpoint)."""
    try:
        with run.reading(step, "policy"):
            yield
    except InputCorrupt as e:
        damage = e.__cause__
        cause = damage.__cause__ if isinstance(damage, CheckpointError) else damage
        log.warning("policy checkpoint of step %d is damaged (%s); it no longer counts as complete", step, cause)
        run.store.delete(f"{run.checkpoint('policy', step)}/{checkpointing.COMPLETE}")
        raise StateLost(step, f"the policy checkpoint of step {step} is damaged ({cause})") from e


RESIDENT = Resident()
