"""Config loading: defaults, overrides, and errors that name the key and what is allowed."""

import sys
from pathlib import Path

import pytest

from lsreplay.core.config import (ANSWER_INSTRUCTION, ENGINES, SYSTEM_PROMPT, ConfigError, completion_tokens,
                                  from_dict, load_config, result_hash, to_dict, to_yaml)


@pytest.mark.parametrize("override, message", [
    ("model.pth=x", "unknown config key 'model.pth'; allowed keys under 'model': path, dtype"),
    ("foo=1", "unknown config key 'foo'; allowed keys at the top level: run_dir"),
    ("steps=abc", "config key 'steps'"),
    ("model.dtype=int8", "one of float32, float64, bfloat16"),
    ("rollout.segment_tokens=[1,2]", "exactly len(rollout.branching) - 1 = 1 values"),
    ("algo.loss_agg=mean", "token-mean or seq-mean or seq-mean-token-sum-norm"),
    ("algo.tree_baseline=siblings", "independent or group"),
    ("rollout.branching=[1,8]", "independent needs rollout.branching[0] >= 2"),
    ("optim.lr=inf", "a finite number > 0"),
    ("replay.kv_offload=disk", "store or host"),
    ("pool.devices_per_step=3", "between 1 and pool.slots = 1"),
    ("steps", "is not key=value"),
    # Settings that would train for hours and change nothing are errors.
    ("rollout.branching=[1]", "at least 2 rollouts per prompt"),
    ("rollout.temperature=0", "GRPO's advantages are all 0 and nothing trains"),
    ("rollout.top_k=1", "top_k = 1 is greedy"),
    ("optim.beta2=1", "in [0, 1)"),
    ("optim.grad_clip=-1", "must be >= 0 (0 = no clipping)"),
    ("algo.clip_eps=0", "must be > 0"),
    ("reward.function=my_rewards", "module:function"),
    ("eval.samples=-1", "eval.samples"),
    ("replay.context_parallel=0", "an integer >= 1 (1 = no prompt split over ranks)"),
    ("replay.context_parallel=2", "a divisor of pool.devices_per_step = 1"),
    ("replay.context_parallel_tokens=-1", "replay.context_parallel_tokens"),
    ("rollout.vllm.tensor_parallel_size=2", "1 with rollout.engine=hf"),
    ("rollout.vllm.decode_context_parallel_size=2", "dividing rollout.vllm.tensor_parallel_size = 1"),
    ("pool.interconnect_gbps=-1", "pool.interconnect_gbps"),
])
def test_bad_values_name_the_key(override, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert message in str(e.value)


@pytest.mark.parametrize("overrides, message", [
    (["algo.name=reinforce"], "'algo.name' = 'reinforce' is not allowed: one of grpo, ppo, dpo"),
    (["pool.slots=2", "pool.devices_per_step=2", "replay.context_parallel=2", "replay.mode=naive"],
     "1 with replay.mode=naive"),
    (["rollout.engine=vllm", "rollout.vllm.tensor_parallel_size=2", "pool.slots=2",
      "rollout.vllm.decode_context_parallel_size=2"], "1 with pool.accelerator=cpu (vLLM's CPU attention has no"),
    (["rollout.engine=vllm", "rollout.vllm.tensor_parallel_size=3", "pool.slots=2"],
     "at most the rollouts' devices (2: pool.rollout_devices, or pool.slots)"),
    (["algo.name=ppo", "algo.advantage=gae"], "gae needs a critic to estimate values: set algo.critic=true"),
    (["algo.critic=true"], "false with algo.name=grpo: the critic trains with PPO"),
    (["algo.epochs=2"], "ppo for several updates per batch"),
    (["algo.name=ppo", "algo.minibatches=5"], "between 1 and data.prompts_per_step = 4"),
    (["algo.name=ppo", "algo.epochs=2", "pool.slots=2", "pool.devices_per_step=2"],
     "1 with several PPO updates per batch"),
    (["algo.name=dpo", "algo.kl_coef=0.1"], "DPO's loss holds the reference already"),
    (["algo.dpo_source=dataset"], "rollouts with algo.name=grpo"),
    (["algo.name=dpo", "algo.dpo_source=dataset"], "'data.path' = '' is not allowed: a preference dataset"),
    (["algo.name=dpo", "algo.dpo_source=dataset", "data.path=p.jsonl"],
     "'drafter.enabled' = True is not allowed: false with algo.dpo_source=dataset: offline DPO samples no rollouts"),
    (["algo.name=dpo", "algo.dpo_source=dataset", "data.path=p.jsonl", "drafter.enabled=false",
      "rollout.engine=vllm"], "'rollout.engine' = 'vllm' is not allowed: hf with algo.dpo_source=dataset"),
    (["algo.name=dpo", "algo.dpo_source=dataset", "data.path=p.jsonl", "drafter.enabled=false", "eval.every=1"],
     "a prompt file (question, answer, task columns) to evaluate on"),
    (["algo.overlong=penalty"], "between 1 and rollout.max_new_tokens - 1 = 47 with algo.overlong=penalty"),
    (["algo.overlong=truncate"], "none or mask or penalty"),
    (["optim.schedule=step"], "constant or linear or cosine"),
    (["algo.kl_coef=0.1", "algo.kl_estimator=k1"], "is 0 in expectation on-policy, so as a loss term it regularizes"),
    (["algo.dynamic_sampling_metric=accuracy"], "reward or training_reward or rewards/NAME"),
    (["rollout.engine=vllm", "rollout.top_k=20"], "vLLM 0.32's CPU sampler fails on a top-k cut alone"),
    (["rollout.max_environment_tokens=0"], "an integer >= 1 (the most tokens one answer of the environment"),
    (["rollout.tool_timeout_seconds=-1"], ">= 0 (seconds a call of a tool or of the environment may take; 0 = no"),
    (["data.example_messages=[{role: system, content: Be terse.}]"],
     "'data.example_messages[0]' = {'role': 'system', 'content': 'Be terse.'} is not allowed: a chat message {role: "
     "user, assistant, tool, content: its text}"),
    (["rollout.max_turns=3", "rollout.branch_at=turns"], "[] with rollout.branch_at=turns"),
    (["rollout.branch_at=turns", "rollout.segment_tokens=[]"], "at most rollout.max_turns = 1 fan-outs"),
    (["rollout.branch_at=turn"], "tokens or turns"),
    (["rollout.max_turns=0"], "an integer >= 1 (1 = single-turn answers)"),
    (["rollout.max_turns=2", "algo.overlong=penalty"], "none or mask with multi-turn episodes"),
    (["rollout.tools=[calculator]"], "'rollout.tools[0]' = 'calculator' is not allowed: an import path"),
    (["rollout.environment=Arithmetic"], "an import path of the environment class"),
    (["rollout.tool_call_format=json"], "auto or hermes or qwen3 or llama3 or mistral"),
    (["rollout.max_concurrent_episodes=-1"], "an integer >= 0 (episodes in flight at once in a shard; 0 = all)"),
])
def test_algorithm_settings_that_cannot_work_together(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert message in str(e.value)


def test_episodes_branching_per_turn_load_for_both_engines():
    for engine in ENGINES:
        r = load_config(None, ["rollout.max_turns=3", "rollout.branch_at=turns", "rollout.segment_tokens=[]",
                               "rollout.environment=m.Env", "rollout.tools=[m.f]", f"rollout.engine={engine}"]).rollout
        assert (r.max_turns, r.branch_at, r.branching, r.tools, r.environment) == (3, "turns", [4, 2], ["m.f"], "m.Env")
        # An episode at its longest: 3 replies of 48 tokens, 2 of the environment's answers of 256.
        assert completion_tokens(r) == 3 * 48 + 2 * 256


def test_a_decaying_schedule_makes_steps_part_of_the_result():
    assert result_hash(load_config(None, ["steps=2"])) == result_hash(load_config(None, ["steps=5"]))
    decaying = ["optim.schedule=cosine"]
    assert result_hash(load_config(None, [*decaying, "steps=2"])) != result_hash(load_config(None, [*decaying, "steps=5"]))


@pytest.mark.parametrize("path", sorted(Path(__file__).resolve().parents[1].glob("configs/*.yaml")), ids=lambda p: p.name)
def test_every_config_file_loads_and_writes_out_as_omegaconf_would(path):
    """A stored config's result hash must not move: to_dict (a walk of the dataclasses) gives
    what OmegaConf's structured config gave, for every shipped config, and for one built in
    code with an int where a float belongs and a tuple where a list does."""
    import dataclasses

    from omegaconf import OmegaConf

    cfg = load_config(path)
    built = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, lr=1),
                                rollout=dataclasses.replace(cfg.rollout, branching=tuple(cfg.rollout.branching)))
    for c in (cfg, built):
        assert to_dict(c, redact=False) == OmegaConf.to_container(OmegaConf.structured(c), resolve=True)
    assert to_dict(built)["optim"]["lr"] == 1.0 and isinstance(to_dict(built)["optim"]["lr"], float)


def test_defaults_file_and_overrides_merge():
    cfg = load_config("configs/default.yaml", ["steps=2", "rollout.branching=[8,2]"])
    assert cfg.steps == 2 and cfg.rollout.branching == [8, 2] and cfg.data.tasks == ["basic_arithmetic", "chain_sum"]


def test_secrets_are_redacted_and_do_not_change_the_result_hash():
    a = load_config(None, ["storage.key=AKIAXYZ", "storage.secret=s3cr3t"])
    b = load_config(None, [])
    assert "s3cr3t" not in to_yaml(a) and to_dict(a)["storage"]["secret"] == "***"
    assert result_hash(a) == result_hash(b)
    assert result_hash(load_config(None, ["optim.lr=2e-5"])) != result_hash(b)


def test_random_init_model_of_a_given_shape():
    from lsreplay.models.loading import load_model

    cfg = load_config(None, ["model.arch={model_type: qwen2, hidden_size: 32, intermediate_size: 64, "
                             "num_hidden_layers: 2, num_attention_heads: 4, num_key_value_heads: 2, vocab_size: 100}"])
    model = load_model(cfg.model)
    assert type(model).__name__ == "Qwen2ForCausalLM" and model.config.vocab_size == 100


def test_held_out_prompts_must_leave_enough_to_train_on():
    with pytest.raises(ConfigError, match="data.prompts_per_step \\+ eval.size = 68"):
        load_config(None, ["eval.every=1", "data.size=60"])
    assert load_config(None, ["eval.every=1", "data.size=68"]).eval.size == 64
    assert load_config(None, ["eval.every=0", "data.size=8"]).data.size == 8  # nothing held out


def test_a_dict_given_whole_replaces_the_default(tmp_path):
    """Merging would keep the defaults' entries; a config must be able to clear them.
    A dotted key edits one entry."""
    default = load_config(None, []).data.task_args
    assert set(default) == {"basic_arithmetic"}
    assert load_config(None, ["data.task_args={}"]).data.task_args == {}
    assert load_config(None, ["data.task_args={chain_sum: {min_terms: 3}}"]).data.task_args == {
        "chain_sum": {"min_terms": 3}}
    edited = load_config(None, ["data.task_args.basic_arithmetic.max_terms=3"]).data.task_args
    assert edited["basic_arithmetic"] == {**default["basic_arithmetic"], "max_terms": 3}
    assert load_config(None, ["data.task_args.basic_arithmetic={}"]).data.task_args == {"basic_arithmetic": {}}
    config = tmp_path / "gsm.yaml"
    config.write_text("data:\n  tasks: [gsm_symbolic]\n  task_args: {}\n")
    assert load_config(config, []).data.task_args == {}
    cfg = load_config(config, [])
    assert from_dict(to_dict(cfg)).data.task_args == {}  # through a Prefect flow's parameters


@pytest.mark.parametrize("override, message", [
    ("num_generations=8", "'num_generations' is TRL's or verl's name: lsreplay's key is rollout.branching"),
    ("max_completion_length=64", "lsreplay's key is rollout.max_new_tokens"),
    ("algo.beta=0.04", "lsreplay's key is algo.kl_coef"),
    ("epsilon=0.2", "lsreplay's key is algo.clip_eps"),
    ("loss_type=dapo", "lsreplay's key is algo.loss_agg (TRL's dapo and bnpo: token-mean"),
    ("learning_rate=1e-6", "lsreplay's key is optim.lr"),
    # GRPOConfig's keys with an equivalent, and those whose nearest lsreplay key would mislead
    ("epsilon_high=0.28", "lsreplay's key is algo.clip_eps_high"),
    ("mask_truncated_completions=true", "lsreplay's key is algo.overlong=mask"),
    ("save_total_limit=2", "lsreplay's key is checkpoint.keep_last"),
    ("save_steps=10", "lsreplay's key is checkpoint.every"),
    ("eval_steps=10", "lsreplay's key is eval.every"),
    ("lr_scheduler_type=cosine", "lsreplay's key is optim.schedule (constant, linear or cosine"),
    ("bf16=true", "lsreplay's key is model.dtype=bfloat16"),
    ("use_vllm=true", "lsreplay's key is rollout.engine=vllm"),
    ("num_iterations=2", "lsreplay's key is algo.epochs (with algo.name=ppo"),
    ("vllm_importance_sampling_correction=true", "lsreplay's key is algo.tis_cap"),
    ("per_device_train_batch_size=16", "TRL's per_device_train_batch_size counts completions: prompts_per_step = "
                                       "per_device_train_batch_size x gradient_accumulation_steps x processes / "
                                       "num_generations"),
    ("dataset_test_split=test", "lsreplay's key is eval.split"),
    # verl's nested keys, named whole and answered by their own entry
    ("actor_rollout_ref.rollout.n=8", "unknown config key 'actor_rollout_ref.rollout.n': 'rollout.n' is TRL's or "
                                      "verl's name: lsreplay's key is rollout.branching"),
    ("actor_rollout_ref.actor.clip_ratio_high=0.28", "lsreplay's key is algo.clip_eps_high"),
    ("algorithm.norm_adv_by_std_in_grpo=false", "lsreplay's key is algo.scale_rewards (true: group, false: none)"),
    ("trainer.save_freq=5", "lsreplay's key is checkpoint.every"),
    # TRL's peft_config (PEFT's LoraConfig) and ModelConfig flags, verl's lora_rank
    ("peft_config.r=8", "lsreplay's key is model.lora.rank"),
    ("peft_config.lora_alpha=16", "lsreplay's key is model.lora.alpha"),
    ("peft_config.target_modules=[q_proj]", "lsreplay's key is model.lora.target_modules"),
    ("model.lora.r=8", "lsreplay's key is model.lora.rank"),
    ("use_peft=true", "lsreplay's key is model.lora.enabled"),
    ("actor_rollout_ref.model.lora_rank=32", "lsreplay's key is model.lora.rank"),
    ("data.train_files=train.parquet", "lsreplay's key is data.path"),
    ("custom_reward_function.reward_kwargs={n: 1}", "lsreplay's key is reward.kwargs"),
    ("rollout.max_new_token=8", "did you mean rollout.max_new_tokens"),
    ("data.colums.prompt=text", "did you mean data.columns."),
    ("sed=1", "did you mean seed?"),
])
def test_near_misses_and_trl_names_point_at_the_key(override, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert message in str(e.value)


def test_every_alias_points_at_a_real_key():
    from lsreplay.core.config.aliases import ALIASES
    from lsreplay.core.config import schema_keys

    assert {a.split()[0].split("=")[0] for a in ALIASES.values()} <= set(schema_keys())


def test_every_unknown_key_of_a_file_and_its_overrides_is_named_at_once(tmp_path):
    config = tmp_path / "trl.yaml"
    config.write_text("num_generations: 8\nmodel:\n  pth: x\nactor_rollout_ref:\n  rollout: {n: 8, temperature: 1}\n")
    with pytest.raises(ConfigError) as e:
        load_config(config, ["steps=2", "beta=0.04", "sed=1"])
    lines = str(e.value).splitlines()
    assert lines[0] == "6 unknown config keys:"
    assert [line.split("'")[1] for line in lines[1:]] == [
        "num_generations", "model.pth", "actor_rollout_ref.rollout.n", "actor_rollout_ref.rollout.temperature",
        "beta", "sed"]
    assert "lsreplay's key is rollout.temperature" in lines[4] and "did you mean seed?" in lines[6]


@pytest.mark.parametrize("value, scale", [("group", "group"), ("batch", "batch"), ("none", "none"),
                                          ("true", "group"), ("false", "none"), ("True", "group")])
def test_scale_rewards_as_trl_takes_it(value, scale):
    assert load_config(None, [f"algo.scale_rewards={value}"]).algo.scale_rewards == scale


def test_scale_rewards_names_what_it_takes(tmp_path):
    with pytest.raises(ConfigError, match="'algo.scale_rewards' = 'std' is not allowed: group, batch or none"):
        load_config(None, ["algo.scale_rewards=std"])
    config = tmp_path / "dr_grpo.yaml"
    config.write_text("algo:\n  scale_rewards: false\n")
    assert load_config(config).algo.scale_rewards == "none"
    assert from_dict(to_dict(load_config(config))).algo.scale_rewards == "none"


def test_report_to_as_trl_takes_it(tmp_path, monkeypatch):
    config = tmp_path / "wandb.yaml"
    config.write_text("report_to: wandb\n")
    assert load_config(config).report_to == ["wandb"]  # a YAML string, not a list
    assert load_config(None, ["report_to=wandb,tensorboard"]).report_to == ["wandb", "tensorboard"]
    assert load_config(None, ["report_to=none"]).report_to == [] == load_config(None, ["report_to=[none]"]).report_to
    assert load_config(None, ["report_to=all"]).report_to == ["tensorboard", "mlflow", "trackio", "wandb"]
    monkeypatch.setitem(sys.modules, "trackio", None)  # as where it is not installed
    assert load_config(None, ["report_to=[all,wandb]"]).report_to == ["tensorboard", "mlflow", "wandb"]


def test_prompts_get_lsreplays_additions_only_where_lsreplay_generates_them():
    generated = load_config(None, []).data
    assert (generated.system_prompt, generated.answer_instruction, generated.chat_template) == (
        SYSTEM_PROMPT, ANSWER_INSTRUCTION, True)
    yours = load_config(None, ["data.path=train.parquet"]).data
    assert (yours.system_prompt, yours.answer_instruction, yours.chat_template) == ("", "", False)
    asked = load_config(None, ["data.path=train.parquet", "data.system_prompt=Be terse.", "data.chat_template=true"])
    assert (asked.data.system_prompt, asked.data.answer_instruction, asked.data.chat_template) == (
        "Be terse.", "", True)
    assert from_dict(to_dict(asked)).data == asked.data  # settled once: the saved config keeps it
    assert load_config(None, ["data.chat_template_kwargs={enable_thinking: false}"]).data.chat_template_kwargs == {
        "enable_thinking": False}


def test_hydra_prefixes_and_trl_spellings_of_values():
    cfg = load_config(None, ["+steps=5", "++optim.lr=2e-5", "report_to=tensorboard", "data.system_prompt="])
    assert (cfg.steps, cfg.optim.lr, cfg.report_to, cfg.data.system_prompt) == (5, 2e-5, ["tensorboard"], "")
    assert load_config(None, ["report_to=none"]).report_to == []
    assert result_hash(load_config(None, ["report_to=[mlflow]"])) == result_hash(load_config(None, []))


def test_config_command_prints_the_resolved_config_and_validates(tmp_path, capsys):
    from lsreplay import cli

    config = tmp_path / "c.yaml"
    config.write_text("storage:\n  secret: s3cr3t\nsteps: 4\n")
    assert cli.main(["config", str(config), "++rollout.max_new_tokens=64", "reward.functions=[m.f]"]) == 0
    out = capsys.readouterr()
    assert "steps: 4" in out.out and "max_new_tokens: 64" in out.out and "s3cr3t" not in out.out
    assert "secret: '***'" in out.out and "valid" in out.err
    assert cli.main(["config", "beta=0.1"]) == 2
    assert "lsreplay's key is algo.kl_coef" in capsys.readouterr().err


def test_trls_command_line_flags_are_overrides(capsys):
    from lsreplay import cli

    assert cli.flags_to_overrides(["--num_generations", "8", "--bf16", "steps=2", "--max-steps=5", "--force", "--lr",
                                   "-1"], {"--force"}) == ["num_generations=8", "bf16=true", "steps=2", "max_steps=5",
                                                           "--force", "lr=-1"]
    assert cli.main(["config", "--steps", "4", "--rollout.max_new_tokens=64"]) == 0
    assert "steps: 4" in capsys.readouterr().out
    assert cli.main(["config", "--num_generations", "8", "--use_vllm"]) == 2
    err = capsys.readouterr().err
    assert "2 unknown config keys" in err and "lsreplay's key is rollout.branching" in err and "rollout.engine=vllm" in err
    assert cli.main(["resume", "no-such-run", "--steps", "5"]) == 2  # resume's own --steps stays its option
    assert "holds no run" in capsys.readouterr().err
