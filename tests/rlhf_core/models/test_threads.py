"""The CPU thread rule: by the size of a model's largest matmul, not by its parameter count."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch

from rlhf_core.models.threads import (SMALL_MATMUL, largest_matrix, module_largest_matrix, serial_background_thread,
                                      small_matmuls)
from rlhf_core.training.rank_update import concurrent_roles, cpu_threads


def test_a_few_layers_of_a_real_shape_are_not_small_though_they_have_few_parameters():
    four_layers_of_half_b = [(896, 4864)] * 8 + [(4864, 896)] * 4 + [(896,)] * 8
    assert largest_matrix(four_layers_of_half_b) == 896 * 4864 and not small_matmuls(896 * 4864)
    assert small_matmuls(largest_matrix([(64, 176), (512, 64), (64,)]))  # the demo's tiny model
    assert largest_matrix([(5,)]) == 0 and small_matmuls(SMALL_MATMUL - 1) and not small_matmuls(SMALL_MATMUL)


def test_module_largest_matrix_reads_every_parameter():
    model = torch.nn.Sequential(torch.nn.Linear(30, 40), torch.nn.Linear(40, 7))
    assert module_largest_matrix(model) == 1200


def test_the_update_runs_a_small_model_on_one_thread_and_a_large_one_on_the_cores():
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(os.cpu_count() or 1)
        with cpu_threads("cpu", 64 * 176, world_size=1) as small:
            assert small == 1 == torch.get_num_threads()
        with cpu_threads("cpu", 896 * 4864, world_size=1) as large:
            assert large == torch.get_num_threads() == (os.cpu_count() or 1)
        assert torch.get_num_threads() == (os.cpu_count() or 1)  # restored
    finally:
        torch.set_num_threads(before)
    # side by side only where each role has one thread and a second core exists
    assert concurrent_roles("auto", "cpu", 1, 1) == ((os.cpu_count() or 1) >= 2)
    assert not concurrent_roles("auto", "cpu", 2, 1) and not concurrent_roles("always", "cpu", 1, 2)


def _os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _copy_in_a_background_thread(serial: bool) -> tuple[int, int, int]:
    """(OS threads the process gained while the thread lives, its torch thread count, the main
    thread's afterwards) when a background thread copies a large tensor, with or without the limit."""
    source, target = torch.randn(1 << 22), torch.empty(1 << 22)
    target.copy_(source)  # the main thread's OpenMP team exists before the count
    before, seen, copied, finish = _os_threads(), {}, threading.Event(), threading.Event()

    def copy() -> None:
        if serial:
            seen["took"] = serial_background_thread()
        torch.empty(1 << 22).copy_(source)  # a parallel op: a team of its own unless limited
        seen["threads"] = torch.get_num_threads()
        copied.set()
        finish.wait()

    thread = threading.Thread(target=copy, daemon=True)
    thread.start()
    copied.wait(60)
    gained = _os_threads() - before
    finish.set()
    thread.join()
    return gained, seen["threads"], torch.get_num_threads()


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads in Linux's /proc")
def test_a_serial_background_thread_starts_no_second_openmp_team_and_leaves_the_main_thread_alone():
    # A second team means more OpenMP threads than cores on a busy machine: libgomp stops spinning
    # and the main thread's parallel regions sleep and wake (threads.py's docstring has the cost).
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        unlimited = _copy_in_a_background_thread(serial=False)
        limited = _copy_in_a_background_thread(serial=True)
    finally:
        torch.set_num_threads(before)
    assert unlimited == (2, 2, 2), "the control: an unlimited thread's copy runs on a team of two"
    assert limited == (1, 1, 2), "the limited thread runs alone; the main thread keeps its two"
