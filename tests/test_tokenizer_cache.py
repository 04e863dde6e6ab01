"""`load_tokenizer` keeps what a thread loaded: the same object for the same folder in one
thread, another in another thread (a fast tokenizer's truncation and padding are set on its
one Rust object each call), loaded again when the folder's files change, and no more than
TOKENIZERS_KEPT a thread."""

from __future__ import annotations

import json
import shutil
import threading

from lsreplay.core.config import ModelConfig
from lsreplay.models.loading import TOKENIZERS_KEPT, load_tokenizer


def in_a_thread(fn):
    out = []
    worker = threading.Thread(target=lambda: out.append(fn()))
    worker.start()
    worker.join()
    return out[0]


def test_a_thread_keeps_its_tokenizer_until_the_folder_changes(tiny_model_dir, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir, folder)
    model = ModelConfig(path=str(folder))
    first = load_tokenizer(model)
    assert load_tokenizer(model) is first
    other = in_a_thread(lambda: load_tokenizer(model))
    assert other is not first and other("1 + 2")["input_ids"] == first("1 + 2")["input_ids"]

    config = folder / "tokenizer_config.json"  # a run that saves over the folder: read again
    config.write_text(json.dumps({**json.loads(config.read_text()), "model_max_length": 77}))
    changed = load_tokenizer(model)
    assert changed is not first and changed.model_max_length == 77
    assert load_tokenizer(model) is changed


def test_a_thread_keeps_only_its_newest_tokenizers(tiny_model_dir, tmp_path):
    folders = []
    for i in range(TOKENIZERS_KEPT + 1):
        folders.append(tmp_path / f"model-{i}")
        shutil.copytree(tiny_model_dir, folders[-1])

    def loads():
        kept = [load_tokenizer(ModelConfig(path=str(f))) for f in folders]
        return ([load_tokenizer(ModelConfig(path=str(f))) is t for f, t in zip(folders[1:], kept[1:])],
                load_tokenizer(ModelConfig(path=str(folders[0]))) is kept[0])

    newest_kept, oldest_kept = in_a_thread(loads)
    assert all(newest_kept) and not oldest_kept
