"""`lsreplay generate`: the trained drafter as a product. Lossless speculative decoding of
a policy checkpoint with a drafter exported by training, reporting tokens/s and acceptance."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from lsreplay.core.config import ModelConfig
from lsreplay.core.storage import Store
from lsreplay.drafter.export import load_hf
from lsreplay.models.loading import eos_ids, load_model, load_tokenizer
from lsreplay.rollout.speculative import SpecStats, speculative_generate
from lsreplay.state.checkpoint import load_module


@dataclass
class Generation:
    text: str
    new_tokens: int
    seconds: float
    accept_len: float

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / max(self.seconds, 1e-9)


def _folder(path: str | Path) -> tuple[Store, str]:
    """A store at the folder's parent and the folder's name as the key prefix."""
    path = Path(path).resolve()
    return Store(str(path.parent)), path.name


def generate(prompt: str, model: str, policy: str | None, drafter: str, max_new_tokens: int = 128,
             draft_len: int = 4, temperature: float = 0.0, seed: int = 0) -> Generation:
    """`policy`: a checkpoint folder (checkpoints/policy/step_N) over the base `model`;
    `drafter`: an exported drafter folder (checkpoints/drafter/step_N/hf)."""
    cfg = ModelConfig(path=model)
    target, tokenizer = load_model(cfg, trainable=False), load_tokenizer(cfg)
    if policy:
        load_module(*_folder(policy), target)
    draft = load_hf(*_folder(drafter), target)
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                         tokenize=False)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    stats, start = SpecStats(), time.perf_counter()
    out = speculative_generate(target, draft, [ids], max_new_tokens, temperature=temperature, draft_len=draft_len,
                               eos_token_id=eos_ids(tokenizer, target), stats=stats,
                               generator=torch.Generator().manual_seed(seed))[0].tolist()
    seconds = time.perf_counter() - start
    eos = set(eos_ids(tokenizer, target))
    new = next((i + 1 for i, t in enumerate(out) if t in eos), len(out))
    return Generation(tokenizer.decode(out[:new], skip_special_tokens=True), new, seconds, stats.accept_len)
