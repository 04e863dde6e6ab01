"""`rollout.engine=vllm`: rollout trees sampled by a vLLM engine in a process of its own.

The engine process (lsreplay/rollout/vllm_worker.py) runs vLLM's own Python
(`rollout.vllm.python`, `.venv-vllm/bin/python` as `make` sets it up: vLLM's pins clash
with Prefect's, see docs/rollout-engines.md), forked from a process that has imported vLLM
(lsreplay/rollout/vllm_process.py). `VLLMEngine` starts it, sends it work over a Unix socket
and turns its answers into lsreplay's types: `sample_trees` gives the same `TreeRollout`s
as the HF tree sampler (leaf counts, paths, behaviour logprobs), so every later stage runs
unchanged. An engine is long-lived, one per device and run (`ENGINES`, a resident like
the policy): it follows the policy by `load_policy` (the weights in memory, through shared
memory) or, with LoRA, by `load_adapters` (the adapters alone, as a PEFT folder; the base
it started with stays), and speculates with the newest drafter (`load_drafter`).

What differs from the HF engine: sampling is exact in distribution but not reproducible
(vLLM draws from one engine-wide generator, and on CPU per-request seeds fail), so an
interrupted rollout stage is sampled again on resume; and vLLM's logprobs come from its
own kernels, so they differ from the trainer's in the last digits (the step's
`engine_logprob_gap` measures it).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import math
import os
import re
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from lsreplay.algos.critic import is_critic
from lsreplay.core.config import ModelConfig, completion_tokens
from lsreplay.core.storage import Store
from lsreplay.models.families import VLLM_TESTED
from lsreplay.models.lora import checkpointed_state, write_adapter_folder
from lsreplay.rollout.tree_sampler import TreeRollout
from lsreplay.rollout.vllm_process import WORKER, EngineProcessError, fork_engine, log_tail
from lsreplay.rollout.vllm_worker import check_version

log = logging.getLogger(__name__)

# How long the engine process may take to start and answer its first request (vLLM's
# imports, once per fork server, and the engine's start-up: 12 s for SmolLM2-135M on 2 CPU
# cores with enforce_eager, 6 s forked from a running fork server: bench/engines.py).
START_TIMEOUT = 600.0


# What the engine process's environment keeps of this one: what Python, vLLM, torch and the
# accelerator read, and no credentials (AWS, W&B, MLflow, Hugging Face tokens stay here; a
# name that says it holds one is dropped whatever its prefix). vLLM's usage reporting is off.
ENGINE_ENV = ("PATH", "HOME", "USER", "LOGNAME", "LANG", "LANGUAGE", "TZ", "TMPDIR", "TERM", "LD_LIBRARY_PATH",
              "LD_PRELOAD", "HF_HOME", "HF_HUB_CACHE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "XDG_CACHE_HOME")
ENGINE_ENV_PREFIXES = ("LC_", "VLLM_", "CUDA_", "NVIDIA_", "NCCL_", "OMP_", "KMP_", "MKL_", "TORCH", "TRITON_")
NOT_PASSED = re.compile(r"KEY|TOKEN|SECRET|PASSWORD|CREDENTIAL", re.IGNORECASE)
NO_USAGE_REPORTING = {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}


def engine_environment() -> dict[str, str]:
    """The environment an engine process (and vLLM's probe) starts with."""
    kept = {k: v for k, v in os.environ.items()
            if (k in ENGINE_ENV or k.startswith(ENGINE_ENV_PREFIXES)) and not NOT_PASSED.search(k)}
    return {**kept, **NO_USAGE_REPORTING}


class EngineError(RuntimeError):
    """The vLLM engine failed a request, missed its deadline, or its process ended. The
    engine is closed then (`alive()` is false): a retry starts a new one."""


class EngineStartError(EngineError):
    """The vLLM engine could not start with this config: the message says why and what to do."""


@dataclass(frozen=True)
class EngineSpec:
    """What an engine process is started with; a different spec needs another process."""

    python: str
    model: str  # an HF model folder (the base policy)
    dtype: str
    seed: int
    max_model_len: int
    kv_cache_gb: float
    gpu_memory_utilization: float
    enforce_eager: bool
    threads: int
    device: str  # "cpu" or "cuda:N"
    drafter: str | None = None  # an exported drafter folder: speculate with it
    draft_tokens: int = 0
    spec_threshold: int = 0
    timeout_s: float = 1800.0  # the deadline of each call (start-up: START_TIMEOUT)
    sleeps: bool = False  # started with vLLM's sleep mode (CUDA): `sleep()` releases weights and KV cache
    lora_rank: int = 0  # LoRA on, adapters of this rank (0: full weights)
    # Tensor parallelism (rollout.vllm.tensor_parallel_size): its workers, one per device of
    # `devices` (`device` first; on a CPU each takes its share of the cores).
    tensor_parallel: int = 1
    decode_context_parallel: int = 1  # rollout.vllm.decode_context_parallel_size: of those workers
    devices: tuple[str, ...] = ()


class VLLMEngine:
    """One vLLM engine process. Calls run one at a time, each with a deadline; any failure
    (an error answered, the process ended, the deadline passed) closes the engine."""

    def __init__(self, spec: EngineSpec):
        self.spec = spec
        self._lock = threading.Lock()  # one call at a time
        self._calls = itertools.count(1)
        self._closed = False
        self._weights = SharedWeights()
        descriptor, log_path = tempfile.mkstemp(prefix="lsreplay-vllm-", suffix=".log")
        os.close(descriptor)
        self._log_path = Path(log_path)
        self._conn, self._process = self._spawn()
        try:
            reply = self._request("start", timeout=START_TIMEOUT, model=spec.model, dtype=spec.dtype, seed=spec.seed,
                                  max_model_len=spec.max_model_len, kv_cache_bytes=int(spec.kv_cache_gb * 2**30),
                                  gpu_memory_utilization=spec.gpu_memory_utilization,
                                  enforce_eager=spec.enforce_eager, drafter=spec.drafter,
                                  draft_tokens=spec.draft_tokens, spec_threshold=spec.spec_threshold,
                                  sleep_mode=spec.sleeps, lora_rank=spec.lora_rank,
                                  tensor_parallel_size=spec.tensor_parallel,
                                  decode_context_parallel_size=spec.decode_context_parallel)
            check_device(spec.device, reply["device_uuid"])
        except EngineError as e:
            self._end()
            self.close()
            raise EngineStartError(f"{e} (model {spec.model}{', drafter ' + spec.drafter if spec.drafter else ''}; "
                                   f"engine log {self._log_path})") from None
        self.version = reply["version"]
        log.info("vLLM %s engine on %s started in %.1f s (model %s%s; log %s)", self.version, spec.device,
                 reply["seconds"], spec.model, f", drafter {spec.drafter}" if spec.drafter else "", self._log_path)

    # -- the process ---------------------------------------------------------------------
    def _spawn(self):
        try:
            return fork_engine(self.spec.python, self._environment(), self._log_path, START_TIMEOUT)
        except EngineProcessError as e:
            raise EngineStartError(str(e)) from None

    def _environment(self) -> dict:
        env = {**engine_environment(), "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
               "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"),
               "OMP_NUM_THREADS": str(self.spec.threads), "PYTHONPATH": "", "TOKENIZERS_PARALLELISM": "false"}
        if self.spec.device.startswith("cuda"):
            env["CUDA_VISIBLE_DEVICES"] = engine_gpus(self.spec, os.environ.get("CUDA_VISIBLE_DEVICES"))
        else:
            if (iomp := intel_openmp(self.spec.python)) is not None:
                # vLLM's CPU kernels want Intel OpenMP preloaded (speculative decoding ran 4x slower without).
                env["LD_PRELOAD"] = " ".join(filter(None, [str(iomp), os.environ.get("LD_PRELOAD", "")]))
            if self.spec.tensor_parallel > 1:  # each CPU worker its share of the cores (vLLM binds them)
                env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_shares(self.spec.tensor_parallel)
        return env

    def _log_tail(self) -> str:
        return log_tail(self._log_path)

    def _request(self, op: str, progress: Callable[[int], None] | None = None, timeout: float | None = None,
                 **kwargs) -> dict:
        """Send request `op`, pass its progress messages on, return its reply; EngineError
        (the engine closed) if it fails, the process ends or `timeout` (default: the spec's)
        seconds pass first."""
        with self._lock:
            return self._exchange(op, progress, self.spec.timeout_s if timeout is None else timeout, kwargs)

    def _exchange(self, op: str, progress: Callable[[int], None] | None, timeout: float, kwargs: dict) -> dict:
        if self._closed:
            raise EngineError(f"the vLLM engine is closed ({op!r} not sent); a new one must be started")
        call, deadline = next(self._calls), time.monotonic() + timeout
        try:
            self._conn.send({"op": op, "call": call, **kwargs})
            while True:
                if not self._conn.poll(max(0.0, deadline - time.monotonic())):
                    raise EngineError(f"the vLLM engine did not answer {op!r} within {timeout:g} s and is killed "
                                      "(rollout.vllm.timeout_s sets the deadline)")
                reply = self._conn.recv()
                if reply.get("call") != call:
                    raise EngineError(f"the vLLM engine answered call {reply.get('call')} to call {call} ({op!r})")
                if "progress" not in reply:
                    break
                if progress is not None:
                    progress(reply["progress"])
            if "error" in reply:
                log.debug("vLLM engine traceback:\n%s", reply["traceback"])
                raise EngineError(f"vLLM engine: {op} failed: {reply['error']} ({reply['aborted']} requests in flight "
                                  f"aborted; the engine is closed; its log: {self._log_path})")
            return reply
        except (EOFError, OSError) as e:
            self._fail()
            raise EngineError(f"the vLLM engine process ended during {op!r} ({self._log_tail()})") from e
        except BaseException:
            self._fail()
            raise

    def _fail(self) -> None:
        """The call in flight failed: end the process, free the connection and the weights'
        buffer (under the call's lock)."""
        self._end()
        self._conn.close()
        self._weights.close()

    def _end(self, grace: float = 0.0) -> None:
        """Mark the engine closed; kill its process unless it exits within `grace` seconds. Takes no lock."""
        self._closed = True
        try:
            self._process.wait(grace)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        # Killed, or exited without unloading its libraries (vllm_worker's exit): Intel OpenMP's
        # registration in shared memory stays behind.
        Path(SHARED_MEMORY, f"__KMP_REGISTERED_LIB_{self._process.pid}_0").unlink(missing_ok=True)

    @property
    def pid(self) -> int:
        return self._process.pid

    def alive(self) -> bool:
        return not self._closed and self._process.poll() is None

    def close(self) -> None:
        """Stop the engine: a graceful shutdown where no call is in flight; otherwise the
        process is killed at once and the call in flight fails. Never waits on a call. The
        log goes, unless the engine failed (an error names it)."""
        failed = self._closed or self._process.poll() is not None
        if not self._lock.acquire(blocking=False):
            self._end()
            return
        try:
            if not self._closed:
                with contextlib.suppress(EngineError):
                    self._exchange("shutdown", None, 30.0, {})
                self._end(grace=30.0)
            self._conn.close()
            self._weights.close()
        finally:
            self._lock.release()
        if not failed:
            self._log_path.unlink(missing_ok=True)

    # -- work ----------------------------------------------------------------------------
    def sample_trees(self, prompts: list[list[int]], branching: list[int], segment_tokens: list[int],
                     max_new_tokens: int, temperature: float, top_p: float, top_k: int, eos: list[int],
                     progress: Callable[[int], None] | None = None) -> tuple[list[TreeRollout], dict]:
        """The prompts' rollout trees, as `tree_sampler.sample_trees` returns them (leaves in
        depth-first order, each with its path and count), and the engine's figures:
        positions it computed (prompts not served by its prefix cache, plus generated
        tokens), cached positions, seconds."""
        sampled = [0]

        def advance(tokens: int) -> None:  # the worker reports a running total
            if progress is not None:
                progress(tokens - sampled[0])
            sampled[0] = tokens

        reply = self._request("trees", progress=advance, prompts=prompts, branching=branching,
                              segment_tokens=segment_tokens, max_new_tokens=max_new_tokens,
                              sampling=_sampling(temperature, top_p, top_k), eos=eos)
        advance(reply["generated_tokens"])
        trees = []
        for prompt, leaves, computed in zip(prompts, reply["leaves"], reply["computed"]):
            leaves = sorted(leaves, key=lambda leaf: leaf["path"])
            trees.append(TreeRollout(
                prompt_ids=list(prompt), completions=[leaf["tokens"] for leaf in leaves],
                logprobs=[leaf["logprobs"] for leaf in leaves], finished=[leaf["finished"] for leaf in leaves],
                forward_positions=computed, paths=[leaf["path"] for leaf in leaves],
                counts=[math.prod(branching[len(leaf["path"]):]) for leaf in leaves]))
        ends = sorted(leaf["seconds"] for leaves in reply["leaves"] for leaf in leaves)
        ninety = ends[max(0, math.ceil(0.9 * len(ends)) - 1)] if ends else 0.0
        figures = {"decode_seconds": reply["seconds"], "decode_steps": reply["steps"],
                   "tail_time_share": (reply["seconds"] - ninety) / max(reply["seconds"], 1e-9),
                   "prompt_positions": reply["prompt_tokens"], "cached_positions": reply["cached_tokens"],
                   "generated_positions": reply["generated_tokens"]}
        return trees, figures

    @contextlib.contextmanager
    def episode_session(self, max_new_tokens: int, temperature: float, top_p: float, top_k: int, eos: list[int]):
        """A session of episodes' turns (the worker's `episodes`), holding the engine: an
        `EpisodeSession` to add requests to as the episodes' answers come back and to poll for
        the leaves as they end. Leaving it ends the session (what is in flight is dropped)."""
        with self._lock:
            if self._closed:
                raise EngineError("the vLLM engine is closed (episodes not sent); a new one must be started")
            session = EpisodeSession(self, next(self._calls))
            session.send(op="episodes", max_new_tokens=max_new_tokens, sampling=_sampling(temperature, top_p, top_k),
                         eos=eos)
            try:
                yield session
            finally:
                session.end()

    def generate(self, prompts: list[list[int]], max_tokens: int, eos: list[int], temperature: float = 0.0,
                 top_p: float = 1.0, top_k: int = 0) -> tuple[list[list[int]], list[list[float]]]:
        """One completion per prompt (greedy by default): tokens and each token's logprob."""
        trees, _ = self.sample_trees(prompts, [1], [], max_tokens, temperature, top_p, top_k, eos)
        return [tree.completions[0] for tree in trees], [tree.logprobs[0] for tree in trees]

    def load_policy(self, model: torch.nn.Module) -> float:
        """Replace the engine's weights by `model`'s (the policy after an update), in place,
        and drop its prefix cache; returns the seconds it took. The weights go through a
        buffer in shared memory (one copy; the engine loads from views of it: SharedWeights)."""
        started = time.perf_counter()
        with self._lock:  # the buffer is written under the call's lock: a close in between cannot free it
            try:
                self._exchange("load_weights", None, self.spec.timeout_s, self._weights.write(policy_tensors(model)))
            finally:
                self._weights.mapped()
        return time.perf_counter() - started

    def load_adapters(self, model: torch.nn.Module, model_cfg: ModelConfig) -> float:
        """With LoRA: serve through `model`'s adapters from now on (the policy after an
        update, configured by `model_cfg`), and drop the prefix cache; returns the seconds it
        took. The adapters go as a PEFT folder (megabytes) in shared memory; the base the
        engine started with is never sent."""
        started = time.perf_counter()
        with self._lock, tempfile.TemporaryDirectory(prefix="lsreplay-adapters-", dir=shared_memory()) as folder:
            write_adapter_folder(Store(folder), "adapter", checkpointed_state(model), model_cfg)
            self._exchange("load_adapter", None, self.spec.timeout_s, {"path": f"{folder}/adapter"})
        return time.perf_counter() - started

    def sleep(self) -> None:
        """Release the KV cache and the weights (vLLM's sleep mode) until `wake_up`; the
        weights must be loaded again then (CUDA only: the engine started with `sleeps`). A LoRA
        engine keeps its base in host memory (level 1): only the adapters are sent again."""
        self._request("sleep", level=1 if self.spec.lora_rank else 2)

    def wake_up(self) -> None:
        self._request("wake_up")

    def load_drafter(self, folder: str) -> None:
        """Speculate with the exported drafter in `folder` from now on (same shape as the one
        the engine started with)."""
        self._request("load_drafter", path=folder)

    def spec_counters(self) -> dict:
        """vLLM's speculative counters since the start: drafts, draft_tokens, accepted_tokens."""
        return self._request("metrics")


class EpisodeSession:
    """One `episodes` call in flight (VLLMEngine.episode_session): requests go as they come,
    leaves come back as they end. Any failure (an error answered, the process ended, no
    message for rollout.vllm.timeout_s while requests are in flight) closes the engine."""

    def __init__(self, engine: VLLMEngine, call: int):
        self.engine, self.call, self.pending = engine, call, 0  # requests with leaves to come
        self.heard = time.monotonic()
        self.figures: dict = {}

    def send(self, **message) -> None:
        self._guarded(lambda: self.engine._conn.send({"call": self.call, **message}))

    def add(self, requests: list[dict]) -> None:
        """Requests ({key, prompt, branching, segment_tokens}), each growing a tree of replies."""
        if not self.pending:
            self.heard = time.monotonic()
        self.pending += len(requests)
        self.send(add=requests)

    def poll(self, wait: float) -> list[dict]:
        """The leaves that ended, waiting up to `wait` seconds for the first."""
        leaves: list[dict] = []
        while self._guarded(lambda: self.engine._conn.poll(0 if leaves else wait)):
            reply = self._receive()
            leaves += reply["leaves"]
        if not leaves and self.pending and time.monotonic() - self.heard > self.engine.spec.timeout_s:
            self._guarded(self._overdue)
        return leaves

    def end(self) -> None:
        """End the call (the engine drops what is still in flight) and read its figures."""
        if self.engine._closed:
            return
        self.send(end=True)
        while "leaves" in (reply := self._receive()):
            pass
        self.figures = reply

    def _receive(self) -> dict:
        def receive() -> dict:
            if not self.engine._conn.poll(self.engine.spec.timeout_s):
                self._overdue()
            reply = self.engine._conn.recv()
            if reply.get("call") != self.call:
                raise EngineError(f"the vLLM engine answered call {reply.get('call')} to call {self.call} (episodes)")
            if "error" in reply:
                log.debug("vLLM engine traceback:\n%s", reply["traceback"])
                raise EngineError(f"vLLM engine: episodes failed: {reply['error']} ({reply['aborted']} requests in "
                                  f"flight aborted; the engine is closed; its log: {self.engine._log_path})")
            return reply

        reply = self._guarded(receive)
        self.heard = time.monotonic()
        self.figures = {k: v for k, v in reply.items() if k not in ("call", "leaves")}
        self.pending -= sum(leaf["last"] for leaf in reply.get("leaves", []))  # a request's last leaf
        return reply

    def _overdue(self) -> None:
        raise EngineError(f"the vLLM engine sent nothing for {self.engine.spec.timeout_s:g} s with episodes' "
                          "requests in flight and is killed (rollout.vllm.timeout_s sets the deadline)")

    def _guarded(self, op: Callable):
        if self.engine._closed:
            raise EngineError("the vLLM engine is closed (episodes); a new one must be started")
        try:
            return op()
        except (EOFError, OSError) as e:
            self.engine._fail()
            raise EngineError(f"the vLLM engine process ended during episodes ({self.engine._log_tail()})") from e
        except BaseException:
            self.engine._fail()
            raise


def check_engine(cfg, model_dir: Path) -> None:
    """Before any work, for rollout.engine=vllm: the model's family is one the engine is tested
    on (models.families.VLLM_TESTED), vLLM is installed in rollout.vllm.python, it runs the
    model's architecture, and on a CPU pool its KV cache plus a copy of the weights
    fit the available host memory (MemAvailable). ConfigError naming the fix otherwise."""
    from lsreplay.core.config import ConfigError

    if cfg.model.arch:
        raise ConfigError("config key 'model.arch' must be empty with rollout.engine=vllm: vLLM loads a model folder "
                          "(save the random model with save_pretrained and give its folder as model.path)")
    python = cfg.rollout.vllm.python
    if not Path(python).is_file():
        raise ConfigError(f"rollout.engine=vllm, but rollout.vllm.python={python} does not exist: `make setup` "
                          "installs vLLM into .venv-vllm, or point rollout.vllm.python at a Python that has vLLM")
    probe = subprocess.run([python, "-P", str(WORKER), "--probe"], capture_output=True, text=True, timeout=120,
                           env=engine_environment())
    if probe.returncode != 0:
        raise ConfigError(f"rollout.engine=vllm, but {python} cannot run vLLM ({probe.stderr.strip()[-300:]}): "
                          "`make setup` installs it into .venv-vllm")
    found = json.loads(probe.stdout)
    try:
        check_version(found["version"])
    except RuntimeError as e:
        raise ConfigError(f"rollout.engine=vllm: {e}") from None
    model_config = json.loads((model_dir / "config.json").read_text())
    if model_config.get("model_type") not in VLLM_TESTED:
        raise ConfigError(f"rollout.engine=vllm is tested on {', '.join(VLLM_TESTED)} models; {model_dir} is a "
                          f"{model_config.get('model_type')!r} model, whose weight sync and logprobs under vLLM "
                          "nothing checks: use rollout.engine=hf (docs/models.md)")
    if model_config.get("model_type") != "llama" and cfg.drafter.enabled and cfg.rollout.spec_threshold:
        raise ConfigError(f"vLLM speculates with lsreplay's drafter (vLLM's EAGLE-1 Llama draft) only for Llama "
                          f"targets, the ones tests/test_vllm.py checks; {model_dir} is a "
                          f"{model_config.get('model_type')!r} model: set rollout.spec_threshold=0 (the drafter still "
                          "trains) or drafter.enabled=false, or use rollout.engine=hf")
    architectures = model_config.get("architectures") or []
    if found["text_generation"] and not set(architectures) & set(found["text_generation"]):
        raise ConfigError(f"vLLM {found['version']} cannot run {model_dir} (architectures {architectures}); use "
                          "rollout.engine=hf, or a model vLLM supports (Llama, Qwen2, ... architectures)")
    if cfg.pool.accelerator == "cpu":
        weights = sum(p.stat().st_size for p in model_dir.glob("*.safetensors")) / 2**30
        free = available_memory() / 2**30
        if cfg.rollout.vllm.kv_cache_gb + weights > free:
            raise ConfigError(f"rollout.vllm.kv_cache_gb={cfg.rollout.vllm.kv_cache_gb} GiB of KV cache plus the "
                              f"model's {weights:.1f} GiB do not fit the {free:.1f} GiB of available memory; lower "
                              "rollout.vllm.kv_cache_gb")


def available_memory() -> int:
    """Bytes the system can give without swapping: MemAvailable, which counts the page cache
    it can drop (free pages alone fell to 0.2 GiB after `make setup`'s installs filled the
    cache, and refused a 0.25 GiB KV cache on a 24 GiB machine)."""
    with contextlib.suppress(OSError, StopIteration, ValueError):
        with open("/proc/meminfo") as f:
            return int(next(line for line in f if line.startswith("MemAvailable:")).split()[1]) * 1024
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def engine_spec(cfg, device: torch.device, model_dir: str, seed: int, drafter: str | None,
                span: tuple = ()) -> EngineSpec:
    """The engine a run's config asks for on `device` (with rollout.vllm.tensor_parallel_size,
    on the devices `span`, `device` first), started from `model_dir` with `seed`, speculating
    with the exported drafter in `drafter` (None: no speculation)."""
    r = cfg.rollout
    on_cuda = device.type == "cuda"
    parallel = r.vllm.tensor_parallel_size
    if parallel > 1 and on_cuda and len(span) < parallel:
        raise EngineStartError(f"rollout.vllm.tensor_parallel_size={parallel} but the rollout shard holds "
                               f"{len(span)} device(s): {[str(d) for d in span]}")
    return EngineSpec(
        python=r.vllm.python, model=model_dir, dtype=cfg.model.dtype, seed=seed,
        max_model_len=cfg.data.max_prompt_tokens + completion_tokens(r),  # an episode's last turn's request too
        kv_cache_gb=r.vllm.kv_cache_gb if not on_cuda or r.vllm.kv_cache_gb else 0.0,
        gpu_memory_utilization=r.vllm.gpu_memory_utilization,
        enforce_eager=not on_cuda if r.vllm.enforce_eager is None else r.vllm.enforce_eager,
        threads=cfg.threads or torch.get_num_threads(), device=str(device), drafter=drafter,
        draft_tokens=max(r.draft_lens) if drafter else 0, spec_threshold=r.spec_threshold if drafter else 0,
        timeout_s=r.vllm.timeout_s, sleeps=on_cuda and r.vllm.sleep_during_update,
        lora_rank=cfg.model.lora.rank if cfg.model.lora.enabled else 0, tensor_parallel=parallel,
        decode_context_parallel=r.vllm.decode_context_parallel_size,
        devices=tuple(str(d) for d in span[:parallel]) if parallel > 1 and on_cuda else ())


def same_engine(a: EngineSpec, b: EngineSpec) -> bool:
    """Whether an engine started as `a` serves `b`: the same everything, drafted or not (a
    newer drafter of the same shape loads in place; the first one needs a new start)."""
    same = replace(a, drafter=None, seed=0) == replace(b, drafter=None, seed=0)
    return same and (a.drafter is None) == (b.drafter is None)


def policy_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's weights by HF name, a tied weight once (what vLLM's loader takes), where
    they are; a critic's value head is not the HF model's."""
    state = model.state_dict()
    names = [n for n, _ in model.named_parameters() if not is_critic(n)] + \
        [n for n, _ in model.named_buffers() if n in state]
    return {n: state[n].detach() for n in names}


# Where the weights' buffer lies: shared memory (tmpfs) where the system has it.
SHARED_MEMORY = "/dev/shm"
ALIGN = 64  # bytes: every tensor's offset in the buffer, so that each dtype's view of it is aligned


def shared_memory() -> str | None:
    """The folder for files the engine reads as soon as they are written (None: the temp folder)."""
    return SHARED_MEMORY if os.path.isdir(SHARED_MEMORY) else None


class SharedWeights:
    """The buffer in shared memory a policy's weights are copied into, once per update, for
    the engine to load from views of it. Kept for the engine's life (a fresh buffer's page
    faults, on both sides, cost as much as the copy); its file goes as soon as the engine has
    mapped it, so that nothing is left in shared memory whatever ends the processes."""

    def __init__(self):
        self.path: str | None = None
        self.data: torch.Tensor | None = None
        self.linked = False

    def write(self, tensors: dict[str, torch.Tensor]) -> dict:
        """Copy `tensors` in; the request's arguments: the buffer's path and size, and
        [name, dtype, shape, byte offset] per tensor."""
        layout, size = [], 0
        for name, tensor in tensors.items():
            layout.append([name, str(tensor.dtype).removeprefix("torch."), list(tensor.shape), size])
            size += -(-tensor.numel() * tensor.element_size() // ALIGN) * ALIGN
        size = max(size, ALIGN)
        if self.data is None or self.data.numel() != size:
            self.close()
            descriptor, self.path = tempfile.mkstemp(prefix="lsreplay-weights-", dir=shared_memory())
            try:
                os.posix_fallocate(descriptor, 0, size)  # ENOSPC now, not SIGBUS at the copy
            except OSError as e:
                os.close(descriptor)
                os.unlink(self.path)
                raise EngineError(f"no room for the policy's {size / 2**20:.0f} MiB of weights in "
                                  f"{os.path.dirname(self.path)} ({e.strerror}): enlarge it (e.g. docker's "
                                  "--shm-size)") from None
            os.close(descriptor)
            self.data, self.linked = torch.from_file(self.path, shared=True, size=size, dtype=torch.uint8), True
        for (_, _, shape, offset), tensor in zip(layout, tensors.values()):
            nbytes = tensor.numel() * tensor.element_size()
            self.data[offset:offset + nbytes].view(tensor.dtype).view(shape).copy_(tensor)
        return {"buffer": self.path, "size": size, "layout": layout}

    def mapped(self) -> None:
        """The engine has mapped the buffer: its file can go."""
        if self.linked:
            os.unlink(self.path)
            self.linked = False

    def close(self) -> None:
        self.mapped()
        self.data = None


def cpu_shares(workers: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for `workers` CPU workers: this process's cores in as many
    contiguous groups ("0-3|4-7"; a core each at least, shared where there are fewer)."""
    cores = sorted(os.sched_getaffinity(0))
    size = max(1, len(cores) // workers)
    groups = [cores[(i * size) % len(cores):][:size] for i in range(workers)]
    return "|".join(f"{g[0]}-{g[-1]}" if len(g) > 1 else str(g[0]) for g in groups)


def engine_gpus(spec: EngineSpec, visible: str | None) -> str:
    """The engine's CUDA_VISIBLE_DEVICES: the physical GPUs of its devices (a tensor-parallel
    engine's `devices`, else its `device`), in their order, given the trainer's `visible`."""
    return ",".join(physical_device(int(d.partition(":")[2] or 0), visible) for d in spec.devices or (spec.device,))


def physical_device(index: int, visible: str | None) -> str:
    """What the engine's CUDA_VISIBLE_DEVICES says for the trainer's cuda:`index`, given the
    trainer's own CUDA_VISIBLE_DEVICES `visible`: CUDA numbers a process's devices in the
    order that variable lists them (a Ray actor's lists the GPU Ray gave it, its cuda:0), so
    cuda:i is its i-th entry; unset, physical device i."""
    if visible is None:
        return str(index)
    entries = [entry.strip() for entry in visible.split(",") if entry.strip()]
    if index >= len(entries):
        raise EngineStartError(f"the trainer's cuda:{index} is not among CUDA_VISIBLE_DEVICES={visible!r} "
                               f"({len(entries)} devices): list the pool's devices there, or unset it")
    return entries[index]


def check_device(device: str, engine_uuid: str | None) -> None:
    """EngineError unless the engine runs on the same physical GPU as the trainer's `device`."""
    if engine_uuid is None or not device.startswith("cuda"):
        return
    trainer_uuid = str(torch.cuda.get_device_properties(torch.device(device)).uuid)
    if trainer_uuid != engine_uuid:
        raise EngineError(f"the vLLM engine for {device} runs on GPU {engine_uuid}, the trainer's {device} is GPU "
                          f"{trainer_uuid} (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})")


def intel_openmp(python: str) -> Path | None:
    """The Intel OpenMP library of the environment `python` belongs to, if it has one. The
    environment is the interpreter's folder's parent as given, not resolved: a venv's python
    is a link to the base interpreter, whose folder holds no such library."""
    found = Path(os.path.abspath(python)).parents[1] / "lib" / "libiomp5.so"
    return found if found.is_file() else None


def _sampling(temperature: float, top_p: float, top_k: int) -> dict:
    # vLLM's top_k 0 means no cut, as lsreplay's does.
    return {"temperature": temperature, "top_p": top_p, "top_k": top_k}
