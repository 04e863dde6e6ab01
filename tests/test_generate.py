"""`lsreplay generate`: a policy checkpoint plus an exported drafter, speculative and lossless."""

import torch

from lsreplay.cli import main
from lsreplay.core.config import ModelConfig
from lsreplay.core.storage import Store
from lsreplay.drafter import Drafter
from lsreplay.drafter.export import save_hf
from lsreplay.models.loading import eos_ids, load_model, load_tokenizer
from lsreplay.rollout.speculative import greedy_generate
from lsreplay.state.checkpoint import save_module


def test_generate_prints_the_greedy_text_with_speed_and_acceptance(tiny_model_dir, tmp_path, capsys):
    cfg = ModelConfig(path=str(tiny_model_dir))
    policy, tokenizer = load_model(cfg, trainable=False), load_tokenizer(cfg)
    with torch.no_grad():  # a policy checkpoint that differs from the base model
        policy.model.norm.weight.mul_(1.5)
    store = Store(str(tmp_path))
    save_module(store, "policy", policy)
    save_hf(store, "drafter", Drafter.from_target(policy))

    assert main(["generate", "What is 2 + 3?", "--model", str(tiny_model_dir), "--policy", str(tmp_path / "policy"),
                 "--drafter", str(tmp_path / "drafter"), "--max-new-tokens", "12"]) == 0
    text, figures = capsys.readouterr().out.strip().rsplit("\n", 1)
    assert "tokens_per_s=" in figures and "accept_len=" in figures

    ids = tokenizer(tokenizer.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}],
                                                  add_generation_prompt=True, tokenize=False),
                    add_special_tokens=False)["input_ids"]
    plain = greedy_generate(policy, [ids], 12, eos_token_id=eos_ids(tokenizer, policy))[0].tolist()
    assert text == tokenizer.decode(plain, skip_special_tokens=True)
