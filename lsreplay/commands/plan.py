"""Memory planner: will one RL step of this config fit the devices, and how many token
positions does it train?

    lsreplay plan CONFIG.yaml [key=value ...]

It prints what the planner's model counts (lsreplay/planning/, whose docstring says what that
is): per device the update's memory, replay's and the per-rollout (naive) backward's, and the
rollouts'; a prompt split over context-parallel ranks; per host; the store I/O a step.

The last printed line is key=value (positions_per_step=..., fits=...: the update, the
rollouts and the host). A plan that does not fit exits non-zero with a message saying what to
change; a replay.budget_mb too small for the trees' prompts (memory.kept_spans) is an error
naming the budget they need.
"""

from __future__ import annotations

import argparse
import sys

from lsreplay.core.config import ConfigError
from lsreplay.planning.context import ContextPlan
from lsreplay.planning.plan import FRAGMENTATION, Plan, load_plan_config, make_plan
from lsreplay.planning.step_io import StepIO
from lsreplay.planning.units import GiB


def gib(n: int) -> str:
    return f"{n / GiB:.2f}"


def format_plan(p: Plan) -> str:
    d, s, st = p.dims, p.shape, p.state
    tree = " x ".join(f"{b} (+{n})" for b, n in s.levels)
    lines = [
        (f"model     {p.model}: {d.layers} layers, hidden {d.hidden}, intermediate {d.intermediate}, "
         f"heads {d.heads}/{d.kv_heads} kv, head_dim {d.head_dim}, vocab {d.vocab}; {st.notes}"),
        (f"tree      prompt {s.prompt}, branching {tree} -> G={s.rollouts} rollouts of {s.completion} tokens; "
         f"{s.total_positions} per-rollout / {s.unique_positions} unique positions "
         f"({s.total_positions / s.unique_positions:.2f}x)"),
        (f"step      {p.trees} trees on {p.ranks} device(s), "
         + (f"each prompt split over {p.context.split.ranks} of them; " if p.context else
            f"{p.trees_per_device} per device (whole trees); ")
         + f"per-rollout positions {p.positions_per_step:,}, replay positions {p.replay_positions_per_step:,}"),
        f"peak run  replay: {p.replay.what} (past {p.replay.past}); naive: {p.naive.what} ({p.naive.width} positions)",
        f"branches  replay: {p.replay_path}",
        format_update(p),
        "",
        f"{'per device, GiB':<44} {'replay':>10} {'naive':>10}",
    ]
    rows = [
        ("weights (compute copy)", st.weights, st.weights),
        ("gradient accumulator", st.grads, st.grads),
        ("master weights (fp32)" + (" / ranks" if p.fsdp else ""), st.master, st.master),
        ("AdamW moments" + (" / ranks" if p.fsdp else ""), st.moments, st.moments),
        ("reduced gradient shard" if p.fsdp else "reduced gradient (in place)", st.grad_shard, st.grad_shard),
        ("prefix K/V + dK/dV held (one path)", p.replay.held_kv, p.naive.held_kv),
        ("activations saved for backward (peak run)", p.replay.saved, p.naive.saved),
        ("workspace: logits, one layer's backward (est.)", p.replay_workspace, p.naive_workspace),
        *([("vLLM engine kept (weights, KV cache)", p.engine_kept, p.engine_kept)] if p.engine_kept else []),
        (f"reserve: context/NCCL + {FRAGMENTATION:.0%} fragmentation", p.overhead(), p.overhead()),
    ]
    for name, a, b in rows:
        lines.append(f"{name:<44} {gib(a):>10} {gib(b):>10}")
    lines.append(f"{'total':<44} {gib(p.peak('replay')):>10} {gib(p.peak('naive')):>10}")
    if p.device_bytes:
        verdict = lambda m: "fits" if p.fits(m) else "DOES NOT FIT"  # noqa: E731
        lines.append(f"{'device memory':<44} {gib(p.device_bytes):>10} {gib(p.device_bytes):>10}")
        lines.append(f"{'':<44} {verdict('replay'):>10} {verdict('naive'):>10}")
    if p.context is not None:
        lines += ["", *format_context(p.context)]
    lines += ["", *format_rollout(p)]
    if p.host is not None:
        lines += ["", *format_host(p)]
    if p.io is not None:
        lines += ["", *format_io(p.io)]
    fits = p.step_fits()
    kv = dict(algo=p.algo, updates_per_step=p.updates, mode=p.mode, devices=p.ranks, fsdp=str(p.fsdp).lower(), trees=p.trees, rollouts_per_tree=s.rollouts,
              positions_per_step=p.positions_per_step, replay_positions_per_step=p.replay_positions_per_step,
              positions_ratio=f"{s.total_positions / s.unique_positions:.3f}", state_gib=gib(st.total),
              **({"lora_params": p.adapters} if p.adapters else {}), **_context_fields(p.context),
              peak_gib=gib(p.peak(p.mode)), replay_peak_gib=gib(p.peak("replay")),
              naive_peak_gib=gib(p.peak("naive")), rollout_peak_gib=gib(p.rollout_peak()),
              device_gib=gib(p.device_bytes), **({"host_gib": gib(p.host.total)} if p.host else {}),
              fits="unknown" if fits is None else str(fits).lower(),
              **({} if p.io is None else {"io_gib_per_step": gib(p.io.written + p.io.read),
                                          "io_s_per_step": f"{p.io.seconds():.1f}",
                                          "io_s_per_step_not_resident": f"{p.io.seconds(resident=False):.1f}"}))
    lines.append(" ".join(f"{k}={v}" for k, v in kv.items()))
    return "\n".join(lines)


def _context_fields(c: ContextPlan | None) -> dict:
    if c is None:
        return {}
    out = {"context_parallel": c.split.ranks, "share_positions": c.split.width,
           "cp_sent_gib_per_step": gib(c.sent)}
    for key, value in (("cp_comm_s", c.comm_seconds()), ("prefill_s", c.seconds(c.prefill_flops)),
                       ("backward_s", c.seconds(c.backward_flops))):
        if value is not None:
            out[key] = f"{value:.1f}"
    return out


def format_context(p: ContextPlan) -> list[str]:
    s = p.split
    each = f"each of the {p.trees} prompts a group replays a step" if p.trees > 1 else "the prompt"
    lines = [f"context parallelism: {each} of {s.prompt:,} positions split over {s.ranks} ranks "
             f"(replay.context_parallel), planned at a share of {s.width:,} positions after {s.before:,}", ""]
    lines += [f"{label:<66} {b / GiB:>10.2f}" for label, b in p.lines]
    if p.host:
        label = "the share's layer inputs in pinned host memory (replay.offload_prefix)"
        lines.append(f"{label:<66} {p.host / GiB:>10.2f}")
    comm = p.comm_seconds()
    lines.append(f"sent by the busiest rank a step: {p.sent / GiB:.2f} GiB (the shares' K/V and their gradient, the "
                 f"answers' queries and results)" + (f", {comm:.1f} s at {p.gbps:g} GB/s (pool.interconnect_gbps)"
                                                      if comm is not None else ""))
    prefill, backward, naive = (p.seconds(f) for f in (p.prefill_flops, p.backward_flops, p.per_rollout_flops))
    at = f" at {p.tflops:g} TFLOP/s (pool.device_tflops)" if p.tflops else ""
    lines.append(f"compute of the busiest rank (the last share){at}: prefill {p.prefill_flops / 1e15:.1f} PFLOP"
                 + (f" ({prefill:.0f} s)" if prefill is not None else "")
                 + f", backward {p.backward_flops / 1e15:.1f} PFLOP" + (f" ({backward:.0f} s)" if backward is not None
                                                                         else ""))
    lines.append(f"the per-rollout pipeline's forward and backward of the same {'trees' if p.trees > 1 else 'tree'}: "
                 f"{p.per_rollout_flops / 1e15:.1f} PFLOP"
                 + (f", {naive:.0f} s of one device" if naive is not None else ""))
    return lines


def format_update(p: Plan) -> str:
    """The algorithm's update: how many optimizer updates, what the later ones hold, the critic."""
    line = f"update    {p.algo}: {p.updates} optimizer update(s) a step"
    if p.updates > 1:
        line += (f"; the first on the stored prefix K/V, each later minibatch runs the caching pass again and holds "
                 f"its trees' K/V in host memory ({gib(p.minibatch_kv)} GiB)")
    if p.critic:
        line += f"; critic: a value head on the policy's trunk ({p.critic} params), no K/V or model of its own"
    if p.adapters:
        line += (f"; LoRA: {p.adapters / 1e6:.1f}M adapter params train on the frozen base, whose weights are held "
                 "in the compute dtype; the reference is the base with the adapters off")
    return line


def format_rollout(p: Plan) -> list[str]:
    r = p.rollout
    spans = f", each shard's engine on {r.tensor_parallel} devices (tensor parallel)" if r.tensor_parallel > 1 else ""
    lines = [f"rollouts, per device: engine {r.engine}, {r.trees} trees a shard ({p.trees} prompts over "
             f"{r.shards} rollout.shards{spans}), {r.rows} sequences decoding; the peak is at {r.peak_at}",
             f"each prompt's K/V {'is held once' if r.prompt_once else 'is held by every row (no cascade kernel here)'}"
             f"{' (vLLM: its prefix cache)' if r.engine == 'vllm' else ''}", ""]
    rows = [(label, b) for _, label, b in r.lines] + [
        (f"reserve: context/NCCL + {FRAGMENTATION:.0%} fragmentation", p.overhead())]
    lines += [f"{label:<66} {gib(b):>10}" for label, b in rows]
    lines.append(f"{'total':<66} {gib(p.rollout_peak()):>10}")
    if p.engine_during_update:
        lines.append(f"the engine during the caching pass and the update: {p.engine_during_update}")
    if r.kv_too_small:
        lines.append("the engine's KV cache cannot hold one of the shard's sequences (its prompt and completion): "
                     "vLLM cannot serve it; raise rollout.vllm.kv_cache_gb or rollout.vllm.tensor_parallel_size")
    elif r.kv_needed > r.part("kv"):
        lines.append("the engine's KV cache holds fewer positions than the shard's sequences need at once: vLLM "
                     "preempts and recomputes sequences (slower); raise rollout.vllm.kv_cache_gb or rollout.shards")
    if p.device_bytes:
        lines.append(f"{'device memory':<66} {gib(p.device_bytes):>10}")
        lines.append(f"{'':<66} {'fits' if p.rollout_fits() else 'DOES NOT FIT':>10}")
    return lines


def format_io(io: StepIO) -> list[str]:
    gbps = io.bandwidth / 1e9
    return [
        f"store I/O per step at {gbps:g} GB/s (storage.bandwidth_gbps), GiB",
        f"  prefix K/V written by the caching pass, read by replay   {gib(io.prefix_kv):>8} x 2",
        f"  KL logprobs and drafter hidden states, written and read  {gib(io.activations):>8} x 2",
        f"  checkpoint (fp32 masters + AdamW) every {io.every} step(s)        {gib(io.checkpoint):>8} / {io.every}",
        f"  total {gib(io.written + io.read)} GiB, {io.seconds():.1f} s a step (checkpoints written in the background)",
        f"  stages that keep nothing (checkpoint.resident=false) also read {gib(io.model_loads)} GiB of models "
        f"and write and read a checkpoint every step: {io.seconds(resident=False):.1f} s a step",
    ]


def format_host(p: Plan) -> list[str]:
    h = p.host
    lines = [f"host memory, per host ({h.devices} of the pool's devices a host, {h.hosts} host(s))", ""]
    lines += [f"{label:<66} {gib(b):>10}" for label, b in h.lines]
    lines.append(f"{'total':<66} {gib(h.total):>10}")
    if p.host_bytes:
        lines.append(f"{'host memory (pool.host_memory_gb)':<66} {gib(p.host_bytes):>10}")
        lines.append(f"{'':<66} {'fits' if p.host_fits() else 'DOES NOT FIT':>10}")
    return lines


def rollout_advice(p: Plan) -> str:
    r = p.rollout
    if r.kv_too_small:
        return ("the rollout engine's KV cache cannot hold one of the shard's sequences; raise "
                "rollout.vllm.kv_cache_gb, or spread the engine over more devices (rollout.vllm.tensor_parallel_size)")
    return (f"the rollouts need {gib(p.rollout_peak())} GiB per device but a device has {gib(p.device_bytes)} GiB "
            f"(K/V of {r.rows} sequences decoding at once: {gib(r.part('kv'))} GiB); try more rollout.shards "
            f"(a shard decodes {r.trees} of the {p.trees} trees now), or fewer data.prompts_per_step")


def advice(p: Plan) -> str:
    need, have = p.peak(p.mode), p.device_bytes
    tips = []
    if not p.fsdp and p.ranks > 1:
        tips.append("replay.fsdp=true (shards master weights, moments and gradients)")
    elif p.state.total + p.overhead() > have:
        tips.append(f"more devices per step with FSDP (the model state alone is {gib(p.state.total)} GiB)")
    if p.mode == "naive" and p.fits("replay"):
        tips.append("replay.mode=replay (it fits)")
    run = p.replay if p.mode == "replay" else p.naive
    tips.append(f"a shorter prompt or completion (the peak run is {run.what}, {gib(run.total)} GiB)")
    if p.mode == "replay":
        now = f"{p.budget_bytes // 2**20}" if p.budget_bytes else "0, the per-rollout backward's"
        tips.append(f"a smaller replay.budget_mb (now {now}: what one root-to-leaf path of the backward holds at "
                    "once; fewer sibling leaves share a micro-batch, and a prompt whose graph does not fit runs layer "
                    "by layer)")
    return (f"the {p.mode} step needs {gib(need)} GiB per device but a device has {gib(have)} GiB; "
            f"try {'; or '.join(tips)}")


def host_advice(p: Plan) -> str:
    largest = max(p.host.lines, key=lambda line: line[1])
    return (f"a host needs {gib(p.host.total)} GiB but has {gib(p.host_bytes)} GiB (pool.host_memory_gb; the most: "
            f"{largest[0]}, {gib(largest[1])} GiB); try fewer devices a host (pool.devices_per_host), "
            "replay.offload_prefix=false, or replay.kv_offload=store")


def main(argv: list[str] | None = None) -> int:
    from lsreplay.models.loading import ModelError

    ap = argparse.ArgumentParser(prog="lsreplay plan", description=__doc__.split("\n\n")[0])
    ap.add_argument("config", help="YAML config")
    ap.add_argument("overrides", nargs="*", help="key=value overrides")
    args = ap.parse_args(argv)
    try:
        cfg, values = load_plan_config(args.config, args.overrides)
        plan = make_plan(cfg, values)
    except (ConfigError, ModelError) as e:
        print(f"lsreplay plan: error: {e}", file=sys.stderr)
        return 2
    print(format_plan(plan), flush=True)
    problems = ([advice(plan)] if plan.fits() is False else []) + (
        [rollout_advice(plan)] if plan.rollout_fits() is False else []) + (
        [host_advice(plan)] if plan.host_fits() is False else [])
    if problems:
        print(f"lsreplay plan: error: does not fit: {'; and '.join(problems)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
