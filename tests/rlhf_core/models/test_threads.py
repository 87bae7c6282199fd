"""The CPU thread rule: by the size of a model's largest matmul, not by its parameter count."""

from __future__ import annotations

import os

import torch

from rlhf_core.models.threads import SMALL_MATMUL, largest_matrix, module_largest_matrix, small_matmuls
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
