"""`make setup` picks the torch build for the machine: the CUDA build where nvidia-smi lists
a GPU, the CPU wheel elsewhere, both within pyproject.toml's torch range; a venv set up
for the other kind is set up again. Checked with `make -n` (prints, runs nothing) on a
copy of the Makefile, with a stand-in nvidia-smi first on PATH."""

import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
MAKE = shutil.which("make")
GPU_LISTED = 'echo "GPU 0: NVIDIA H200 (UUID: GPU-5d1c1a2e-0000-0000-0000-000000000000)"'
DRIVER_WITHOUT_GPU = 'echo "No devices were found"; exit 6'  # what nvidia-smi -L says then

pytestmark = pytest.mark.skipif(MAKE is None, reason="needs GNU make")


def dry_run(tmp_path: Path, nvidia_smi: str | None) -> str:
    """`make -n setup` in a copy of the project's set-up files; nvidia_smi: the stand-in's
    shell body, or None for a PATH without nvidia-smi."""
    for name in ("Makefile", "pyproject.toml", "constraints.txt", "constraints-vllm.txt"):
        if not (tmp_path / name).exists():
            shutil.copy(ROOT / name, tmp_path / name)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    stand_in = bin_dir / "nvidia-smi"
    stand_in.unlink(missing_ok=True)
    if nvidia_smi is not None:
        stand_in.write_text(f"#!/bin/sh\n{nvidia_smi}\n")
        stand_in.chmod(0o755)
    proc = subprocess.run([MAKE, "-n", "setup"], cwd=tmp_path, env={"PATH": str(bin_dir)},
                          capture_output=True, text=True, timeout=60, check=True)
    return proc.stdout


def torch_installed(make_output: str) -> str:
    """The torch pin the training venv gets (the vLLM venv, .venv-vllm, takes its engine's)."""
    (pin,) = re.findall(r"^\.venv/bin/python -m pip install .*?(torch==\S+)", make_output, re.M)
    return pin


@pytest.mark.parametrize("nvidia_smi, pin", [(GPU_LISTED, "torch==2.14.1"),
                                             (DRIVER_WITHOUT_GPU, "torch==2.13.0"),
                                             (None, "torch==2.13.0")])
def test_setup_installs_the_torch_build_for_the_machine(tmp_path, nvidia_smi, pin):
    assert torch_installed(dry_run(tmp_path, nvidia_smi)) == pin


def test_both_torch_pins_are_within_pyprojects_range(tmp_path):
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (torch_range,) = [Requirement(d).specifier for d in dependencies if Requirement(d).name == "torch"]
    for nvidia_smi in (GPU_LISTED, None):
        version = torch_installed(dry_run(tmp_path, nvidia_smi)).split("==")[1]
        assert version in torch_range, (version, str(torch_range))


def test_a_venv_set_up_for_the_other_kind_is_set_up_again(tmp_path):
    dry_run(tmp_path, None)  # the files in place
    for venv in (".venv", ".venv-vllm"):
        (tmp_path / venv).mkdir()
        (tmp_path / venv / ".installed-cpu").touch()  # newer than the Makefile's inputs
    on_cpu = dry_run(tmp_path, None)
    assert "pip install" not in on_cpu and "rm -rf .venv" not in on_cpu  # up to date: nothing redone
    on_gpu = dry_run(tmp_path, GPU_LISTED)
    assert "rm -rf .venv\n" in on_gpu and torch_installed(on_gpu) == "torch==2.14.1"
    assert on_gpu.index("rm -rf .venv\n") < on_gpu.index("python3 -m venv .venv\n")
