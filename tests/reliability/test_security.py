"""Security guarantees, checked on the code itself and on the running stages:

(a) no pickle on any load path — a static scan of rlhf_core/, tasks/, flows/, deployments/ for
    unpickling loaders, unsafe YAML, eval/exec, remote code, and Prefect result persistence;
(b) a user reward function is imported only when the config names it — the whole score stage
    runs beside importable reward modules that leave a marker when imported;
(c) servers bind to 127.0.0.1 unless told otherwise — every `prefect server start` and
    `mlflow ui|server` command line in the repository (code, docs, Makefile, YAML) names a
    loopback --host, and no code holds a wildcard address;
(d) secrets never reach MLflow parameters or Prefect artifacts — ``rlhf_core.security.redact``.

Each scanner is also run on known-bad snippets, so a scanner that stopped finding anything fails.
"""

from __future__ import annotations

import ast
import json
import random
import re
import string
import subprocess
import sys
from pathlib import Path

import pytest

from rlhf_core.security import MASK, is_secret_key, redact, redact_text

REPO = Path(__file__).resolve().parents[2]
CODE_DIRS = ("rlhf_core", "tasks", "flows", "deployments")


def python_files() -> list[Path]:
    files = [p for d in CODE_DIRS for p in sorted((REPO / d).rglob("*.py")) if "__pycache__" not in p.parts]
    assert len(files) > 30, "the scan must see the project's code"
    return files


def repo_text_files() -> list[Path]:
    """Tracked and untracked (not ignored) files: code, docs, Makefile, YAML, shell, TOML."""
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, capture_output=True,
                         text=True, check=True).stdout.split("\n")
    keep = (".py", ".md", ".yaml", ".yml", ".sh", ".toml", ".cfg", ".txt", ".service", ".ini")
    return [REPO / f for f in out if f and (f.endswith(keep) or Path(f).name in ("Makefile", "Dockerfile"))
            and (REPO / f).is_file()]


# ---------------------------------------------------------------------------------------------
# (a) the unsafe-load scanner
# ---------------------------------------------------------------------------------------------

UNSAFE_MODULES = {"pickle", "cPickle", "_pickle", "cloudpickle", "dill", "joblib", "shelve", "marshal"}
UNSAFE_CALLS = {
    "pandas.read_pickle": "pandas.read_pickle unpickles",
    "mlflow.pyfunc.load_model": "MLflow pyfunc models load with cloudpickle",
    "mlflow.pytorch.load_model": "mlflow.pytorch.load_model unpickles the model",
    "mlflow.transformers.load_model": "mlflow.transformers.load_model may unpickle components",
    "yaml.unsafe_load": "yaml.unsafe_load builds arbitrary objects", "yaml.full_load": "use yaml.safe_load",
    "yaml.load_all": "use yaml.safe_load_all", "yaml.unsafe_load_all": "use yaml.safe_load_all",
    "numpy.lib.format.read_array": "check allow_pickle",
}
SAFE_YAML_LOADERS = {"SafeLoader", "CSafeLoader", "yaml.SafeLoader", "yaml.CSafeLoader"}


def _aliases(tree: ast.Module) -> dict[str, str]:
    """Local name → qualified name from the module's imports (``import numpy as np`` → np: numpy)."""
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                names[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:
                names[a.asname or a.name] = f"{node.module}.{a.name}"
    return names


def _qualified(func: ast.expr, aliases: dict[str, str]) -> str:
    parts = []
    while isinstance(func, ast.Attribute):
        parts.append(func.attr)
        func = func.value
    if not isinstance(func, ast.Name):
        return ""
    parts.append(aliases.get(func.id, func.id))
    return ".".join(reversed(parts))


def _keyword(call: ast.Call, name: str):
    for kw in call.keywords:
        if kw.arg == name:
            return kw.value
    return None


def _is_const(node, value) -> bool:
    return isinstance(node, ast.Constant) and node.value is value


def _call_problem(call: ast.Call, name: str) -> str | None:
    root = name.split(".")[0]
    if root in UNSAFE_MODULES:
        return f"{name}: pickle-family loader"
    if name in UNSAFE_CALLS:
        return f"{name}: {UNSAFE_CALLS[name]}"
    if name in ("torch.load", "torch.serialization.load") and not _is_const(_keyword(call, "weights_only"), True):
        return f"{name} without weights_only=True unpickles arbitrary objects"
    if name in ("numpy.load", "np.load") and _is_const(_keyword(call, "allow_pickle"), True):
        return f"{name}(allow_pickle=True) unpickles object arrays"
    if name == "yaml.load":
        loader = _keyword(call, "Loader") or (call.args[1] if len(call.args) > 1 else None)
        if loader is None or ast.unparse(loader) not in SAFE_YAML_LOADERS:
            return "yaml.load without SafeLoader: use yaml.safe_load"
    if name in ("eval", "exec", "builtins.eval", "builtins.exec", "compile"):
        return f"{name}() runs text as code"
    if _is_const(_keyword(call, "trust_remote_code"), True):
        return f"{name}(trust_remote_code=True) runs code shipped with a model"
    if _is_const(_keyword(call, "use_safetensors"), False):
        return f"{name}(use_safetensors=False) allows pickled weights"
    if name.endswith(".load_checkpoint") and not name.startswith("rlhf_core."):
        return f"{name}: DeepSpeed's load_checkpoint reads with torch.load(weights_only=False)"
    return None


def scan_source(source: str, filename: str = "<snippet>") -> list[str]:
    """Every unsafe load / code-execution site in ``source`` as 'file:line: why'."""
    tree = ast.parse(source, filename)
    aliases = _aliases(tree)
    problems = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            for mod in mods:
                if mod.split(".")[0] in UNSAFE_MODULES:
                    problems.append(f"{filename}:{node.lineno}: imports {mod} (pickle-family)")
        elif isinstance(node, ast.Call):
            why = _call_problem(node, _qualified(node.func, aliases))
            if why:
                problems.append(f"{filename}:{node.lineno}: {why}")
    return problems


def test_no_unsafe_load_anywhere_in_the_code():
    problems = [p for f in python_files() for p in scan_source(f.read_text(), str(f.relative_to(REPO)))]
    assert not problems, "unsafe loads:\n" + "\n".join(problems)


@pytest.mark.parametrize("snippet", [
    "import pickle\npickle.loads(b'')",
    "from pickle import load\nload(open('x', 'rb'))",
    "import cloudpickle",
    "import joblib\njoblib.load('m.joblib')",
    "import torch\ntorch.load('x.pt')",
    "import torch\ntorch.load('x.pt', weights_only=False)",
    "from torch import load as tl\ntl('x.pt', map_location='cpu')",
    "import numpy as np\nnp.load('a.npy', allow_pickle=True)",
    "import yaml\nyaml.load(open('c.yaml'))",
    "import yaml\nyaml.load(text, Loader=yaml.FullLoader)",
    "import yaml\nyaml.unsafe_load(text)",
    "eval(row['expr'])",
    "exec(open('user.py').read())",
    "import pandas as pd\npd.read_pickle('t.pkl')",
    "from transformers import AutoModel\nAutoModel.from_pretrained(p, trust_remote_code=True)",
    "from transformers import AutoModel\nAutoModel.from_pretrained(p, use_safetensors=False)",
    "import mlflow\nmlflow.pyfunc.load_model('runs:/x/model')",
    "engine.load_checkpoint(ckpt_dir, tag='step3')",
])
def test_scanner_finds_unsafe_loads(snippet):
    assert scan_source(snippet), f"the scanner missed: {snippet!r}"


@pytest.mark.parametrize("snippet", [
    "import torch\ntorch.load('x.pt', weights_only=True, map_location='cpu')",
    "import numpy as np\nnp.load('a.npy')",
    "import yaml\nyaml.safe_load(text)\nyaml.load(text, Loader=yaml.SafeLoader)",
    "model.eval()",
    "from safetensors.torch import load_file\nload_file('m.safetensors')",
    "import json\njson.loads(s)",
])
def test_scanner_allows_safe_loads(snippet):
    assert scan_source(snippet) == []


def _sets(call: ast.Call, module: ast.Module, keyword: str, wanted) -> bool:
    """``keyword=<wanted>`` in the decorator call, directly or via ``**NAME`` where NAME is a
    module-level dict(...) or {...}. ``wanted`` is a constant or a Name's id (e.g. NO_CACHE)."""
    def matches(node) -> bool:
        return _is_const(node, wanted) or (isinstance(node, ast.Name) and node.id == wanted)

    if matches(_keyword(call, keyword)):
        return True
    spread = [kw.value.id for kw in call.keywords if kw.arg is None and isinstance(kw.value, ast.Name)]
    for node in module.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id in spread for t in node.targets):
            value = node.value
            if isinstance(value, ast.Call) and matches(_keyword(value, keyword)):
                return True
            if isinstance(value, ast.Dict) and any(_is_const(k, keyword) and matches(v)
                                                   for k, v in zip(value.keys, value.values)):
                return True
    return False


def test_prefect_never_persists_pickled_results():
    """Prefect pickles task/flow results by default and unpickles them on a cache hit: every flow
    and task here runs with persistence off, every task without a cache, and state lives in the run
    directory instead."""
    seen, problems = 0, []
    for f in python_files():
        module = ast.parse(f.read_text())
        for node in ast.walk(module):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for deco in node.decorator_list:
                target = deco.func if isinstance(deco, ast.Call) else deco
                if not (isinstance(target, ast.Name) and target.id in ("task", "flow")):
                    continue
                seen += 1
                where = f"{f.relative_to(REPO)}:{node.lineno}: @{target.id} {node.name}"
                if not (isinstance(deco, ast.Call) and _sets(deco, module, "persist_result", False)):
                    problems.append(f"{where} without persist_result=False")
                if target.id == "task" and not (isinstance(deco, ast.Call)
                                                and _sets(deco, module, "cache_policy", "NO_CACHE")):
                    problems.append(f"{where} without cache_policy=NO_CACHE")
    assert seen >= 10, "the scan must see the Prefect tasks and flows"
    assert not problems, "\n".join(problems)


# ---------------------------------------------------------------------------------------------
# (c) loopback-only servers
# ---------------------------------------------------------------------------------------------

LOOPBACK = {"127.0.0.1", "localhost", "::1"}
SERVER_LINE = re.compile(r"\b(prefect\s+server\s+start|mlflow\s+(ui|server))\b")
HOST_ARG = re.compile(r"--host(?:=|\s+)(\S+)")
# Known violations waiting on their owners (file → what to change); a strict xfail flags the fix.
PENDING: dict[str, str] = {}


def _shell_host_ok(value: str, text: str) -> bool:
    """A literal loopback host, ${VAR:-127.0.0.1}, or $VAR / $(VAR) / ${VAR} set to loopback in the file."""
    value = value.strip("'\"")
    if value in LOOPBACK:
        return True
    default = re.fullmatch(r"\$\{\w+:-([^}]+)\}", value)
    if default:
        return default.group(1) in LOOPBACK
    var = re.fullmatch(r"\$\{?\(?(\w+)\)?\}?", value)
    if var:
        assigned = re.findall(rf"^\s*(?:export\s+)?{var.group(1)}\s*[:?]?=\s*['\"]?([^\s'\"]+)", text, re.M)
        return bool(assigned) and all(a in LOOPBACK for a in assigned)
    return False


def text_server_problems(text: str, name: str) -> list[str]:
    """Server command lines in prose, docstrings, shell, YAML or Makefiles without a loopback --host.
    Python comments are skipped: they mention commands, users copy commands from docs."""
    problems = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if name.endswith(".py") and line.lstrip().startswith("#"):
            continue
        if SERVER_LINE.search(line):
            host = HOST_ARG.search(line[SERVER_LINE.search(line).end():])
            if not host or not _shell_host_ok(host.group(1), text):
                problems.append(f"{name}:{lineno}: {line.strip()[:100]}")
    return problems


def _module_constants(module: ast.Module) -> dict[str, ast.expr]:
    return {t.id: node.value for node in module.body if isinstance(node, ast.Assign)
            for t in node.targets if isinstance(t, ast.Name)}


def _loopback_expr(node: ast.expr, constants: dict[str, ast.expr]) -> bool:
    """A loopback literal, a module constant holding one, or os.environ.get / os.getenv(.., loopback)."""
    if isinstance(node, ast.Name) and node.id in constants:
        node = constants[node.id]
    if isinstance(node, ast.Constant):
        return node.value in LOOPBACK
    if isinstance(node, ast.Call) and ast.unparse(node.func) in ("os.environ.get", "os.getenv", "environ.get"):
        return len(node.args) == 2 and _loopback_expr(node.args[1], constants)
    return False


def code_server_problems(source: str, name: str) -> list[str]:
    """Server commands built as argument lists in Python (["mlflow", "server", "--host", HOST, ...],
    prefect_cmd("server", "start", ...)) without a loopback host; wildcard address literals."""
    module = ast.parse(source)
    constants = _module_constants(module)
    problems = [f"{name}:{node.lineno}: wildcard address {node.value!r}" for node in ast.walk(module)
                if isinstance(node, ast.Constant) and node.value == "0.0.0.0"]
    for node in ast.walk(module):  # socket.bind((host, port)) with a literal non-loopback host
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "bind" \
                and node.args and isinstance(node.args[0], ast.Tuple) and node.args[0].elts:
            host = node.args[0].elts[0]
            if isinstance(host, ast.Constant) and host.value not in LOOPBACK:
                problems.append(f"{name}:{node.lineno}: binds to {host.value!r}")
    for node in ast.walk(module):
        if isinstance(node, (ast.List, ast.Tuple)):
            items, label = node.elts, "mlflow"
        elif isinstance(node, ast.Call):
            items, label = node.args, ast.unparse(node.func).lower()
        else:
            continue
        words = [i.value for i in items if isinstance(i, ast.Constant) and isinstance(i.value, str)]
        program = "mlflow" if "mlflow" in words or "mlflow" in label else "prefect" if "prefect" in label else None
        if program is None or not ({"server", "ui"} & set(words)) or (program == "prefect" and "start" not in words):
            continue
        strings = [ast.unparse(i) for i in items]
        host_at = next((k for k, i in enumerate(items) if isinstance(i, ast.Constant) and i.value == "--host"), None)
        inline = [i.value.split("=", 1)[1] for i in items
                  if isinstance(i, ast.Constant) and isinstance(i.value, str) and i.value.startswith("--host=")]
        ok = (host_at is not None and host_at + 1 < len(items) and _loopback_expr(items[host_at + 1], constants)) or \
            (inline and inline[0] in LOOPBACK)
        if not ok:
            problems.append(f"{name}:{node.lineno}: {program} server without a loopback --host: {strings[:6]}")
    return problems


def server_problems() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for path in repo_text_files():
        rel = str(path.relative_to(REPO))
        if rel.startswith("tests/reliability/"):
            continue  # this file's own examples
        text = path.read_text(errors="replace")
        problems = text_server_problems(text, rel)
        if path.suffix == ".py" and rel.split("/")[0] in CODE_DIRS:
            problems += code_server_problems(text, rel)
        if problems:
            found[rel] = problems
    return found


def test_servers_bind_to_loopback_unless_told_otherwise():
    found = server_problems()
    unexpected = {f: p for f, p in found.items() if f not in PENDING}
    assert not unexpected, "servers not bound to 127.0.0.1:\n" + "\n".join(sum(unexpected.values(), []))




def test_the_deployment_services_are_actually_scanned():
    services = REPO / "deployments" / "services.py"
    if not services.is_file():
        pytest.skip("deployments/services.py not written yet")
    source = services.read_text()
    assert re.search(r"prefect|mlflow", source) and "server" in source
    weakened = source.replace('"--host", HOST', '"--port", HOST')
    assert code_server_problems(weakened, "services.py"), "dropping --host must be caught"


@pytest.mark.parametrize("text, bad", [
    ("prefect server start --host 127.0.0.1 --port 4200", False),
    ("mlflow ui --backend-store-uri sqlite:///x.db", True),
    ("mlflow server --host 0.0.0.0", True),
    ("HOST ?= 127.0.0.1\nserve:\n\tmlflow server --host $(HOST) --port 5000", False),
    ("HOST=0.0.0.0\nmlflow server --host $HOST", True),
    ("prefect server start --host ${PREFECT_HOST:-127.0.0.1}", False),
    ("prefect server start", True),
])
def test_text_server_scanner(text, bad):
    assert bool(text_server_problems(text, "x")) is bad


@pytest.mark.parametrize("source, bad", [
    ('HOST = "127.0.0.1"\ncmd = ["mlflow", "server", "--host", HOST]', False),
    ('cmd = [sys.executable, "-m", "mlflow", "server", "--port", "5000"]', True),
    ('cmd = ["mlflow", "ui", "--host=0.0.0.0"]', True),
    ('import os\nH = os.environ.get("RLHF_HOST", "127.0.0.1")\nprefect_cmd("server", "start", "--host", H)', False),
    ('prefect_cmd("server", "start", "--port", "4200")', True),
    ('sock.bind(("0.0.0.0", 0))', True),
    ('sock.bind(("", 0))', True),
    ('sock.bind(("127.0.0.1", 0))', False),
    ('SEP = "::"', False),
])
def test_code_server_scanner(source, bad):
    assert bool(code_server_problems(source, "x")) is bad


# ---------------------------------------------------------------------------------------------
# (b) user reward code is imported only when configured, through the real score stage
# ---------------------------------------------------------------------------------------------

MARKER_MODULE = """
import os
open(os.environ["RLHF_TEST_IMPORT_MARKER"], "a").write(__name__ + "\\n")

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return 0.75
"""
# names a discovery mechanism might try: verl's default file name, the data source, the function
DECOY_NAMES = ("reward", "rewards", "custom_reward", "compute_score", "reward_fn", "arith", "gsm8k_reward")


def _score_run(tmp_path: Path, tiny_model_dir: Path, tokenizer, run_name: str, *overrides: str):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from rlhf_core.config import load_config
    from rlhf_core.data.schemas import PROMPTS, ROLLOUT
    from rlhf_core.io.atomic import atomic_write_parquet
    from rlhf_core.run.layout import RunDir
    from rlhf_core.stages.init_critic import run_init_critic
    from rlhf_core.stages.score import run_score

    run = RunDir(tmp_path / run_name)
    messages = [{"role": "user", "content": "What is 3 + 4?"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    prompt = dict(prompt_id="p0", data_source="arith", reward_source="arith", prompt=messages, ability="math",
                  reward_model={"style": "rule", "ground_truth": "7"},
                  extra_info=json.dumps({"split": "train", "index": 0, "question": "What is 3 + 4?",
                                         "answer": "#### 7"}),
                  source_file="test", source_row=0,
                  prompt_text=text, prompt_token_ids=ids, prompt_length=len(ids))
    rollout = []
    for j, response in enumerate(["3 + 4 = 7\n#### 7", "#### 8"]):
        rids = tokenizer(response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        rollout.append(dict(prompt_id="p0", sample_index=j, iteration=1, data_source="arith", ground_truth="7",
                            prompt_token_ids=ids, response_text=response, response_token_ids=rids,
                            response_length=len(rids), finish_reason="stop", engine="offline", sampling_seed=0,
                            reward_source="arith", extra_info=prompt["extra_info"], uid="1-p0"))
    atomic_write_parquet(run.train_prompts, pa.Table.from_pylist([prompt], schema=PROMPTS), schema=PROMPTS)
    atomic_write_parquet(run.rollout(1), pa.Table.from_pylist(rollout, schema=ROLLOUT), schema=ROLLOUT)
    cfg = load_config(None, [f"actor_rollout_ref.model.path={tiny_model_dir}", "trainer.device=cpu", *overrides])
    run_init_critic(cfg, run)
    run_score(cfg, run, 1)
    return [r["reward"] for r in pq.read_table(run.scored(1)).to_pylist()]


def test_user_reward_code_is_imported_only_when_configured(tmp_path, tiny_model_dir, monkeypatch):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    decoys = tmp_path / "decoys"
    decoys.mkdir()
    for name in DECOY_NAMES:
        (decoys / f"{name}.py").write_text(MARKER_MODULE)
    marker = tmp_path / "imported.txt"
    monkeypatch.setenv("RLHF_TEST_IMPORT_MARKER", str(marker))
    monkeypatch.syspath_prepend(str(decoys))
    monkeypatch.chdir(decoys)  # also the working directory, where a naive loader would look first
    for name in DECOY_NAMES:
        sys.modules.pop(name, None)

    rewards = _score_run(tmp_path, tiny_model_dir, tokenizer, "plain")
    assert rewards == [1.0, 0.0]  # the built-in strict GSM8K scorer
    assert not marker.exists(), f"user code imported without being configured: {marker.read_text()}"
    assert not set(DECOY_NAMES) & set(sys.modules)

    # the test can fail: named in the config, the same file is imported and scores every row
    rewards = _score_run(tmp_path, tiny_model_dir, tokenizer, "configured",
                         f"custom_reward_function.path={decoys / 'reward.py'}")
    assert rewards == [0.75, 0.75] and marker.exists()


# ---------------------------------------------------------------------------------------------
# (d) secret redaction
# ---------------------------------------------------------------------------------------------

HF = "hf_" + "aB3dE5gH7jK9mN1pQ3sT5vW7yZ9bC1dE3"


@pytest.mark.parametrize("key", ["hf_token", "trainer.hf_token", "HF_TOKEN", "env.WANDB_API_KEY", "api_key",
                                 "apiKey", "x.AWS_SECRET_ACCESS_KEY", "db.password", "PASSWD", "credentials",
                                 "auth", "oauth.client_secret", "access_token", "private_key", "key",
                                 "authorization", "x.ssh_key", "secret"])
def test_secret_keys_are_masked_whole(key):
    assert is_secret_key(key)
    assert redact({key: "anything at all", "other": 1}) == {key: MASK, "other": 1}


@pytest.mark.parametrize("key", ["data.prompt_key", "data.answer_key", "data.id_key", "max_token_len_per_gpu",
                                 "actor_rollout_ref.rollout.generation_batch_tokens", "tokenizer_path",
                                 "algorithm.kl_ctrl.kl_coef", "trainer.author", "keyword", "data.max_prompt_length",
                                 "trainer.authority_url", "token_count_total"])
def test_ordinary_config_keys_are_kept(key):
    assert not is_secret_key(key)
    assert redact({key: "question"}) == {key: "question"}


def test_the_whole_project_config_passes_unchanged():
    """Redaction must not blur what runs are compared by: every real config key and value survives."""
    from rlhf_core.config import flatten, load_config

    for preset in (None, REPO / "configs" / "demo.yaml", REPO / "configs" / "gsm8k.yaml"):
        flat = flatten(load_config(preset, []))
        assert redact(flat) == flat


@pytest.mark.parametrize("text, shown", [
    (f"trainer.token={HF}", "trainer.token=***"),
    (f"--hf-token {HF} --x 1", "--hf-token *** --x 1"),
    ("OPENAI_API_KEY=sk-proj-AbCdEf0123456789xyzXYZ", "OPENAI_API_KEY=***"),
    ("key sk-AbCdEf0123456789xyzXYZ end", "key *** end"),
    ("ghp_" + "A1b2C3d4E5f6G7h8I9j0K1l2M3n4O5p6Q7r8", "***"),
    ("AKIAIOSFODNN7EXAMPLE", "***"),
    ("https://ann:s3cr3t@mlflow.example.com:5000/", "https://ann:***@mlflow.example.com:5000/"),
    ("postgresql://u:pw@db/x", "postgresql://u:***@db/x"),
    ("Authorization: Bearer abcdef0123456789", "Authorization: Bearer ***"),
    ("password: 'hunter2'", "password: '***'"),
    ("eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U", "***"),
    ("seed=42 lr=1e-4 path=/tmp/x", "seed=42 lr=1e-4 path=/tmp/x"),
    ("sha256 9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08", None),
    ("mlflow run 0123456789abcdef0123456789abcdef", None),
    ("/models/Qwen2-0_5B-Instruct-GPTQ-Int4-AWQ-Finetuned-v2/config.json", None),
    ("DeepSeek-R1-Distill-Qwen-1_5B-Instruct-2025", None),
    ("http://127.0.0.1:5000", None),
])
def test_secret_values_are_masked_in_place(text, shown):
    assert redact_text(text) == (text if shown is None else shown)
    assert redact({"anything": text}) == {"anything": text if shown is None else shown}


def test_random_keys_are_caught_by_the_entropy_backstop():
    rng = random.Random(0)
    alphabet = string.ascii_letters + string.digits
    keys = ["".join(rng.choice(alphabet) for _ in range(40)) for _ in range(500)]
    caught = sum(redact_text(f"value {k} end") == f"value {MASK} end" for k in keys)
    assert caught >= 0.97 * len(keys), f"caught {caught} of {len(keys)} random 40-character keys"


def test_containers_and_non_text_values():
    params = {"overrides": [f"trainer.hf_token={HF}", "data.seed=3"], "nested": {"api_key": "x", "n": 1},
              "lr": 1e-4, "flag": True, "none": None, "token": None, "secret": ""}
    assert redact(params) == {"overrides": ["trainer.hf_token=***", "data.seed=3"],
                              "nested": {"api_key": MASK, "n": 1}, "lr": 1e-4, "flag": True, "none": None,
                              "token": None, "secret": ""}
    assert params["overrides"][0].endswith(HF), "redact must not change its input"


def test_redaction_survives_json_and_never_raises():
    weird = {"a": b"bytes", "b": object(), "c": float("nan"), "d": ("t", HF), 5: "int key"}
    out = redact(weird)
    assert out["d"] == ("t", MASK) and out[5] == "int key" and out["a"] == b"bytes"
    json.dumps({k: str(v) for k, v in out.items()}, default=str)


def test_core_never_imports_orchestration_for_redaction():
    source = (REPO / "rlhf_core" / "security.py").read_text()
    assert not re.search(r"^\s*(import|from)\s+(prefect|mlflow)", source, re.M)


def test_inline_data_is_kept_whole_and_the_text_around_it_redacted():
    """A Prefect report carries its learning curve as a base64 data URI: random-looking by nature,
    and masking part of it would break the image; the rest of the report is still redacted."""
    rng = random.Random(7)
    payload = "".join(rng.choice(string.ascii_letters + string.digits + "+/") for _ in range(400)) + "=="
    assert redact_text(f"x {payload} y") != f"x {payload} y"  # the same text outside a data URI is masked
    report = f"MLflow: https://ann:pw@mlflow.example/ ![curve](data:image/png;base64,{payload}) token {HF}"
    assert redact_text(report) == (f"MLflow: https://ann:{MASK}@mlflow.example/ ![curve](data:image/png;base64,"
                                   f"{payload}) token {MASK}")
