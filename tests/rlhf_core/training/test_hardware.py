"""This machine's CPU, its matmul rates and whether bf16 pays on it (``training.hardware``), measured
for real here; the choice between them with pretended rates is in test_ds_config."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from rlhf_core.training import hardware


def test_the_measured_rate_is_this_machines_and_measured_once():
    hardware.device_rate.cache_clear()
    rate = hardware.device_rate("cpu", "fp32")
    assert 1e9 < rate < 1e14  # a CPU: between one slow core and a large server
    assert hardware.device_rate("cpu", "fp32") is rate  # cached for the process
    threads = torch.get_num_threads()
    hardware.device_rate.cache_clear()
    hardware.device_rate("cpu", "fp32")
    assert torch.get_num_threads() == threads  # the measurement's one thread is given back


def test_measuring_the_device_leaves_the_training_rng_alone():
    """The rate is measured once per process and cached; had it drawn from the global RNG, an update
    after a skipped rollout (a new process) would save a different RNG state than the uninterrupted run."""
    hardware.device_rate.cache_clear()
    before = torch.get_rng_state()
    assert hardware.device_rate("cpu", "fp32") > 0
    assert torch.equal(torch.get_rng_state(), before)


def test_cpu_description_reads_the_model_and_flags_of_this_machine():
    model, flags = hardware.cpu_description()
    if Path("/proc/cpuinfo").is_file():
        assert model != "unknown" and flags and all(" " not in f for f in flags)


def test_this_cpus_bf16_judgment_is_measured_where_it_has_bf16_units_and_handed_to_child_processes(monkeypatch):
    monkeypatch.setenv(hardware.CPU_BF16_ENV, "")
    monkeypatch.delenv(hardware.CPU_BF16_ENV)
    hardware._rates_judged.cache_clear()
    pays = hardware.cpu_bf16_pays()
    assert os.environ[hardware.CPU_BF16_ENV] == ("1" if pays else "0")
    if hardware.cpu_native_bf16():
        bf16, fp32 = hardware.device_rate("cpu", "bf16"), hardware.device_rate("cpu", "fp32")
        assert pays == (bf16 >= hardware.BF16_PAYS_AT * fp32) and "measured" in hardware.bf16_judgment()
    else:
        assert not pays and hardware.bf16_judgment() == "no bf16 matrix instructions"
