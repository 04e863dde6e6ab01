"""Data parallel (and FSDP2) branch-replay backward over the accelerator pool.

Trees are the unit of work: a rank runs the replay (or naive) backward of whole trees,
so no prefix K/V ever crosses ranks. `split_trees` balances ranks by the positions they
compute. The exception: with context parallelism (`context_parallel` ranks a group,
distributed/context.py) a tree whose prompt one device cannot hold is replayed by every rank
of a group together, its prompt split over them; such trees go to the groups, the others to
the ranks, and the gradient reduction below stays one. The loss weights are global (GRPO normalises over the whole batch), so they are
computed once for every tree *before* splitting; the sum over ranks of each rank's
gradient is then exactly the single-process gradient, and gradients are summed, not
averaged.

Two ways to hold the model:

- plain data parallel: every rank holds the whole model; after the local backward the
  gradients are summed with one all-reduce per dtype bucket (gloo on CPU, NCCL on GPU).
- FSDP2 (`shard_model`, torch's `fully_shard` per decoder layer plus the root): between
  steps each rank keeps 1/world of the parameters, gradients and optimizer state. Ranks
  run different trees, hence a different number of forward/backward calls, so FSDP's
  per-call all-gather / reduce-scatter would not line up across ranks. Instead the
  backward gathers the parameters once (`unshard`), accumulates gradients locally with
  gradient sync off (FSDP keeps them unsharded, in `reduce_dtype` if set), then every
  rank runs one identical zero-weight forward/backward with sync on, in which FSDP
  reduce-scatters (sums) the accumulated gradients into each rank's shard, and the
  parameters are resharded. During the backward a rank therefore holds the full compute
  weights and a full gradient accumulator; `lsreplay.planning` counts exactly that.

`launch` runs a function on `world_size` local processes (they meet in a file of a folder
only this user can open, and talk over the loopback interface) and returns each rank's return
value. Gloo ranks fork from a fork server that imported the function's module once (ranks
start every step; spawned, each paid the imports again, ~6 s of CPU a rank); NCCL ranks are
spawned.
"""

from __future__ import annotations

import io
import logging
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager

import torch
import torch.distributed as dist

from lsreplay.core import faults
from lsreplay.distributed.context import context_group
from lsreplay.replay.backward import BackwardStats, PrefixKVSource, naive_backward, replay_backward, splits
from lsreplay.replay.heads import Heads, per_head
from lsreplay.tree import RolloutTree

log = logging.getLogger(__name__)


# -- splitting ---------------------------------------------------------------------------
def tree_cost(tree: RolloutTree, mode: str = "replay") -> int:
    """Positions a rank computes for `tree`: unique (replay) or per-rollout (naive)."""
    return tree.unique_positions if mode == "replay" else tree.total_positions


def split_trees(trees: Sequence[RolloutTree], ranks: int, mode: str = "replay") -> list[list[int]]:
    """Assign whole trees to `ranks`, balanced by positions computed: greedy, largest
    tree first, each to the least-loaded rank (ties: lowest rank). Returns tree indices
    per rank, each list ascending. Deterministic, so every rank computes the same split."""
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks}")
    loads = [0] * ranks
    out: list[list[int]] = [[] for _ in range(ranks)]
    order = sorted(range(len(trees)), key=lambda i: (-tree_cost(trees[i], mode), i))
    for i in order:
        r = min(range(ranks), key=lambda k: (loads[k], k))
        out[r].append(i)
        loads[r] += tree_cost(trees[i], mode)
    return [sorted(x) for x in out]


# -- FSDP2 -------------------------------------------------------------------------------
def _decoder_layers(model) -> list[torch.nn.Module]:
    layers = getattr(model.base_model, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: no base_model.layers to shard")
    return list(layers)


def shard_model(model, param_dtype: torch.dtype | None = None, reduce_dtype: torch.dtype | None = None,
                mesh=None):
    """FSDP2: `fully_shard` every decoder layer, then the root (embeddings, final norm,
    LM head; tied weights stay in one group). Gradients are summed over ranks, not
    averaged. Mixed precision: keep the (sharded) parameters in e.g. float32 as master
    weights and compute in `param_dtype` (e.g. bfloat16), reducing in `reduce_dtype`.
    Build the optimizer after this, over `model.parameters()` (the sharded DTensors)."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for layer in _decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)  # global loss weights: sum, never average
            m.set_force_sum_reduction_for_comms(True)  # plain SUM (gloo has no PREMUL_SUM)
    model.set_reduce_scatter_unused_params(True)
    return model


def is_sharded(model) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def _fsdp_modules(model) -> list:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def _sync_token(model) -> torch.Tensor:
    device = next(model.parameters()).device
    return torch.zeros(1, 1, dtype=torch.long, device=device)


def _fsdp_gather(model) -> None:
    """Unshard every FSDP group once and keep it so for the whole local backward."""
    model.set_reshard_after_forward(False)
    model.set_reshard_after_backward(False)
    model.set_requires_gradient_sync(False)
    with torch.no_grad():  # the root's forward runs FSDP's lazy init (root = the model)
        model(input_ids=_sync_token(model), use_cache=False)
    for m in _fsdp_modules(model):
        m.unshard()


def _fsdp_release(model) -> None:
    for m in _fsdp_modules(model):
        m.reshard()
    model.set_reshard_after_forward(True)
    model.set_reshard_after_backward(True)
    model.set_requires_gradient_sync(True)


def _fsdp_reduce(model) -> None:
    """Every rank: one identical zero-weight forward/backward with gradient sync on; its
    post-backward reduce-scatters each group's accumulated unsharded gradient. Then reshard."""
    model.set_requires_gradient_sync(True)
    model.set_reshard_after_backward(True)
    logits = model(input_ids=_sync_token(model), use_cache=False).logits
    (logits.float().sum() * 0.0).backward()
    _fsdp_release(model)


@contextmanager
def gathered(model):
    """Full parameters on every rank inside the block (a collective), e.g. for the no-grad
    caching pass (`capture_tree`) on a sharded model, which calls the decoder directly and
    so never triggers the root's FSDP hooks. A no-op for an unsharded model."""
    if not is_sharded(model):
        yield model
        return
    _fsdp_gather(model)
    try:
        yield model
    finally:
        _fsdp_release(model)


# -- plain data parallel -----------------------------------------------------------------
def all_reduce_grads(params: list[torch.Tensor], group=None, bucket_bytes: int = 256 * 2**20) -> None:
    """Sum every tensor's .grad over ranks (missing grads count as zero), in flattened
    buckets of about `bucket_bytes` per dtype."""
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in params:
        by_dtype.setdefault(p.grad.dtype, []).append(p.grad)

    def flush(bucket: list[torch.Tensor]) -> None:
        flat = torch.cat([g.reshape(-1) for g in bucket])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        offset = 0
        for g in bucket:
            g.copy_(flat[offset: offset + g.numel()].view_as(g))
            offset += g.numel()

    for dtype in sorted(by_dtype, key=str):
        bucket, size = [], 0
        for g in by_dtype[dtype]:
            bucket.append(g)
            size += g.numel() * g.element_size()
            if size >= bucket_bytes:
                flush(bucket)
                bucket, size = [], 0
        if bucket:
            flush(bucket)


# -- the backward ------------------------------------------------------------------------
def data_parallel_backward(model, trees: Sequence[RolloutTree], weights, rank: int, world_size: int,
                           mode: str = "replay", fsdp: bool | None = None,
                           prefix_kv: PrefixKVSource | None = None, budget_bytes: int | None = None,
                           join_below: int = 0, group=None, grad_params: list[torch.Tensor] | None = None, *,
                           heads: Heads, offload_prefix: bool = False, context_parallel: int = 1,
                           context_threshold: int = 0) -> BackwardStats:
    """This rank's share of the batch gradient, summed over ranks into `.grad`.

    `trees` and `weights` are the WHOLE batch (same on every rank; weights computed
    globally); this rank backpropagates `split_trees(trees, world_size)[rank]` and the
    gradients are summed over ranks, so every rank ends with the single-process gradient
    (plain DP: the full gradient; FSDP: its shard). `prefix_kv(i, node)` is indexed by the
    batch's tree index. fsdp: None = whether `model` was passed through `shard_model`.

    grad_params: where the gradients accumulate, plain DP (default: the model's trainable
    parameters; a mixed-precision TrainState's float32 masters). heads, weights,
    offload_prefix: as for replay_backward (weights by head name with heads).
    context_parallel: ranks of a context-parallel group (1: none); a tree it splits
    (replay.backward.splits; `context_threshold` positions of its prompt, 0: where one device
    would need more than the budget) is replayed by every rank of one group together, each
    group taking its share of those trees, every rank its share of the others.

    Returns stats summed over ranks (objective, positions), the max peak and this
    rank's wall time (compute + communication)."""
    by_head, _ = per_head(weights, heads)
    if any(len(w) != len(trees) for w in by_head.values()):
        raise ValueError(f"got weights for {[len(w) for w in by_head.values()]} trees, expected {len(trees)}")
    if mode not in ("replay", "naive"):
        raise ValueError(f"mode must be 'replay' or 'naive', got {mode!r}")
    fsdp = is_sharded(model) if fsdp is None else fsdp
    if fsdp and not is_sharded(model):
        raise ValueError("fsdp=True needs a model passed through shard_model() first")
    start = time.perf_counter()
    context = context_group(rank, world_size, context_parallel, context_threshold) if mode == "replay" else None
    mine = _assigned(model, trees, rank, world_size, mode, context, join_below, budget_bytes, offload_prefix)
    local_trees = [trees[i] for i in mine]
    local_w = {name: [w[i] for i in mine] for name, w in by_head.items()}
    if fsdp:
        _fsdp_gather(model)
    if mode == "replay":
        source = None if prefix_kv is None else (lambda j, node: prefix_kv(mine[j], node))
        stats = replay_backward(model, local_trees, local_w, prefix_kv=source, budget_bytes=budget_bytes,
                                join_below=join_below, heads=heads, offload_prefix=offload_prefix, context=context)
    else:
        stats = naive_backward(model, local_trees, local_w, heads=heads)
    if fsdp:
        _fsdp_reduce(model)
    else:
        all_reduce_grads(grad_params or [p for p in model.parameters() if p.requires_grad], group)
    device = next(model.parameters()).device
    sums = torch.tensor([stats.objective, stats.positions, stats.per_rollout_positions,
                         stats.layer_by_layer_positions], dtype=torch.float64, device=device)
    peak = torch.tensor([stats.peak_activation_bytes, stats.device_peak_bytes or 0], dtype=torch.float64,
                        device=device)
    dist.all_reduce(sums, group=group)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
    return BackwardStats(
        objective=float(sums[0]), positions=int(sums[1]), per_rollout_positions=int(sums[2]),
        seconds=time.perf_counter() - start, peak_activation_bytes=int(peak[0]),
        device_peak_bytes=int(peak[1]) if stats.device_peak_bytes is not None else None,
        layer_by_layer_positions=int(sums[3]))


def _assigned(model, trees: Sequence[RolloutTree], rank: int, world: int, mode: str, context, join_below: int,
              budget_bytes: int | None, offload_prefix: bool) -> list[int]:
    """The batch's trees this rank replays: those its context-parallel group splits (its share of
    the trees split at all, the same on every rank of the group, first), then its share of the
    others."""
    split = [i for i, t in enumerate(trees) if splits(model, t, context, join_below, budget_bytes, offload_prefix)]
    whole = [i for i in range(len(trees)) if i not in split]
    mine = [whole[j] for j in split_trees([trees[i] for i in whole], world, mode)[rank]]
    if not split:
        return mine
    ours = [split[j] for j in split_trees([trees[i] for i in split], context.groups, mode)[context.number]]
    return ours + mine


def full_state(model) -> dict[str, torch.Tensor]:
    """Every parameter as a full (unsharded) CPU tensor, on every rank (a collective
    under FSDP)."""
    out = {}
    for name, p in model.named_parameters():
        t = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name] = t.detach().cpu().clone()
    return out


def full_grads(model) -> dict[str, torch.Tensor | None]:
    """Every parameter's gradient, full, on CPU (a collective under FSDP)."""
    out = {}
    for name, p in model.named_parameters():
        g = p.grad
        if g is not None and hasattr(g, "full_tensor"):
            g = g.full_tensor()
        out[name] = None if g is None else g.detach().cpu().clone()
    return out


# -- launching ---------------------------------------------------------------------------
def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def loopback_interface() -> str:
    """The name of this host's loopback network interface (Linux's `lo`)."""
    for name in sorted(os.listdir("/sys/class/net")) if os.path.isdir("/sys/class/net") else []:
        try:
            with open(f"/sys/class/net/{name}/flags") as f:
                if int(f.read(), 16) & 0x8:  # IFF_LOOPBACK
                    return name
        except (OSError, ValueError):
            continue
    return "lo"


def start_method(backend: str) -> str:
    """How `launch` starts ranks: gloo's fork from the fork server; NCCL's are spawned (a rank
    must not inherit a process that may have touched CUDA, and the fork server is not checked
    on a GPU)."""
    return "forkserver" if backend == "gloo" else "spawn"


def _worker(rank: int, world_size: int, rendezvous: str, backend: str, calls, results, threads: int | None,
            doomed_rendezvous: bool) -> None:
    # The call comes through a queue, not the process's arguments: a fork server takes at
    # most 252 file descriptors with a new process, fewer than the shared tensors of a model's
    # state have. A forked rank has the environment the fork server started with: the
    # caller's now (a stage's devices, faults) replaces it.
    fn, args, environ = calls.get()
    os.environ.clear()
    os.environ.update(environ)
    # The ranks meet in a file of a folder only this user can open (no TCP store listening on
    # every interface), and gloo's and NCCL's own sockets are on the loopback interface.
    loopback = loopback_interface()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), GLOO_SOCKET_IFNAME=loopback,
                      NCCL_SOCKET_IFNAME=loopback)
    if threads:
        torch.set_num_threads(threads)
    try:
        if doomed_rendezvous and rank == world_size - 1:
            raise RuntimeError(f"injected failure ({faults.ENV}=ranks:fail)")
        dist.init_process_group(backend, init_method=f"file://{rendezvous}", rank=rank, world_size=world_size)
    except RuntimeError as e:  # before `fn` ran: `launch` may try again
        raise RuntimeError(f"{RENDEZVOUS_FAILED}: {e}") from e
    try:
        out = fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()
    buf = io.BytesIO()  # plain bytes: no shared-memory handles that die with this process
    torch.save(out, buf)
    results.put((rank, buf.getvalue()))


# A rank's error raised while the group formed, before the rank's function ran. Gloo's full
# mesh on the loopback interface now and then fails to form ("Connection closed by peer",
# pytorch/pytorch#53270; once in a test suite here): `launch` starts the ranks again, as
# nothing has run yet.
RENDEZVOUS_FAILED = "the ranks' process group did not form"
RENDEZVOUS_TRIES = 3


def launch(fn: Callable, world_size: int, args: tuple = (), backend: str | None = None,
           threads: int | None = None) -> list:
    """Run `fn(rank, world_size, *args)` in `world_size` processes (start_method) joined in one
    process group (a FileStore in a 0700 temporary folder, sockets on the loopback interface;
    gloo on CPU, NCCL on GPU), started again where the group did not form (RENDEZVOUS_TRIES).
    `fn` must be importable (module level); its return value travels back through torch.save,
    so keep it small (tensors, dicts, numbers). Returns the values by rank; a rank's exception
    is raised here. threads: torch threads per rank. With NCCL, `fn` sets its rank's device
    (torch.cuda.set_device) before its first collective."""
    from torch.multiprocessing import ProcessRaisedException

    for attempt in range(1, RENDEZVOUS_TRIES + 1):
        try:
            return _launch_once(fn, world_size, args, backend or default_backend(), threads)
        except ProcessRaisedException as e:
            if RENDEZVOUS_FAILED not in str(e) or attempt == RENDEZVOUS_TRIES:
                raise
            log.warning("%s (try %d of %d; starting the ranks again): %s", RENDEZVOUS_FAILED, attempt,
                        RENDEZVOUS_TRIES, str(e).strip().splitlines()[-1])


def _launch_once(fn: Callable, world_size: int, args: tuple, backend: str, threads: int | None) -> list:
    import queue

    import torch.multiprocessing as mp

    method = start_method(backend)
    ctx = mp.get_context(method)
    if method == "forkserver":  # what the server imports when it starts (once per process; later calls change nothing)
        ctx.set_forkserver_preload([__name__, fn.__module__])
    calls, results = ctx.Queue(), ctx.Queue()
    for _ in range(world_size):
        calls.put((fn, args, dict(os.environ)))
    out: list = [None] * world_size

    def drain(timeout: float) -> None:
        try:
            while True:
                rank, data = results.get(timeout=timeout)
                out[rank] = torch.load(io.BytesIO(data), weights_only=True)
                timeout = 0.01
        except queue.Empty:
            pass

    with tempfile.TemporaryDirectory(prefix="lsreplay-ranks-") as folder:  # 0700: this user's alone
        procs = mp.start_processes(_worker, args=(world_size, os.path.join(folder, "rendezvous"), backend, calls,
                                                  results, threads, faults.failed_rendezvous()),
                                   nprocs=world_size, join=False, start_method=method)
        while not procs.join(timeout=0.05):  # raises if a rank failed
            drain(0.05)
    drain(0.2)
    return out
