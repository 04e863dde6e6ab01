"""Long prompts: the built-in key-value retrieval task at a set length in tokens, prompts cut
(or refused) to data.max_prompt_tokens without touching the chat template, and rotary
positions stretched past what a model was trained on (model.rope_scaling) or refused."""

import json
import logging

import pytest
import torch

from lsreplay.core.config import ConfigError, ModelConfig, load_config
from lsreplay.data.long_context import TASKS
from lsreplay.data.prompt_sets import check_prompts, prompt_file, source_prompts
from lsreplay.data.rendering import render_prompt
from lsreplay.data.rewards import Reward, score, unscorable_tasks
from lsreplay.data.sources import DatasetError, Prompt
from lsreplay.models.loading import ModelError, check_positions, hf_config, load_model, load_tokenizer

LENGTH = 1024


def _config(*overrides):
    return load_config(None, ["data.tasks=[kv_retrieval]", "data.size=4", "data.prompts_per_step=2",
                              f"data.max_prompt_tokens={LENGTH + 64}", *overrides])


def test_kv_retrieval_prompts_have_the_set_length_and_an_exact_answer():
    cfg = _config(f"data.task_args.kv_retrieval.prompt_tokens={LENGTH}")
    prompts, tokenizer = source_prompts(cfg), load_tokenizer(cfg.model)
    assert unscorable_tasks(set(TASKS)) == []
    depths = []
    for i in range(len(prompts)):
        prompt = prompts[i]
        # As the run renders it: chat template, system prompt, answer instruction.
        assert LENGTH - 16 <= len(render_prompt(tokenizer, prompt, cfg.data)) <= LENGTH
        meta = prompt.metadata
        assert prompt.task == "kv_retrieval" and meta["values"][meta["keys"].index(meta["key"])] == prompt.answer
        assert f"special magic numbers for {meta['key']} is: {prompt.answer}." in prompt.question
        assert prompt.question.endswith(f"What is the special magic number for {meta['key']} mentioned in the "
                                        "provided text?")
        assert sum(c.isdigit() for c in prompt.question) == 7 * len(meta["keys"])  # no other digits to mistake
        assert score(prompt, f"It is <answer>{prompt.answer}</answer>") == 1.0
        assert score(prompt, f"It is {int(prompt.answer) + 1}") == 0.0
        depths.append(meta["depth"])
    assert len(set(depths)) == len(depths)
    # Seeded and offline: the same request gives the same file; another length another one.
    assert prompt_file(cfg).read_text() == prompt_file(_config(f"data.task_args.kv_retrieval.prompt_tokens={LENGTH}"
                                                                 )).read_text()
    longer = source_prompts(_config("data.task_args.kv_retrieval.prompt_tokens=2048", "data.max_prompt_tokens=2048"))
    assert [p.answer for p in longer] == [prompts[i].answer for i in range(len(prompts))]
    assert all(len(p.question) > 1.5 * len(q.question) for p, q in zip(longer, prompts))
    # The length defaults to data.max_prompt_tokens, and the preflight's prompt check passes.
    check_prompts(_config(), lambda p: render_prompt(tokenizer, p, cfg.data), Reward(cfg))
    assert max(len(render_prompt(tokenizer, p, cfg.data)) for p in source_prompts(_config())) > LENGTH


def test_bad_task_arguments_name_the_fix():
    with pytest.raises(DatasetError, match=r"data.task_args.kv_retrieval: unknown \['length'\]; the task takes"):
        prompt_file(_config("data.task_args.kv_retrieval.length=100"))
    with pytest.raises(DatasetError, match="before any filler, more than its prompt_tokens=64"):
        prompt_file(_config("data.task_args.kv_retrieval.prompt_tokens=64"))


LONG = "alpha beta gamma delta " * 60 + "THE END"


@pytest.mark.parametrize("index,question", [(7, LONG), (8, [{"role": "user", "content": LONG}])],
                         ids=["string", "messages"])
def test_an_overlong_prompt_is_refused_or_cut_in_its_own_text(index, question, caplog):
    tokenizer = load_tokenizer(ModelConfig())
    prompt = Prompt(index, "exact_answer", question, "1", {})  # a cut is logged once per prompt and side
    limit = 120
    with pytest.raises(DatasetError, match=rf"prompt {index} has \d+ tokens, more than data.max_prompt_tokens=120; .*"
                                           "data.prompt_truncation=left, right or middle"):
        render_prompt(tokenizer, prompt, _config(f"data.max_prompt_tokens={limit}").data)
    short = render_prompt(tokenizer, Prompt(7, "exact_answer", "alpha", "1", {}), _config().data)
    for side in ("left", "right", "middle"):
        data = _config(f"data.max_prompt_tokens={limit}", f"data.prompt_truncation={side}").data
        with caplog.at_level(logging.WARNING, logger="lsreplay.data.rendering"):
            ids = render_prompt(tokenizer, prompt, data)
        assert limit - 4 <= len(ids) <= limit
        text = tokenizer.decode(ids)
        # The template, the system prompt and the answer instruction stay whole around the cut text.
        assert ids[:8] == short[:8] and ids[-12:] == short[-12:] and data.answer_instruction.strip() in text
        assert ("THE END" in text) == (side != "right") and ("alpha beta gamma delta alpha" in text)
        assert f"prompt {index}: " in caplog.text and f"data.prompt_truncation={side}" in caplog.text
    data = _config("data.max_prompt_tokens=40", "data.prompt_truncation=middle").data
    with pytest.raises(DatasetError, match="without its own text still more than data.max_prompt_tokens=40"):
        render_prompt(tokenizer, prompt, data)
    with pytest.raises(ConfigError, match="data.prompt_truncation"):
        _config("data.prompt_truncation=start")


def test_positions_past_the_models_are_refused_with_the_factor_that_would_do():
    cfg = _config("data.max_prompt_tokens=32768")
    needed = cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens
    with pytest.raises(ModelError, match=r"needs 32816 positions \(prompt\) but smollm2-135m-instruct reaches 8192 .*"
                                         r"model.rope_scaling=\{rope_type: yarn, factor: 5\}"):
        check_positions(cfg.model, needed, "prompt")
    scaled = _config("data.max_prompt_tokens=32768", "model.rope_scaling={rope_type: yarn, factor: 5}").model
    check_positions(scaled, needed, "prompt")
    config = hf_config(scaled)
    assert config.rope_parameters == {"rope_theta": 100000.0, "rope_type": "yarn", "factor": 5,
                                      "original_max_position_embeddings": 8192}
    assert config.max_position_embeddings == 40960
    for bad in ("{rope_type: dynamic, factor: 2}", "{rope_type: yarn}"):
        with pytest.raises(ConfigError, match="model.rope_scaling"):
            _config(f"model.rope_scaling={bad}")
    with pytest.raises(ConfigError, match="rollout.engine=vllm"):
        _config("model.rope_scaling={rope_type: yarn, factor: 2}", "rollout.engine=vllm")


def test_a_scaled_model_runs_past_its_trained_positions_and_saves_its_scaling(tmp_path):
    arch = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 64, "max_position_embeddings": 256}
    model = load_model(ModelConfig(arch=arch, rope_scaling={"rope_type": "yarn", "factor": 8}), trainable=False)
    assert model.model.rotary_emb.rope_type == "yarn" and model.config.max_position_embeddings == 2048
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([[1, 2, 3]]), position_ids=torch.tensor([[1500, 1501, 1502]])).logits
    assert torch.isfinite(logits).all()
    # A folder whose config scales already: the same scaling again is a no-op, another one refused.
    model.save_pretrained(tmp_path)
    load_tokenizer(ModelConfig()).save_pretrained(tmp_path)
    folder = ModelConfig(path=str(tmp_path))
    check_positions(folder, 2000, "prompt")
    assert hf_config(ModelConfig(path=str(tmp_path), rope_scaling={"rope_type": "yarn", "factor": 8})
                        ).max_position_embeddings == 2048
    with pytest.raises(ModelError, match="scales its rotary positions already"):
        hf_config(ModelConfig(path=str(tmp_path), rope_scaling={"rope_type": "linear", "factor": 2}))
    config = json.loads((tmp_path / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelError, match=r"its rotary embedding \(dynamic\) changes its frequencies"):
        check_positions(folder, 100, "prompt")
