"""`.ci/install-llama-cpp --print-flags`: the CMAKE_ARGS chosen per platform, with fake uname/nvcc/cpuinfo.
It never builds: a fake `python` on PATH fails loudly if the script got that far."""

import os
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / ".ci" / "install-llama-cpp"
AVX2 = "-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON"
AVX512 = AVX2 + " -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON"


def flags(tmp_path, os_name, arch, cpu_flags="", nvcc=False, cmake_args=None, gpu=True, extra=None):
    bin_ = tmp_path / "bin"
    bin_.mkdir(exist_ok=True)
    tools = {"uname": f'case "$1" in -s) echo {os_name};; -m) echo {arch};; *) echo {os_name};; esac',
             "python": 'echo "the script tried to build" >&2; exit 99'}
    if nvcc:
        tools["nvcc"] = "exit 0"
        tools["nvidia-smi"] = 'echo "GPU 0: NVIDIA H200 (UUID: GPU-0)"' if gpu else "echo 'No devices were found'; exit 6"
    for name in ("uname", "python", "nvcc", "nvidia-smi"):
        (bin_ / name).unlink(missing_ok=True)
    for name, body in tools.items():
        (bin_ / name).write_text("#!/bin/sh\n" + body + "\n")
        (bin_ / name).chmod(0o755)
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nflags\t\t: fpu sse2 {cpu_flags}\n")
    env = {"PATH": f"{bin_}:/usr/bin:/bin", "HOME": str(tmp_path), "LOCALSPEC_CPUINFO": str(cpuinfo)}
    if cmake_args is not None:
        env["CMAKE_ARGS"] = cmake_args
    env.update(extra or {})
    r = subprocess.run(["bash", str(SCRIPT), "--print-flags"], capture_output=True, env=env, timeout=30)
    assert r.returncode == 0, r.stderr
    out = r.stdout.decode().strip()
    assert f"CMAKE_ARGS={out}" in r.stderr.decode()  # the choice is printed where the user sees it
    return out


@pytest.mark.parametrize("os_name, arch, cpu, nvcc, want", [
    ("Linux", "x86_64", "avx2 avx512f", True, f"-DGGML_CUDA=ON {AVX512} -DGGML_RPC=ON"),
    ("Linux", "x86_64", "avx2", True, f"-DGGML_CUDA=ON {AVX2} -DGGML_RPC=ON"),
    ("Linux", "x86_64", "avx2 avx512f", False, f"{AVX512} -DGGML_RPC=ON"),
    ("Linux", "x86_64", "avx2", False, f"{AVX2} -DGGML_RPC=ON"),
    ("Darwin", "arm64", "", False, "-DGGML_RPC=ON"),
    ("Linux", "aarch64", "", True, "-DGGML_RPC=ON"),
])
def test_flags_per_platform(tmp_path, os_name, arch, cpu, nvcc, want):
    assert flags(tmp_path, os_name, arch, cpu, nvcc) == want


def test_nvcc_without_a_gpu_builds_for_the_cpu(tmp_path):
    """CI machines carry the CUDA toolkit but no GPU: a CUDA build there only costs time."""
    assert flags(tmp_path, "Linux", "x86_64", "avx2 avx512f", nvcc=True).startswith("-DGGML_CUDA=ON")
    assert "CUDA" not in flags(tmp_path, "Linux", "x86_64", "avx2 avx512f", nvcc=True, gpu=False)
    forced = flags(tmp_path, "Linux", "x86_64", "avx2 avx512f", nvcc=True, gpu=False, extra={"LOCALSPEC_CUDA": "1"})
    assert forced.startswith("-DGGML_CUDA=ON")
    assert "CUDA" not in flags(tmp_path, "Linux", "x86_64", "avx2 avx512f", nvcc=True, extra={"LOCALSPEC_CUDA": "0"})


def test_user_cmake_args_win(tmp_path):
    assert flags(tmp_path, "Linux", "x86_64", "avx2", True, cmake_args="-DGGML_VULKAN=ON") == "-DGGML_VULKAN=ON"
