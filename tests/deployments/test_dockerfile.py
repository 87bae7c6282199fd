"""The Dockerfile and the deployments agree (no Docker here to build it): the image holds every
package the project installs and the files the flows read, none of it excluded by .dockerignore,
in the directory the deployments' pull step and the pools' working directory name."""

from __future__ import annotations

import fnmatch
import json
import re
import tomllib
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]


def _instructions() -> list[tuple[str, str]]:
    """(instruction, arguments) of each Dockerfile instruction, continuation lines joined."""
    text = re.sub(r"\\\n\s*", " ", (REPO / "Dockerfile").read_text())
    lines = [ln.strip() for ln in text.splitlines()]
    return [tuple(ln.split(None, 1)) for ln in lines if ln and not ln.startswith("#")]


def _ignored(path: str) -> bool:
    patterns = [p.strip() for p in (REPO / ".dockerignore").read_text().splitlines()
                if p.strip() and not p.startswith("#")]
    return any(fnmatch.fnmatch(path, p) or path.split("/")[0] == p for p in patterns)


def test_image_copies_every_package_and_input_and_ignores_none_of_them():
    copied = {src for op, args in _instructions() if op == "COPY" for src in args.split()[:-1]}
    packages = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    needed = {p.rstrip("*") for p in packages} | {"pyproject.toml", "README.md", "configs", "data"}
    assert needed <= copied, f"the Dockerfile does not copy {sorted(needed - copied)}"
    for src in copied:
        assert (REPO / src).exists(), f"COPY {src}: no such path"
        assert not _ignored(src), f"COPY {src}: excluded by .dockerignore"
    assert _ignored(".venv") and _ignored("runs") and _ignored(".git")


def test_stages_and_the_project_directory_match_the_deployments():
    stages = [re.search(r"AS (\w+)$", args).group(1) for op, args in _instructions() if op == "FROM"]
    assert stages == ["base", "cuda", "cpu"], "cpu must stay the last stage: a plain `docker build` builds it"
    (workdir,) = [args for op, args in _instructions() if op == "WORKDIR"]
    cluster = yaml.safe_load((REPO / "deployments" / "prefect-cluster.yaml").read_text())
    (step,) = cluster["pull"]
    assert step["prefect.deployments.steps.set_working_directory"]["directory"] == workdir
    for name in ("docker-gpu.json", "kubernetes-gpu.json"):
        template = json.loads((REPO / "deployments" / "pools" / name).read_text())
        assert template["variables"]["properties"]["working_dir"]["default"] == workdir
    cuda = next(args for op, args in _instructions() if op == "RUN" and "[vllm]" in args)
    assert "${TORCH_SPEC}" in cuda.split("'.[vllm]'")[1], "the vllm install must repeat the torch pin"
