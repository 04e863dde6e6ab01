"""Edges of offline DPO's tokenization: a preference row gives the tokens TRL's DPOTrainer
gives it, checked against TRL's own `DPOTrainer._prepare_dataset` (TRL 1.16, the dev
extra) on the real SmolLM2 tokenizer, at the rows where tokenizing an answer alone differs:
an answer whose first token merges with the prompt's last ("is" + "n't"), an answer that
already ends with the EOS text (TRL appends EOS only where it is missing), and a chat
template that renders the prompt alone otherwise than followed by an answer (a generation
prompt that opens an empty think block: the answer starts where the two renderings part)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from transformers import AutoTokenizer

from lsreplay.core.config import ModelConfig
from lsreplay.data.preferences import Preference, preference_record
from lsreplay.data.sources import DatasetError
from lsreplay.models.loading import resolve_model_dir
from trl_rendering import save_llama_style_tokenizer

trl = pytest.importorskip("trl")

USER = [{"role": "user", "content": "Is 7 prime?"}]
ROWS = [
    {"prompt": "The answer is", "chosen": "n't obvious.", "rejected": " 42"},
    {"prompt": "2+2=", "chosen": "4<|im_end|>", "rejected": "5"},
    {"prompt": USER, "chosen": [{"role": "assistant", "content": "Yes."}],
     "rejected": [{"role": "assistant", "content": "No."}]},
]


def trl_tokens(tokenizer, rows: list[dict], chat_template_kwargs: dict | None = None) -> list[dict]:
    """TRL's DPOTrainer._prepare_dataset over `rows`, with the attributes of a trainer it reads."""
    from datasets import Dataset
    from trl import DPOTrainer

    if chat_template_kwargs:
        rows = [{**row, "chat_template_kwargs": chat_template_kwargs} for row in rows]
    trainer = SimpleNamespace(_tokenizer=tokenizer)
    args = SimpleNamespace(dataset_num_proc=None, max_length=None, truncation_mode="keep_start")
    return list(DPOTrainer._prepare_dataset(trainer, Dataset.from_list(rows), tokenizer, args, "train"))


def ours(tokenizer, row: dict, chat_template_kwargs: dict | None = None) -> dict:
    record = preference_record(tokenizer, Preference(0, row["prompt"], row["chosen"], row["rejected"]), 256, 256,
                               chat_template_kwargs)
    return {"prompt_ids": record["prompt_ids"], "chosen_ids": record["completions"][0],
            "rejected_ids": record["completions"][1]}


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(resolve_model_dir(ModelConfig()), local_files_only=True)


@pytest.mark.parametrize("row", range(len(ROWS)))
def test_a_preference_row_gives_trls_tokens(tokenizer, row):
    text = isinstance(ROWS[row]["prompt"], str)
    expected = trl_tokens(tokenizer, [r for r in ROWS if isinstance(r["prompt"], str) == text])
    got = ours(tokenizer, ROWS[row])
    want = expected[[r for r in ROWS if isinstance(r["prompt"], str) == text].index(ROWS[row])]
    assert got == {k: want[k] for k in got}


def test_an_answer_that_ends_with_eos_gets_no_second_one(tokenizer):
    got = ours(tokenizer, ROWS[1])
    assert got["chosen_ids"][-1] == tokenizer.eos_token_id and got["chosen_ids"][-2] != tokenizer.eos_token_id
    assert got["rejected_ids"][-1] == tokenizer.eos_token_id


def test_a_row_whose_answers_swallow_the_whole_prompt_is_refused_with_the_fix(tokenizer):
    """"Hello" + "world" tokenizes as "H", "ell", "oworld": TRL would train on an empty prompt;
    a tree needs a prompt token to answer after."""
    with pytest.raises(DatasetError, match="merge with all of its prompt.*end the prompt on a token boundary"):
        ours(tokenizer, {"prompt": "Hello", "chosen": "world", "rejected": " there"})


def test_a_template_that_renders_the_prompt_alone_otherwise_starts_the_answer_where_they_part(tmp_path):
    """With enable_thinking=false the generation prompt ends in an empty think block that the
    whole conversation does not hold: TRL cuts the prompt there, and so do we (it refused)."""
    source = resolve_model_dir(ModelConfig())
    tokenizer = save_llama_style_tokenizer(source, tmp_path / "tokenizer")
    kwargs = {"enable_thinking": False}
    row = ROWS[2]
    want = trl_tokens(tokenizer, [row], kwargs)[0]
    got = ours(tokenizer, row, kwargs)
    assert got == {k: want[k] for k in got}
    assert "<think>" not in tokenizer.decode(got["prompt_ids"])
    assert tokenizer.decode(got["chosen_ids"]) == "Yes.<|im_end|>\n"
