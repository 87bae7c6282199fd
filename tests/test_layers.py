"""The floor plan, checked: imports point one way (rlhf_core ← tasks ← flows ← deployments ←
rlhf_cli, and inside rlhf_core its subpackages in the order docs/architecture.md shows), no import
cycles, no project import hidden inside a function, and the run directory's file names spelled in
one module (rlhf_core/run/layout.py).

Read from the source with ``ast`` (every import, function-local ones included), so a cycle closed
by a late import fails here as well as one at module top.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LAYERS = ("rlhf_core", "tasks", "flows", "deployments", "rlhf_cli")
"""Lowest first: a module may import its own layer and the layers before it."""
INNER = ("foundation", "io", "models", "algos", "config", "data", "scoring", "rewards", "run", "training",
         "rollout", "sft", "stages", "control")
"""rlhf_core's subpackages, lowest first: a module may import its own subpackage and those before it.
"foundation" = the modules at rlhf_core's top (errors, paths, progress, security, notes)."""
ORCHESTRATION = ("prefect", "mlflow")
"""Libraries only the Prefect layer and above may import (the library runs without them)."""


def _modules() -> dict[str, Path]:
    out = {}
    for top in LAYERS:
        for path in (REPO / top).rglob("*.py"):
            name = ".".join(path.relative_to(REPO).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = path
    return out


MODULES = _modules()


def _owner(name: str) -> str | None:
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(path: Path) -> list[tuple[ast.AST, list[str], bool]]:
    """(node, imported names, inside a function) for every import statement of ``path``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    inner = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
             for n in ast.walk(f) if isinstance(n, (ast.Import, ast.ImportFrom))}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.append((node, [a.name for a in node.names], id(node) in inner))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node, [node.module] + [f"{node.module}.{a.name}" for a in node.names], id(node) in inner))
    return out


def _edges() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for module, path in MODULES.items():
        for _, names, _ in _imports(path):
            for target in {_owner(n) for n in names} - {None, module}:
                if module.startswith(target + "."):
                    continue  # `from pkg import sibling`: pkg is already being imported, not a cycle
                edges.setdefault(module, set()).add(target)
    return edges


def test_imports_point_one_way():
    wrong = []
    for module, path in MODULES.items():
        rank = LAYERS.index(module.split(".")[0])
        for node, names, _ in _imports(path):
            top = names[0].split(".")[0]
            if top in LAYERS and LAYERS.index(top) > rank:
                wrong.append(f"{path.relative_to(REPO)}:{node.lineno} ({module.split('.')[0]}) imports {names[0]}")
            if rank == 0 and top in ORCHESTRATION:
                wrong.append(f"{path.relative_to(REPO)}:{node.lineno}: the library imports {names[0]}")
    assert not wrong, "\n".join(wrong)


def _inner(module: str) -> str:
    """The subpackage of an rlhf_core module, as INNER names it."""
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (REPO / "rlhf_core" / parts[1]).is_dir() else "foundation"


def test_rlhf_core_subpackages_import_in_one_order():
    """Components → run state → training → rollout → sft → stages → control: an import the other way
    is how a cycle between subpackages starts, even before it closes."""
    unknown = {_inner(m) for m in MODULES if m.startswith("rlhf_core.")} - set(INNER)
    assert not unknown, f"subpackages missing from INNER (and docs/architecture.md): {sorted(unknown)}"
    wrong = []
    for module, path in MODULES.items():
        if not module.startswith("rlhf_core."):
            continue
        rank = INNER.index(_inner(module))
        for node, names, _ in _imports(path):
            target = _owner(names[0]) or (_owner(names[1]) if len(names) > 1 else None)
            if target is None or not target.startswith("rlhf_core."):
                continue
            if INNER.index(_inner(target)) > rank:
                wrong.append(f"{path.relative_to(REPO)}:{node.lineno} ({_inner(module)}) imports {target} "
                             f"({_inner(target)})")
    assert not wrong, "\n".join(wrong)


NARROW = ("foundation", "io", "models", "algos", "data", "scoring", "rewards", "rollout", "sft")
"""Subpackages whose functions take the few settings they read (a section of the config, a settings
dataclass the stage builds: ``stages.settings``), never the whole config."""
NARROW_MODULES = ("rlhf_core.run.schedule", "rlhf_core.run.migrate", "rlhf_core.run.report")
"""Modules of a subpackage not yet narrow as a whole that already are (and must stay so)."""


def _whole_config_functions(tree: ast.AST) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    """Functions with a parameter named ``cfg`` or annotated ``RLHFConfig``, but a Protocol's
    declarations (a signature the implementations answer, no code that reads the config)."""
    declared = {id(fn) for cls in ast.walk(tree) if isinstance(cls, ast.ClassDef)
                and any(ast.unparse(base).endswith("Protocol") for base in cls.bases) for fn in cls.body}
    return [node for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and id(node) not in declared
            and any(arg.arg == "cfg" or (arg.annotation is not None and "RLHFConfig" in ast.unparse(arg.annotation))
                    for arg in [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs])]


def test_the_whole_config_stops_above_the_narrow_subpackages():
    wrong = []
    for module, path in MODULES.items():
        if not module.startswith("rlhf_core.") or (_inner(module) not in NARROW and module not in NARROW_MODULES):
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and any(a.name == "RLHFConfig" for a in node.names):
                wrong.append(f"{path.relative_to(REPO)}:{node.lineno} imports RLHFConfig")
        for node in _whole_config_functions(tree):
            wrong.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name} takes the whole config")
    assert not wrong, "\n".join(wrong)


STAGE_ENTRY_POINTS = re.compile(r"^(run_\w+|config_sections|\w+_share)$")
"""The stage contract's functions, which take the whole config by design (``run.stage_order``)."""
WHOLE_CONFIG_AT_MOST = {"run": 10, "training": 29, "stages": 13}
"""Functions that still take the whole config in the subpackages not yet narrow: a ceiling that only
comes down. A new function there takes the settings it reads (a config section, or a dataclass its
stage builds once: ``stages/settings.py``, ``guard.GuardSettings``, ``score.ScoreSettings``, ...);
whoever narrows more lowers the number. In ``stages`` the config arrives whole at each stage's entry
points (``run_<stage>``, ``config_sections``, ``<stage>_share``, its settings builder) and the bodies
take settings: the entry points a stage must have (``STAGE_ENTRY_POINTS``) are not counted, so a new
stage by the README's recipe needs no change here (85 functions took the config before issue 40, 44
with the entry points now, 20 without: the process counts take the trainer and rollout sections). (``config`` is the config; ``control`` is where it is meant to arrive whole.)"""


def test_no_new_function_below_the_stages_takes_the_whole_config():
    counts: dict[str, list[str]] = {}
    for module, path in MODULES.items():
        if module.startswith("rlhf_core.") and _inner(module) in WHOLE_CONFIG_AT_MOST:
            for node in _whole_config_functions(ast.parse(path.read_text(encoding="utf-8"))):
                if _inner(module) == "stages" and STAGE_ENTRY_POINTS.match(node.name):
                    continue
                counts.setdefault(_inner(module), []).append(f"{module}.{node.name}")
    over = {sub: names for sub, names in counts.items() if len(names) > WHOLE_CONFIG_AT_MOST[sub]}
    assert not over, "\n".join(f"{sub}: {len(names)} functions take the whole config (at most "
                                f"{WHOLE_CONFIG_AT_MOST[sub]}): {sorted(names)}" for sub, names in over.items())


def test_the_architecture_doc_shows_the_inner_order():
    """docs/architecture.md's table of rlhf_core's subpackages lists them in INNER's order."""
    doc = (REPO / "docs" / "architecture.md").read_text(encoding="utf-8")
    rows = re.findall(r"^\| (\d+) \| `?([a-z_]+)`? \|", doc, flags=re.MULTILINE)
    assert [name for _, name in rows] == list(INNER), rows
    assert [int(n) for n, _ in rows] == list(range(1, len(INNER) + 1))


def test_no_import_cycles():
    edges = _edges()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in MODULES:
        if module not in index:
            visit(module)
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_no_project_import_inside_a_function():
    """Only heavy optional libraries (vllm, deepspeed, flash-attn, ...) may be imported late; a project
    module imported inside a function hides a cycle or a layering problem."""
    late = [f"{path.relative_to(REPO)}:{node.lineno}: {names[0]}" for module, path in MODULES.items()
            for node, names, inner in _imports(path) if inner and names[0].split(".")[0] in LAYERS]
    assert not late, "\n".join(late)


RUN_FILE_NAMES = re.compile(
    r"""["'](?:last_good\.json|kl_ctrl\.json|kl_ctrl_before\.json|events\.jsonl|run\.lock|config\.yaml|"""
    r"""rollout\.parquet|scored\.parquet|advantages\.parquet|guard\.json|validation\.parquet|"""
    r"""iteration_metrics\.json|learning_curve\.png|generation_batches\.parquet|rejects\.parquet|"""
    r"""rollout_rejects\.parquet|train\.parquet|val\.parquet|iter_)["']""")


@pytest.mark.parametrize("layer", LAYERS)
def test_run_file_names_live_in_the_layout_module(layer):
    layout = REPO / "rlhf_core" / "run" / "layout.py"
    spelled = []
    for path in sorted((REPO / layer).rglob("*.py")):
        if path == layout:
            continue
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            code = line.split("#", 1)[0]
            if RUN_FILE_NAMES.search(code) and not code.lstrip().startswith(('"""', "'''")):
                spelled.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
    assert not spelled, "ask rlhf_core.run.layout.RunDir instead:\n" + "\n".join(spelled)


def test_every_source_folder_is_a_package_the_wheel_includes():
    """A folder without __init__.py still imports from a checkout (a namespace package) but is left
    out of the installed wheel, which ships only what setuptools finds."""
    from setuptools import find_packages

    found = set(find_packages(where=str(REPO), include=[f"{layer}*" for layer in LAYERS]))
    folders = {".".join(p.parent.relative_to(REPO).parts) for layer in LAYERS for p in (REPO / layer).rglob("*.py")}
    assert folders <= found, f"folders missing an __init__.py: {sorted(folders - found)}"


PROCESS_WIDE = {
    "rlhf_core.scoring.cache._entries": "a memo of read-only model directories keyed by their files' identity",
    "rlhf_core.io.hashing._known": "a memo of file digests keyed by (path, size, mtime)",
    "rlhf_core.notes._SAID": "which one-time notes this process printed",
    "rlhf_core.run.layout._WARNED": "which one-time warnings this process printed",
    "rlhf_core.io.timing._spans": "the process's timing spans (accounting, not state a stage reads)",
    "rlhf_core.io.timing._gc_sink": "where the garbage collector's pauses are counted",
    "rlhf_core.io.timing._gc_started": "the start of the garbage collection in progress",
    "rlhf_core.io.timing._blocks_open": "how many timed blocks are open",
}
"""The only module-level values a function may change, each a registry, a pure memo cache or process
accounting. Live state (the trainer, lent modules, frozen models, a kept engine, kept reference
states) belongs to the run session (``run.session.RunSession``) the flow hands to each stage."""


MUTATORS = {"append", "add", "clear", "discard", "extend", "insert", "move_to_end", "pop", "popitem", "remove",
            "setdefault", "update", "appendleft"}


def _process_wide_values() -> set[str]:
    """Module-level names of rlhf_core that a function changes: rebinds (``global``), assigns into,
    deletes from or calls a mutating method of."""
    found = set()
    for module, path in MODULES.items():
        if not module.startswith("rlhf_core."):
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        top = {t.id for node in tree.body if isinstance(node, (ast.Assign, ast.AnnAssign))
               for t in (node.targets if isinstance(node, ast.Assign) else [node.target]) if isinstance(t, ast.Name)}
        for func in [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]:
            local = {a.arg for a in [*func.args.posonlyargs, *func.args.args, *func.args.kwonlyargs]}
            for node in ast.walk(func):
                if isinstance(node, ast.Global):
                    found |= {f"{module}.{name}" for name in node.names}
                name = None
                if isinstance(node, (ast.Assign, ast.AugAssign, ast.Delete)):
                    targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
                    name = next((t.value.id for t in targets if isinstance(t, ast.Subscript)
                                 and isinstance(t.value, ast.Name)), None)
                elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                        and node.func.attr in MUTATORS and isinstance(node.func.value, ast.Name):
                    name = node.func.value.id
                if name in top and name not in local:
                    found.add(f"{module}.{name}")
    return found


def test_no_module_holds_live_state():
    """Module-level holders of live state: none (registries, pure memo caches and process accounting
    only, each named in PROCESS_WIDE with its reason)."""
    extra = sorted(_process_wide_values() - set(PROCESS_WIDE))
    assert not extra, (f"module-level state {extra}: a run's live state goes into the run session "
                       "(rlhf_core/run/session.py); a registry or memo cache goes into PROCESS_WIDE with its reason")
    gone = sorted(set(PROCESS_WIDE) - _process_wide_values())
    assert not gone, f"PROCESS_WIDE names values that no longer exist: {gone}"


def test_only_the_ray_launcher_imports_ray():
    """Ray is an optional extra (several machines): one module loads it, and only when a run spans nodes."""
    launcher = REPO / "rlhf_core" / "training" / "ray_ranks.py"
    importers = sorted(str(path.relative_to(REPO)) for module, path in MODULES.items()
                       for _, names, _ in _imports(path) if path != launcher and names[0].split(".")[0] == "ray")
    assert importers == []


LONGEST = 600
"""Lines a module may hold: past it a module holds more than one thing a reader looks for (the config
schema is the exception: every key a user can set, each beside its rule, is one thing)."""


def test_no_module_is_longer_than_one_home_holds():
    long = [f"{path.relative_to(REPO)}: {n} lines" for module, path in MODULES.items()
            if module != "rlhf_core.config.schema"
            and (n := len(path.read_text(encoding="utf-8").splitlines())) > LONGEST]
    assert not long, f"split these by what they hold (at most {LONGEST} lines each):\n" + "\n".join(long)
