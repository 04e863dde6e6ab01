"""Stage 2: sample each prompt's rollouts as a tree and score them."""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from tqdm.auto import tqdm

from lsreplay import faults
from lsreplay.data import ANSWER_INSTRUCTION, Prompt, score
from lsreplay.models import eos_ids, load_tokenizer
from lsreplay.rollout.sampling import SamplingParams
from lsreplay.rollout.tree_sampler import sample_trees
from lsreplay.run import Run
from lsreplay.stages.common import policy_before


def render_prompt(tokenizer, prompt: Prompt, system_prompt: str, max_tokens: int) -> list[int]:
    messages = [{"role": "user", "content": prompt.question + ANSWER_INSTRUCTION}]
    if system_prompt:
        messages.insert(0, {"role": "system", "content": system_prompt})
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) > max_tokens:
        raise ValueError(f"prompt {prompt.index} has {len(ids)} tokens, more than data.max_prompt_tokens="
                         f"{max_tokens}; raise the limit or use shorter prompts")
    return ids


def generate_trees(run: Run, step: int, progress: Callable[[float], None] | None = None) -> dict:
    """`progress`, if given, is called with the fraction of the step's token budget sampled so far."""
    if done := run.done(step, "trees"):
        return done
    run.begin(step, "trees")
    cfg, r = run.cfg, run.cfg.rollout
    key = run.key(step, "prompts.json")
    with run.reading(step, "prompts"):
        stored = run.store.read_json(key, sha256=run.sha256(run.manifest(step, "prompts"), key))
    prompts = [Prompt(**p) for p in stored["prompts"]]
    model, tokenizer = policy_before(run, step), load_tokenizer(cfg.model)
    params = SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k)
    prompt_ids = [render_prompt(tokenizer, p, cfg.data.system_prompt, cfg.data.max_prompt_tokens) for p in prompts]
    start = time.perf_counter()
    with tqdm(total=len(prompts) * math.prod(r.branching) * r.max_new_tokens, desc=f"step {step} rollouts",
              unit="tok", leave=False) as bar:

        def advance(tokens: int) -> None:
            bar.update(tokens)
            if progress is not None:
                progress(min(bar.n / bar.total, 1.0) if bar.total else 1.0)

        trees, trace = sample_trees(
            model, prompt_ids, list(r.branching), list(r.segment_tokens), r.max_new_tokens, params,
            eos_ids(tokenizer, model), [run.generator(step, "trees", i) for i in range(len(prompts))], advance)
    seconds = time.perf_counter() - start
    if progress is not None:
        progress(1.0)  # every rollout ended (most before the token budget)
    records = [tree_record(tokenizer, prompt, tree, dict(cfg.data.task_args).get(prompt.task))
               for prompt, tree in zip(prompts, trees)]
    entry = run.store.write_json(run.key(step, "trees.json"), {"trees": records})
    faults.hook("trees", step, "mid")
    rewards = [x for rec in records for x in rec["rewards"]]
    lengths = [len(c) for rec in records for c in rec["completions"]]
    return run.finish(step, "trees", {
        "files": [entry], "trees": len(records), "rollouts": len(rewards),
        "reward_mean": sum(rewards) / len(rewards), "completion_tokens": sum(lengths),
        "forward_positions": sum(t.forward_positions for t in trees), "seconds": seconds,
        "tokens_per_s": sum(lengths) / seconds, **trace.summary(lengths)})


def tree_record(tokenizer, prompt: Prompt, tree, task_args: dict | None) -> dict:
    """What the store keeps of one tree: tokens, behaviour logprobs, texts, rewards."""
    texts = [tokenizer.decode(c, skip_special_tokens=True) for c in tree.completions]
    return {"prompt_index": prompt.index, "prompt_ids": tree.prompt_ids, "completions": tree.completions,
            "logprobs": tree.logprobs, "finished": tree.finished, "texts": texts,
            "rewards": [score(prompt, t, task_args) for t in texts]}
