"""What the vLLM tests share: the engine's interpreter, a tiny model vLLM's CPU kernels run
(head size 32: they take 32 and up), and one tiny run that trains a policy and a drafter.

A plain module, not a conftest: the vLLM test modules import from it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

from lsreplay.core.config import ModelConfig
from lsreplay.models.loading import resolve_model_dir

REPO = Path(__file__).resolve().parents[1]
VLLM_PYTHON = str(REPO / ".venv-vllm/bin/python")
ALPHABET = slice(1000, 1064)  # the token ids the tiny model writes


def _check_vllm() -> None:
    if not Path(VLLM_PYTHON).is_file():
        pytest.fail(f"{VLLM_PYTHON} is missing: `make test` (or `make setup`) installs vLLM's environment", False)


needs_vllm = pytest.mark.usefixtures("vllm_installed")


@pytest.fixture(scope="session")
def vllm_installed():
    _check_vllm()


@pytest.fixture(scope="session")
def vllm_model_dir(tmp_path_factory) -> Path:
    """A tiny random Llama (2 layers, hidden 64, 2 heads of 32) with the SmolLM2 tokenizer,
    saved as an HF folder. Its LM head favours 64 tokens and EOS (rows of norm ~8, the rest
    ~0.1), over large input embeddings and quiet layers: it writes varied text from a small
    alphabet, mostly as a function of the last token, so a drafter trained on a few of its
    rollouts predicts it on other prompts too."""
    return _writer_model_dir("llama", tmp_path_factory.mktemp("vllm-tiny"))


@pytest.fixture(scope="session")
def vllm_qwen2_model_dir(tmp_path_factory) -> Path:
    """vllm_model_dir's recipe on a Qwen2 (its query/key/value biases): the LoRA run takes it."""
    return _writer_model_dir("qwen2", tmp_path_factory.mktemp("vllm-qwen2"))


def _writer_model_dir(model_type: str, out: Path) -> Path:
    tokenizer, model = _tiny(model_type, tied=False)
    with torch.no_grad():
        model.get_input_embeddings().weight.normal_(std=1.0)
        head = model.get_output_embeddings().weight
        head.normal_(std=0.01)
        head[ALPHABET].normal_(std=1.0)
        head[tokenizer.eos_token_id].normal_(std=1.0)
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(0.1)
            layer.mlp.down_proj.weight.mul_(0.1)
            for projection in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                if projection.bias is not None:  # Qwen2's, which start at 0: the engine must take them too
                    projection.bias.normal_(std=0.1)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


ENDERS = slice(1040, 1044)  # 4 of the alphabet's tokens after which vllm_ending_model_dir's model often ends


@pytest.fixture(scope="session")
def vllm_ending_model_dir(vllm_model_dir, tmp_path_factory) -> Path:
    """vllm_model_dir's model, whose replies end: its LM head's EOS row points along the input
    embeddings of ENDERS, so that after them it often writes EOS (at temperature 0.7, top-k 40,
    top-p 0.95, 18 of 32 replies to held-out prompts ended within 24 tokens, after 9 to 24). For
    episodes: a reply that ended gets the environment's answer and a next turn."""
    out = tmp_path_factory.mktemp("vllm-ending")
    tokenizer = AutoTokenizer.from_pretrained(vllm_model_dir, local_files_only=True)
    model = LlamaForCausalLM.from_pretrained(vllm_model_dir, local_files_only=True)
    with torch.no_grad():
        enders = model.get_input_embeddings().weight[ENDERS]
        enders = enders / enders.norm(dim=1, keepdim=True)
        model.get_output_embeddings().weight[tokenizer.eos_token_id] = 2 * enders.sum(0)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def held_out_prompts(model_dir: Path, count: int, offset: int = 0) -> list[list[int]]:
    """Chat-templated arithmetic questions no run of these tests trains on, as token ids."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    prompts = []
    for i in range(offset, offset + count):
        text = tokenizer.apply_chat_template([{"role": "user", "content": f"What is {i % 7 + 2} times {i * 3 + 1}?"}],
                                             add_generation_prompt=True, tokenize=False)
        prompts.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return prompts


def tiny_vllm_run(run_dir: Path, model_dir: Path, *more: str) -> list[str]:
    """Overrides for a tiny run of the vLLM-sized model."""
    return [f"run_dir={run_dir}", f"model.path={model_dir}", "data.size=16", "data.prompts_per_step=4",
            "rollout.branching=[4,2]", "rollout.segment_tokens=[4]", "rollout.max_new_tokens=24",
            "data.max_prompt_tokens=128", "optim.lr=1e-3", "reward.function=varied_rewards:code_parity",
            "rollout.vllm.kv_cache_gb=0.25", *more]


@pytest.fixture(scope="session")
def vllm_trained_drafter(prefect_server, vllm_model_dir, tmp_path_factory) -> tuple[Path, Path]:
    """One real one-step run (HF engine) whose drafter trains 40 steps after the update:
    (the policy's hf/ folder after the step, the drafter's export)."""
    from flowrun import unique_pool

    from flows.train import train

    run_dir = tmp_path_factory.mktemp("vllm-drafter-run") / "run"
    train(overrides=tiny_vllm_run(run_dir, vllm_model_dir, "steps=1", "drafter.steps=40", "drafter.batch_size=4",
                                  "drafter.lr=1e-2", unique_pool()))
    return run_dir / "checkpoints/policy/step_0000/hf", run_dir / "checkpoints/drafter/step_0000/hf"


STOP = 1057  # a token the tied model often writes first: a stop of its generation config, not its EOS


@pytest.fixture(scope="session")
def vllm_tied_model_dir(tmp_path_factory) -> Path:
    """A tiny random Qwen3 whose LM head is its input embedding (tied), with the SmolLM2
    tokenizer, saved as an HF folder whose generation config stops at EOS and at STOP. The
    64 alphabet rows and EOS are large (std 0.6), the rest ~0.01; a final norm of weight -1
    keeps it from repeating its last token (tied, the head scores that token's own row
    highest), so it writes varied text from the alphabet."""
    out = tmp_path_factory.mktemp("vllm-tied")
    tokenizer, model = _tiny("qwen3", tied=True)
    with torch.no_grad():
        embedding = model.get_input_embeddings().weight
        embedding.normal_(std=0.01)
        embedding[ALPHABET].normal_(std=0.6)
        embedding[tokenizer.eos_token_id].normal_(std=0.6)
        model.model.norm.weight.fill_(-1.0)
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(0.1)
            layer.mlp.down_proj.weight.mul_(0.1)
            # Qwen3's query/key norms away from their initial ones: the engine must take them too.
            layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
            layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, STOP]
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def short_prompts(model_dir: Path, count: int) -> list[list[int]]:
    """Plain questions of 12-13 tokens, as token ids: shorter than one of vLLM's 32-token
    cache blocks on CPU, so any block its prefix cache serves holds generated tokens."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    return [tokenizer(f"Question {i}: what is {i} times {2 * i + 3}?")["input_ids"] for i in range(count)]


def _tiny(model_type: str, tied: bool):
    """The SmolLM2 tokenizer and a random 2-layer model of the family (hidden 64, two heads of
    32) over its vocabulary (seed 0)."""
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(ModelConfig()), local_files_only=True)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(
        model_type, vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, tie_word_embeddings=tied,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id, max_position_embeddings=512))
    return tokenizer, model
