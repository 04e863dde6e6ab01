"""A run's products served by vLLM's OpenAI server: the policy alone, then with its drafter.

    .venv/bin/python bench/serve.py [--run runs/default] [--step N] [--prompts 16] [--max-tokens 128]

Starts `python -m vllm.entrypoints.openai.api_server` from .venv-vllm twice on the run's
checkpoint of step N (default: the newest) — its hf/ folder, then the same with the drafter
of step N as its EAGLE speculator (3 draft tokens) — and sends each the same held-out chat
prompts one at a time, greedy (one user's latency, what speculative decoding is for). Per
server: completion tokens per second of wall time, and, with the drafter, vLLM's own
counters from /metrics: drafts, draft tokens, accepted tokens, acceptance length (tokens
per sequence per verify step). The greedy answers of the two must be the same text.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from lsreplay.core.run import Run, open_run_config  # noqa: E402
from lsreplay.data.prompt_sets import source_prompts  # noqa: E402
from lsreplay.rollout.vllm_engine import intel_openmp  # noqa: E402
from lsreplay.state import checkpointing  # noqa: E402

PYTHON = REPO / ".venv-vllm/bin/python"
PORT = 8765


def serve(policy: Path, drafter: Path | None, log: Path) -> subprocess.Popen:
    command = [str(PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(policy), "--port", str(PORT),
               "--dtype", json.loads((policy / "config.json").read_text()).get("dtype", "auto"),
               "--kv-cache-memory-bytes", str(2**30), "--enforce-eager"]
    if drafter is not None:
        command += ["--speculative-config",
                    json.dumps({"method": "eagle", "model": str(drafter), "num_speculative_tokens": 3})]
    iomp = intel_openmp(str(PYTHON))  # vLLM's CPU kernels want it preloaded
    env = {**os.environ, **({"LD_PRELOAD": str(iomp)} if iomp is not None else {})}
    server = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
    for _ in range(300):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{PORT}/v1/models", timeout=2)
            return server
        except OSError:
            if server.poll() is not None:
                raise SystemExit(f"the server ended: see {log}")
            time.sleep(1)
    raise SystemExit(f"the server did not answer: see {log}")


def chat(model: str, messages: list[dict], max_tokens: int) -> tuple[str, int]:
    body = json.dumps({"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{PORT}/v1/chat/completions", body,
                                     {"Content-Type": "application/json"})
    answer = json.loads(urllib.request.urlopen(request, timeout=600).read())
    return answer["choices"][0]["message"]["content"], answer["usage"]["completion_tokens"]


def spec_counters() -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{PORT}/metrics", timeout=10).read().decode()
    found = re.findall(r"^vllm:spec_decode_num_(drafts|draft_tokens|accepted_tokens)_total\{[^}]*\} ([0-9.e+]+)$",
                       text, re.M)
    return {name: float(value) for name, value in found}


def measure(policy: Path, drafter: Path | None, questions: list[list[dict]], max_tokens: int, log: Path) -> dict:
    server = serve(policy, drafter, log)
    try:
        chat(str(policy), questions[0], 8)  # the first request pays for lazy set-up: not timed
        before, start, tokens, answers = spec_counters(), time.perf_counter(), 0, []
        for question in questions:
            text, n = chat(str(policy), question, max_tokens)
            answers.append(text)
            tokens += n
        seconds, after = time.perf_counter() - start, spec_counters()
    finally:
        server.terminate()
        server.wait(60)
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in ("drafts", "draft_tokens", "accepted_tokens")}
    return {"tokens_per_s": tokens / seconds, "tokens": tokens, "answers": answers, **delta,
            "accept_len": 1 + delta["accepted_tokens"] / delta["drafts"] if delta["drafts"] else 1.0}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", default=str(REPO / "runs/default"))
    parser.add_argument("--step", type=int)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args(argv)
    run = Run(open_run_config(args.run))
    step = args.step if args.step is not None else checkpointing.complete_steps(run)[-1]
    policy = Path(args.run) / f"checkpoints/policy/step_{step:04d}/hf"
    drafter = Path(args.run) / f"checkpoints/drafter/step_{step:04d}/hf"
    prompts, system = source_prompts(run.cfg), run.cfg.data.system_prompt
    # Rows at the end of the run's source (a short run samples few), behind the run's system prompt.
    questions = [[*([{"role": "system", "content": system}] if system else []),
                  {"role": "user", "content": prompts[len(prompts) - 1 - i].question}] for i in range(args.prompts)]
    plain = measure(policy, None, questions, args.max_tokens, Path(args.run) / "serve-plain.log")
    drafted = measure(policy, drafter, questions, args.max_tokens, Path(args.run) / "serve-drafter.log")
    same = sum(a == b for a, b in zip(plain["answers"], drafted["answers"]))
    print(f"served {policy} ({args.prompts} held-out prompts, greedy, <= {args.max_tokens} tokens, one at a time)")
    print(f"plain:        {plain['tokens_per_s']:.1f} tokens/s ({plain['tokens']} tokens)")
    print(f"with drafter: {drafted['tokens_per_s']:.1f} tokens/s; drafts {drafted['drafts']:.0f}, draft tokens "
          f"{drafted['draft_tokens']:.0f}, accepted {drafted['accepted_tokens']:.0f}")
    print(f"speedup={drafted['tokens_per_s'] / plain['tokens_per_s']:.3f} accept_len={drafted['accept_len']:.3f} "
          f"acceptance={drafted['accepted_tokens'] / max(drafted['draft_tokens'], 1):.3f} "
          f"same_answers={same}/{len(questions)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
