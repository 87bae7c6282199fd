"""An offline install for a GPU host with no network: the packages the project needs beyond what the
host already has, as one archive to carry there with the checkout.

    make wheelhouse                                    # here, where pip reaches a package index
    python benchmarks/gpu/wheelhouse.py --dry-run      # what would be carried, and why not the rest
    python benchmarks/gpu/wheelhouse.py --host-packages host.txt --python 3.11

On the GPU host, from the checkout's root, with ``.wheelhouse/`` beside it:

    source .wheelhouse/env.sh && python3 -m rlhf_cli.main run -c configs/demo.yaml

What is carried: every package pinned in this checkout's ``.venv`` (``pip freeze``) that the host does
not list (``--host-packages``: the host's own ``python3 -m pip freeze``, one ``name==version`` or name
a line; the default, ``gpu_host_packages.txt``, is the lent H200's), downloaded as wheels for the
host's Python and platform (manylinux x86_64), DeepSpeed built here into a wheel without its CUDA ops
(its index has no wheel; ``DS_BUILD_OPS=0``, as on CPU). Never carried: the host's CUDA stack (torch,
triton, nvidia-*) and what only a server or a cluster needs (MLflow's web UI, Docker and Kubernetes
clients). Carried even where the host has them: small pure-Python packages that Prefect and MLflow pin
tightly (``ALWAYS``). The packages go into ``.wheelhouse/site.tar.xz``; ``.wheelhouse/env.sh`` unpacks
it into /tmp, puts it and the checkout on PYTHONPATH and sets the offline switches the Makefile sets.
``benchmarks/gpu/device_check.sh`` and ``bench_h200.sh`` source it. ``python3 -m rlhf_cli.main``
stands in for the ``rlhf`` script there (nothing is installed on the host).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HOST_PACKAGES = Path(__file__).with_name("gpu_host_packages.txt")
NEVER = {"torch", "triton", "torchvision", "torchaudio", "mlflow", "flask", "flask-cors", "gunicorn", "graphene",
         "graphql-core", "graphql-relay", "huey", "skops", "prettytable", "blinker", "itsdangerous",
         "prefect-docker", "prefect-kubernetes", "kopf", "kubernetes-asyncio", "docker", "python-on-whales", "kernels"}
"""The host's CUDA stack, and what a server, a UI or a cluster needs (mlflow-skinny is the client)."""
ALWAYS = {"anyio", "httpx", "httpcore", "h11", "rich", "typer", "click", "jinja2", "packaging", "typing-extensions",
          "attrs", "cloudpickle", "fsspec", "python-dateutil", "pygments", "markdown-it-py", "mdurl", "shellingham",
          "pathspec", "certifi", "idna", "urllib3", "requests", "protobuf", "zipp", "six", "annotated-doc"}
"""Pure-Python packages Prefect and MLflow pin tightly: the host's own versions may not do."""
BUILT_HERE = {"deepspeed"}
"""No wheel on the index: built from its source distribution, without CUDA ops."""
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in (17, 24, 27, 28, 31, 34, 35)] + ["manylinux2014_x86_64",
                                                                                   "manylinux1_x86_64", "any"]
ENV_SH = """# source .wheelhouse/env.sh  (on the GPU host, from the checkout's root)
python3 -c "import tarfile; tarfile.open('.wheelhouse/site.tar.xz').extractall('/tmp/rlhf-wheelhouse')"
export PYTHONPATH=/tmp/rlhf-wheelhouse/site:$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false DO_NOT_TRACK=1 MLFLOW_DISABLE_TELEMETRY=true
export PREFECT_SERVER_ANALYTICS_ENABLED=false PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS=120
export PREFECT_HOME=/tmp/rlhf-prefect RLHF_HOME=/tmp/rlhf-home DS_BUILD_OPS=0
"""


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name.strip().lower())


def read_host_packages(path: Path) -> set[str]:
    """Package names in ``path`` (``pip freeze`` lines, bare names; ``#`` comments)."""
    names = set()
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            names.add(norm(re.split(r"[=<>@ ;\[]", line, maxsplit=1)[0]))
    return names


def frozen(python: Path) -> list[str]:
    """``name==version`` of every package in the environment of ``python`` (editable ones left out)."""
    out = subprocess.run([str(python), "-m", "pip", "freeze", "--exclude-editable"], capture_output=True, text=True,
                         check=True).stdout
    return [line for line in out.splitlines() if "==" in line]


def to_carry(pins: list[str], host: set[str]) -> tuple[list[str], dict[str, str]]:
    """(the pins to carry, {name: why each other one stays behind})."""
    carry, left = [], {}
    for pin in pins:
        name = norm(pin.split("==")[0])
        if name in NEVER or name.startswith("nvidia-"):
            left[name] = "the host's CUDA stack, or a server's / a cluster's"
        elif name in host and name not in ALWAYS:
            left[name] = "the host has it"
        else:
            carry.append(pin)
    return carry, left


def build(carry: list[str], python_version: str, out: Path) -> Path:
    """Download (or build) every carried package for the host, install them into one site directory
    and pack it as ``out/site.tar.xz``; write ``out/env.sh``. Returns the archive."""
    target = ["--python-version", python_version, "--implementation", "cp", "--only-binary=:all:"]
    for platform in PLATFORMS:
        target += ["--platform", platform]
    with tempfile.TemporaryDirectory(prefix="rlhf-wheelhouse.") as tmp:
        work = Path(tmp)
        wheels = work / "wheels"
        binary = [p for p in carry if norm(p.split("==")[0]) not in BUILT_HERE]
        source = [p for p in carry if norm(p.split("==")[0]) in BUILT_HERE]
        pip = [sys.executable, "-m", "pip"]
        print(f"wheelhouse: downloading {len(binary)} wheels for CPython {python_version} on manylinux x86_64", flush=True)
        subprocess.run([*pip, "download", "-qq", "--no-deps", *target, "-d", str(wheels), *binary], check=True)
        if source:
            print(f"wheelhouse: building {', '.join(source)} (no CUDA ops)", flush=True)
            subprocess.run([*pip, "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(wheels), *source],
                           check=True, env={**os.environ, "DS_BUILD_OPS": "0"})
        site = work / "site"
        subprocess.run([*pip, "install", "-q", "--no-deps", "--no-compile", *target, "--target", str(site),
                        *map(str, sorted(wheels.glob("*.whl")))], check=True)
        for cache in list(site.rglob("__pycache__")):
            shutil.rmtree(cache, ignore_errors=True)
        out.mkdir(parents=True, exist_ok=True)
        archive = out / "site.tar.xz"
        with tarfile.open(archive, "w:xz") as tar:
            tar.add(site, arcname="site")
    (out / "env.sh").write_text(ENV_SH)
    return archive


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host-packages", type=Path, default=HOST_PACKAGES,
                        help="the GPU host's `python3 -m pip freeze` (default: the lent H200's, %(default)s)")
    parser.add_argument("--python", default="3.12", help="the host's Python version (default %(default)s)")
    parser.add_argument("--venv-python", type=Path, default=ROOT / ".venv" / "bin" / "python",
                        help="the environment whose packages the project runs with (default: .venv's)")
    parser.add_argument("--out", type=Path, default=ROOT / ".wheelhouse")
    parser.add_argument("--dry-run", action="store_true", help="print what would be carried and exit")
    args = parser.parse_args(argv)
    if not re.fullmatch(r"3\.\d+", args.python):
        parser.error(f"--python {args.python!r}: give the host's Python as 3.N (e.g. 3.12)")
    if not args.host_packages.is_file():
        parser.error(f"--host-packages {args.host_packages}: no such file; on the host: python3 -m pip freeze > host.txt")
    if not args.venv_python.is_file():
        parser.error(f"--venv-python {args.venv_python}: no such file; run `make install` first (the project's "
                     "packages are read from it)")
    if args.out.exists() and not args.out.is_dir():  # found only after minutes of downloads otherwise
        parser.error(f"--out {args.out} is a file; give a directory for the archive and env.sh")
    carry, left = to_carry(frozen(args.venv_python), read_host_packages(args.host_packages))
    print(f"wheelhouse: {len(carry)} packages to carry, {len(left)} left to the host")
    if args.dry_run:
        print("\n".join(f"  carry {pin}" for pin in carry))
        print("\n".join(f"  leave {name}: {why}" for name, why in sorted(left.items())))
        return 0
    archive = build(carry, args.python, args.out)
    size = archive.stat().st_size / 2**20
    print(f"wheelhouse: {archive} ({size:.0f} MiB) and {args.out / 'env.sh'}; carry {args.out.name}/ with the "
          "checkout and `source .wheelhouse/env.sh` on the host")
    return 0


if __name__ == "__main__":
    sys.exit(main())
