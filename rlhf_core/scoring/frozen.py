"""The run's frozen models — the reference policy and the reward model — held by a process for the
whole run instead of read from disk for every pass (score, KL guard), and placed by verl's
``fsdp_config.param_offload`` of their role (``actor_rollout_ref.ref``, ``reward_model.model``):

    param_offload=false (verl's default)   the weights stay on the scoring device between passes
    param_offload=true                     they stay in host memory (pinned on CUDA), are copied
                                           onto the device for a pass and dropped from it after

Why a whole copy per pass: frozen weights never change, so the host copy stays the truth and
"offloading" after a pass is only dropping the device tensors, while a pass starts with one
host-to-device copy of the model's bytes (~0.6 s for a 7B bf16 reference at ~25 GB/s, against tens
of seconds from disk). verl's FSDP offload streams one FSDP unit at a time instead: a smaller device
peak for a copy per forward. ``training.memory`` counts the whole copy during scoring.

Why not ``scoring.cache``: its budget is 0 on CUDA (the update needs the device memory), so the
reference used to be loaded from disk for each score and guard pass — at 7B the largest fixed cost
of an iteration. Holding is what verl does: its reference worker keeps its model for the run.

Identity as in ``scoring.cache``: an entry serves while its directory's files are unchanged. One
model per role: asking for another directory (another run in the same process) drops the previous
one. On CPU the device is the host memory, so both placements keep the one copy.

One ``FrozenModels`` belongs to one run session (``scoring.held.HeldModels``): a CLI rerun of a
stage starts with none held.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch

from rlhf_core.scoring.cache import directory_identity


@dataclass
class _Held:
    key: tuple
    identity: tuple
    model: torch.nn.Module


def offloads(param_offload: bool, device: torch.device) -> bool:
    """Whether the weights go back to the host between passes: only where host and device differ."""
    return param_offload and device.type != "cpu"


class FrozenModels:
    """The reference policy and the reward model one run holds, one per role."""

    def __init__(self) -> None:
        self._held: dict[str, _Held] = {}

    @contextlib.contextmanager
    def on_device(self, role: str, path: Path, device: torch.device, param_offload: bool, options: tuple,
                  load: Callable[[torch.device], torch.nn.Module]) -> Iterator[torch.nn.Module]:
        """``role``'s model on ``device`` for the ``with`` block, held for the next pass afterwards.
        ``load(where)`` reads the directory onto ``where`` (the host when offloading) in eval mode;
        ``options`` (dtype, attention, ...) complete the key: another value loads afresh."""
        offload = offloads(param_offload, device)
        held = self._lookup(role, Path(path), device, offload, options, load)
        if not offload:
            yield held.model
            return
        host = _host_tensors(held.model)
        _point_to(_copied(host, device), held.model)
        try:
            yield held.model
        finally:
            _point_to(host, held.model)  # the host copy is the truth: the device copy is just dropped

    def held_model(self, role: str) -> Optional[torch.nn.Module]:
        """The model held for ``role``; None when there is none."""
        held = self._held.get(role)
        return None if held is None else held.model

    def is_held(self, model: torch.nn.Module) -> bool:
        """Whether ``model`` is held (then dropping a reference to it frees nothing)."""
        return any(held.model is model for held in self._held.values())

    def drop(self, role: Optional[str] = None) -> None:
        """Forget ``role``'s model (every role's with None); the caller frees the memory (``release``)."""
        if role is None:
            self._held.clear()
        else:
            self._held.pop(role, None)

    def _lookup(self, role: str, path: Path, device: torch.device, offload: bool, options: tuple,
                load: Callable[[torch.device], torch.nn.Module]) -> _Held:
        path = path.resolve()
        key = (str(path), str(device), offload, options)
        identity = directory_identity(path)
        held = self._held.get(role)
        if held is not None and held.key == key and identity is not None and held.identity == identity:
            return held
        self._held.pop(role, None)  # before loading: the old model's memory is free for the new one
        model = load(torch.device("cpu") if offload else device)
        model.requires_grad_(False)
        if offload:
            _pin(model)
        held = _Held(key, identity, model)
        if identity is not None and directory_identity(path) == identity:  # not changed while loading
            self._held[role] = held
        return held


def _slots(model: torch.nn.Module) -> Iterator[tuple[tuple[int, str, bool], torch.nn.Module, str, bool]]:
    """Every parameter and buffer slot as (key, owning module, name, is_parameter); a tied weight
    appears once per owner, with the same tensor."""
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                yield (id(module), name, True), module, name, True
        for name, b in module._buffers.items():
            if b is not None:
                yield (id(module), name, False), module, name, False


def _host_tensors(model: torch.nn.Module) -> dict[tuple, torch.Tensor]:
    """Each slot's tensor; a tied parameter's owners get the one tensor object (``.data`` makes a
    new wrapper on every access, so it is taken once per parameter)."""
    data: dict[int, torch.Tensor] = {}
    out = {}
    for key, module, name, is_param in _slots(model):
        if is_param:
            param = module._parameters[name]
            out[key] = data.setdefault(id(param), param.data)
        else:
            out[key] = module._buffers[name]
    return out


def _copied(host: dict[tuple, torch.Tensor], device: torch.device) -> dict[tuple, torch.Tensor]:
    """Each distinct host tensor copied to ``device`` once (tied weights stay one tensor)."""
    copies: dict[int, torch.Tensor] = {}
    out = {}
    for key, tensor in host.items():
        if id(tensor) not in copies:
            copies[id(tensor)] = tensor.to(device, non_blocking=True)
        out[key] = copies[id(tensor)]
    return out


def _point_to(tensors: dict[tuple, torch.Tensor], model: torch.nn.Module) -> None:
    """Make every slot hold ``tensors``' entry. Parameters are replaced, not given new ``.data``
    (which only works between tensor types torch deems compatible); a tied parameter's owners get
    the one new parameter, so the weights stay tied."""
    old = []  # kept alive until done, so no id below is reused
    replaced: dict[int, torch.nn.Parameter] = {}
    for key, module, name, is_param in list(_slots(model)):
        if not is_param:
            module._buffers[name] = tensors[key]
            continue
        param = module._parameters[name]
        old.append(param)
        if id(param) not in replaced:
            replaced[id(param)] = torch.nn.Parameter(tensors[key], requires_grad=False)
        module._parameters[name] = replaced[id(param)]


def _pin(model: torch.nn.Module) -> None:
    """Host tensors in page-locked memory, so the per-pass copy runs at full bus speed (a tied
    weight is pinned once and stays shared)."""
    if not torch.cuda.is_available():
        return
    host = _host_tensors(model)  # keeps every original alive, so no id is reused while pinning
    pinned: dict[int, torch.Tensor] = {}
    for tensor in host.values():
        if id(tensor) not in pinned:
            pinned[id(tensor)] = tensor.pin_memory()
    _point_to({key: pinned[id(t)] for key, t in host.items()}, model)
