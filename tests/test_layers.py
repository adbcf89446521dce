"""The layering, checked on the source: every import of every module of ``leyline_agent``
(lazy ones inside functions and ``TYPE_CHECKING`` blocks included), read with ``ast``.

Fails on:
- an import circle between modules;
- an import against the direction of the layers (``ALLOWED``): contracts at the bottom,
  ``directives`` on them, the engine on ``directives`` and the kernels, the Leyline front
  (``front``: conversations, ``context_management``, turn plans) on ``directives`` and the
  policies, under both the server and the vLLM plugin, the server on top;
  a contract that needs ``Directive`` or ``MessageEdit`` imports ``directives.core``, never
  the ``directives`` package, whose other modules build on the contracts (the package's
  namespace counts as a contract for the layers above, as it re-exports ``core`` only);
  the SGLang (and vLLM) plugin beside the engine, importing neither it nor the server;
  policies and the agent side on the contracts only (never the engine or the server);
- torch (or triton, transformers) imported by the contracts, ``directives``, the
  policies, the front or the agent side (a user who only wraps an agent loop installs no torch);
- ``leyline_agent.testing`` imported from outside ``testing`` (tests use it, shipped code
  never does);
- a module importing another module's underscore names (``from m import _x`` or
  ``m._x`` on an imported module).

The checker is tested too, on made-up sources, so that it can fail.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

import leyline_agent

ROOT = Path(leyline_agent.__file__).resolve().parent.parent
# installed as sub-packages of leyline_agent (pyproject's package-dir)
SOURCES = {
    "leyline_agent": ROOT / "leyline_agent",
    "leyline_agent.policies": ROOT / "policies",
    "leyline_agent.kernels": ROOT / "kernels",
    "leyline_agent.experiments": ROOT / "experiments",
}

CONTRACTS = {
    "leyline_agent.errors",
    "leyline_agent.namespaces",
    "leyline_agent.families",
    "leyline_agent.wire",
    "leyline_agent.protocols",
    "leyline_agent.trajectory",
    "leyline_agent.chat_input",
    "leyline_agent.chat_shapes",
    "leyline_agent.responses_items",
    "leyline_agent.http_errors",
    "leyline_agent.logs",
    "leyline_agent.text_match",  # linear-time matching of client text (policies, the front)
    "leyline_agent.metrics",  # Prometheus families of the stats contract (both servers)
    "leyline_agent.directives",  # the package namespace: core's names (for the layers above)
    "leyline_agent.edits",  # Directive, Mode, MessageEdit: wire contracts (a root module)
    "leyline_agent.directives.core",  # edits' names, re-exported for the directives layer
    "leyline_agent.directives.modes",  # one rule per mode, read by policies and every backend
}
# layer -> the layers it may import (besides its own modules)
ALLOWED: dict[str, set[str]] = {
    "contracts": set(),
    "http": {"contracts"},  # the HTTP guards every front runs, and their ASGI plumbing
    "directives": {"contracts", "http"},
    "policies": {"contracts"},
    "agent": {"contracts", "policies"},
    "front": {"contracts", "directives", "policies", "http"},
    "integrations": {"contracts", "policies", "agent"},
    "kernels": {"contracts"},
    "reference": {"contracts"},
    "engine": {"contracts", "directives", "kernels"},
    "sglang_plugin": {"contracts", "directives", "kernels", "http"},
    "vllm_plugin": {"contracts", "directives", "kernels", "front", "http"},
    "server": {
        "contracts", "directives", "kernels", "engine", "policies", "front", "sglang_plugin", "http",
    },  # fmt: skip
    "api": {"contracts", "directives", "policies", "agent"},
    "cli": {"contracts", "policies", "engine", "server", "experiments"},
    "launch": {"contracts"},  # the one launcher of real servers (tests and benchmarks)
    "experiments": {
        "contracts", "directives", "policies", "front", "agent", "integrations", "kernels",
        "reference", "engine", "server", "sglang_plugin", "vllm_plugin", "launch",
    },  # fmt: skip
    "testing": set(),  # anything: fixtures and doubles
}
DIRECTIVES_PACKAGE = "leyline_agent.directives"
TORCH_FREE = {"contracts", "http", "directives", "policies", "front", "agent"}
TORCH = ("torch", "triton", "transformers")


def layer_of(module: str) -> str:
    if module in CONTRACTS:
        return "contracts"
    if module == "leyline_agent":
        return "api"
    parts = module.split(".")
    if parts[1] == "directives":
        return "directives"
    return parts[1]


@dataclass(frozen=True, slots=True)
class Import:
    target: str  # the module imported (a leyline_agent module, or a third-party top name)
    names: tuple[str, ...]  # names taken from it (from-imports)
    line: int


@dataclass(slots=True)
class Module:
    name: str
    is_package: bool
    tree: ast.Module
    imports: list[Import] = field(default_factory=list)


def discover(sources: dict[str, Path]) -> dict[str, Module]:
    """Every module under the source folders, by dotted name."""
    out: dict[str, Module] = {}
    for package, folder in sources.items():
        for path in sorted(folder.rglob("*.py")):
            rel = path.relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            if any(p.startswith(".") or p == "__pycache__" for p in parts):
                continue
            name = ".".join([package, *parts])
            if name in out and not path.name == "__init__.py":
                continue
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
            out[name] = Module(name, path.name == "__init__.py", tree)
    return out


def parse_sources(texts: dict[str, str]) -> dict[str, Module]:
    """Modules from source texts (``"pkg.__init__"`` for a package), for the checker's tests."""
    out = {}
    for name, text in texts.items():
        pkg = name.endswith(".__init__")
        real = name.removesuffix(".__init__")
        out[real] = Module(real, pkg, ast.parse(text))
    return out


def _resolve(mod: Module, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = mod.name.split(".")
    if not mod.is_package:
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def collect_imports(modules: dict[str, Module]) -> None:
    for mod in modules.values():
        for node in ast.walk(mod.tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    mod.imports.append(Import(_target(alias.name, modules), (), node.lineno))
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(mod, node)
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    if sub in modules:  # from package import module
                        mod.imports.append(Import(sub, (), node.lineno))
                    else:
                        mod.imports.append(Import(_target(base, modules), (alias.name,), node.lineno))


def _target(name: str, modules: dict[str, Module]) -> str:
    if not name.startswith("leyline_agent"):
        return name.split(".")[0]
    while name not in modules and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


def _internal(imp: Import, modules: dict[str, Module]) -> bool:
    return imp.target in modules


def cycles(modules: dict[str, Module]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), and self-imports."""
    graph = {
        m.name: sorted({i.target for i in m.imports if _internal(i, modules)} - {m.name})
        for m in modules.values()
    }
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:  # iterative enough for this package's depth
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def violations(modules: dict[str, Module]) -> Iterator[str]:
    for mod in modules.values():
        layer = layer_of(mod.name)
        allowed = ALLOWED[layer]
        aliases = _module_aliases(mod, modules)
        for imp in mod.imports:
            where = f"{mod.name}:{imp.line}"
            if not _internal(imp, modules):
                if layer in TORCH_FREE and imp.target in TORCH:
                    yield f"{where}: the {layer} layer imports {imp.target}"
                continue
            target_layer = layer_of(imp.target)
            if layer == "contracts" and imp.target == DIRECTIVES_PACKAGE:
                target_layer = "directives"  # a contract takes core's names from core
            if target_layer == "testing" and layer != "testing":
                yield f"{where}: imports {imp.target} (test support) outside testing/"
            elif layer != "testing" and target_layer != layer and target_layer not in allowed:
                yield f"{where}: the {layer} layer imports {imp.target} ({target_layer})"
            for name in imp.names:
                if name.startswith("_") and not name.startswith("__"):
                    yield f"{where}: imports the private name {name} of {imp.target}"
        for node in ast.walk(mod.tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in aliases
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
            ):
                yield f"{mod.name}:{node.lineno}: uses {aliases[node.value.id]}.{node.attr}"


def _module_aliases(mod: Module, modules: dict[str, Module]) -> dict[str, str]:
    """Local names bound to other leyline_agent modules (``import x.y as m``, ``from x import m``)."""
    out = {}
    for node in ast.walk(mod.tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.asname and a.name in modules:
                    out[a.asname] = a.name
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(mod, node)
            for a in node.names:
                if f"{base}.{a.name}" in modules:
                    out[a.asname or a.name] = f"{base}.{a.name}"
    return out


def check(modules: dict[str, Module]) -> list[str]:
    collect_imports(modules)
    found = [f"import circle: {' <-> '.join(c)}" for c in cycles(modules)]
    return found + list(violations(modules))


def _fmt(problems: Iterable[str]) -> str:
    return "\n".join(problems)


# ---- the package ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def package() -> dict[str, Module]:
    modules = discover(SOURCES)
    assert len(modules) > 50, sorted(modules)
    return modules


def test_every_module_is_in_a_known_layer(package):
    unknown = sorted(m for m in package if layer_of(m) not in ALLOWED)
    assert not unknown, f"modules outside every layer (add them to ALLOWED): {unknown}"


def test_no_import_circle_and_no_import_against_the_layers(package):
    problems = check(package)
    assert not problems, "\n" + _fmt(problems)



def test_the_directives_namespace_re_exports_core_only(package):
    """The premise of counting ``leyline_agent.directives`` as a contract above the contracts."""
    init = package[DIRECTIVES_PACKAGE]
    targets = {i.target for i in init.imports if i.target.startswith("leyline_agent")}
    assert targets == {"leyline_agent.directives.core"}, targets


def test_no_contract_imports_the_directives_layer(package):
    """Contracts take ``MessageEdit``, ``Directive``, ``Mode`` from ``directives.core``; so
    ``trajectory`` (which ``directives.checks`` imports) never imports the package back."""
    collect = [
        f"{m.name}:{i.line}: {i.target}"
        for m in package.values()
        if layer_of(m.name) == "contracts" and m.name != DIRECTIVES_PACKAGE
        for i in m.imports
        if i.target == DIRECTIVES_PACKAGE
        or (i.target.startswith(DIRECTIVES_PACKAGE + ".") and i.target not in CONTRACTS)
    ]
    assert not collect, collect


def test_the_root_contracts_import_nothing_from_a_package_folder(package):
    """0 arrows back up on the structure tool's floors: a root contract module
    (``leyline_agent.<name>``) imports only other root modules, never a module of a folder
    (``edits`` holds ``Directive``, ``Mode``, ``MessageEdit`` for them)."""
    root = {n for n in CONTRACTS if n.count(".") == 1} - {DIRECTIVES_PACKAGE}
    found = [
        f"{m.name}:{i.line}: {i.target}"
        for m in package.values()
        if m.name in root
        for i in m.imports
        if i.target.startswith("leyline_agent.") and i.target.count(".") > 1
    ]
    assert not found, found


# Who may run a directive request's steps (compile, decide, request ids, the body's checks):
# the one service; every directive route and runtime mounts it.
DIRECTIVE_STEPS = {
    "leyline_agent.directives.pipeline": {"compile_request", "decide"},
    "leyline_agent.directives.idempotence": {"fingerprint", "check_request_id"},
    "leyline_agent.directives.validate": {"parse_directives", "checked", "check_served"},
}
STEP_RUNNERS = {"leyline_agent.directives.service"}
SERVICE_MOUNTS = {  # every directive route and runtime goes through the service
    "leyline_agent.server.leyline_routes",
    "leyline_agent.directives.remote_engine",
    "leyline_agent.sglang_plugin.http_route",
    "leyline_agent.sglang_plugin.client",
    "leyline_agent.engine.executor",
}


def test_directive_requests_run_through_the_one_service(package):
    """One front door: outside ``directives``, only the service takes the pipeline's steps;
    ``leyline serve``'s route, the engine's ``apply_directives``, the backend of an engine in
    another process (the vLLM plugin's route is its adapter) and SGLang's route and runtime
    import ``directives.service``."""
    found = [
        f"{m.name}:{i.line}: {i.target}.{name}"
        for m in package.values()
        if m.name not in STEP_RUNNERS and not m.name.startswith(DIRECTIVES_PACKAGE + ".")
        for i in m.imports
        if i.target in DIRECTIVE_STEPS
        for name in i.names
        if name in DIRECTIVE_STEPS[i.target]
    ]
    assert not found, found
    for name in SERVICE_MOUNTS:
        targets = {i.target for i in package[name].imports}
        assert "leyline_agent.directives.service" in targets, name
    # inside directives, the steps are the service's alone
    inside = {
        m.name
        for m in package.values()
        if m.name.startswith(DIRECTIVES_PACKAGE + ".")
        for i in m.imports
        if i.target == "leyline_agent.directives.pipeline"
        and {"compile_request", "decide"} & set(i.names)
    }
    assert inside <= {"leyline_agent.directives.service"}, inside


def test_the_directive_service_speaks_no_web_framework(package):
    """The service maps errors to bodies itself; each server's transport owns its framework."""
    service = package["leyline_agent.directives.service"]
    web = {i.target for i in service.imports} & {"fastapi", "starlette", "uvicorn", "httpx"}
    assert not web, web


SHARED_LIGHT = {
    "leyline_agent.http.guards": "the HTTP guards every server runs",
    "leyline_agent.http.asgi": "their raw ASGI plumbing",
    "leyline_agent.front.door": "the Leyline front before an engine's own app (vLLM's)",
    "leyline_agent.front.pin_report": "the answer that says a splice result was lost",
    "leyline_agent.directives.engine_rpc": "the ops between a front and an engine process",
    "leyline_agent.directives.remote_engine": "the directive backend over those ops",
    "leyline_agent.launch": "the one launcher of real servers, for tests and benchmarks",
}
HEAVY = {*TORCH, "vllm", "sglang", "fastapi", "starlette", "uvicorn"}


def test_the_shared_services_import_no_engine_and_no_web_framework(package):
    """One copy of each shared service, light enough for every server (and test) to import:
    no torch, no vLLM or SGLang, no web framework (``TYPE_CHECKING`` imports included)."""
    for name, what in SHARED_LIGHT.items():
        heavy = {i.target.split(".")[0] for i in package[name].imports} & HEAVY
        assert not heavy, f"{name} ({what}) imports {sorted(heavy)}"


PLUGIN_MAX_LINES = 2000  # vLLM's adaptation only: what is engine-neutral lives in directives/
PLUGIN_MAX_ANY_LINES = 30


def test_the_vllm_plugin_stays_an_adaptation():
    """``vllm_plugin/`` keeps only vLLM's adaptation (scheduler, worker, connector, rows,
    pins, the transport): at most ``PLUGIN_MAX_LINES`` lines, ``Any`` on at most
    ``PLUGIN_MAX_ANY_LINES`` of them. Past either, the new code is probably engine-neutral and
    belongs in ``directives/`` (or the plugin grew a second product again)."""
    files = sorted((SOURCES["leyline_agent"] / "vllm_plugin").glob("*.py"))
    lines = [line for f in files for line in f.read_text().splitlines()]
    per_file = {f.name: len(f.read_text().splitlines()) for f in files}
    assert len(lines) <= PLUGIN_MAX_LINES, f"vllm_plugin/ has {len(lines)} lines: {per_file}"
    with_any = [line for line in lines if re.search(r"\bAny\b", line)]
    assert len(with_any) <= PLUGIN_MAX_ANY_LINES, with_any


# ---- the checker itself -----------------------------------------------------------------
def _check(texts: dict[str, str]) -> list[str]:
    return check(parse_sources(texts))


def test_the_checker_finds_a_circle_through_a_lazy_import():
    found = _check(
        {
            "leyline_agent.engine.a": "from leyline_agent.engine import b\n",
            "leyline_agent.engine.b": "def f():\n    from leyline_agent.engine.a import x\n",
        }
    )
    assert found == ["import circle: leyline_agent.engine.a <-> leyline_agent.engine.b"]


def test_the_checker_finds_imports_against_the_layers():
    found = _check(
        {
            "leyline_agent.engine.a": "import leyline_agent.server.app\n",
            "leyline_agent.server.app": "",
            "leyline_agent.sglang_plugin.b": "from leyline_agent.engine.a import Engine\n",
            "leyline_agent.agent.c": "import torch\nfrom leyline_agent.engine import a\n",
            "leyline_agent.experiments.d": "from leyline_agent.testing.models import m\n",
            "leyline_agent.testing.models": "",
            "leyline_agent.errors": "from leyline_agent.directives.compile import render\n",
            "leyline_agent.directives.compile": "",
            "leyline_agent.trajectory": "from leyline_agent.directives import MessageEdit\n",
            "leyline_agent.directives.__init__": "from leyline_agent.directives.core import X\n",
            "leyline_agent.directives.core": "",
            "leyline_agent.wire": "from leyline_agent.directives.core import Directive\n",
            "leyline_agent.policies.p": "from leyline_agent.directives import MessageEdit\n",
        }
    )
    assert sorted(found) == sorted(
        [
            "leyline_agent.engine.a:1: the engine layer imports leyline_agent.server.app (server)",
            "leyline_agent.sglang_plugin.b:1: the sglang_plugin layer imports "
            "leyline_agent.engine.a (engine)",
            "leyline_agent.agent.c:1: the agent layer imports torch",
            "leyline_agent.agent.c:2: the agent layer imports leyline_agent.engine.a (engine)",
            "leyline_agent.experiments.d:1: imports leyline_agent.testing.models "
            "(test support) outside testing/",
            "leyline_agent.errors:1: the contracts layer imports "
            "leyline_agent.directives.compile (directives)",
            "leyline_agent.trajectory:1: the contracts layer imports "
            "leyline_agent.directives (directives)",
        ]
    )


def test_the_checker_finds_private_names_of_other_modules():
    found = _check(
        {
            "leyline_agent.engine.a": "from leyline_agent.engine.b import _hidden\n",
            "leyline_agent.engine.b": "_hidden = 1\n",
            "leyline_agent.engine.c": "import leyline_agent.engine.b as b\nb._hidden\n",
            "leyline_agent.engine.d": "from leyline_agent.engine import b\nb.__name__\n",
        }
    )
    assert sorted(found) == [
        "leyline_agent.engine.a:1: imports the private name _hidden of leyline_agent.engine.b",
        "leyline_agent.engine.c:2: uses leyline_agent.engine.b._hidden",
    ]


def test_the_checker_resolves_relative_imports():
    found = _check(
        {
            "leyline_agent.policies.__init__": "from .base import Policy\n",
            "leyline_agent.policies.base": "from ..engine import x\n",
            "leyline_agent.engine.__init__": "",
        }
    )
    assert found == [
        "leyline_agent.policies.base:1: the policies layer imports leyline_agent.engine (engine)"
    ]


def test_pyproject_lists_every_sub_package(package):
    """setuptools installs only the packages pyproject names: a new folder must be added."""
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    listed = set(config["tool"]["setuptools"]["packages"])
    found = {m.name for m in package.values() if m.is_package}
    assert found == listed, f"missing: {sorted(found - listed)}, extra: {sorted(listed - found)}"


RUNTIME_ONLY = ("torch", "triton", "transformers", "fastapi", "uvicorn", "safetensors")


def test_the_wrapper_installs_without_the_runtime():
    """``pip install leyline-agent`` (no extra) is the wrapper for a user with their own server:
    its core dependencies hold none of the runtime's, and the agent side imports with every
    runtime package made unimportable."""
    import subprocess
    import sys
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    core = {d.split("[")[0].split("=")[0].split(">")[0].split("<")[0].strip().lower()
            for d in config["project"]["dependencies"]}  # fmt: skip
    assert not core & set(RUNTIME_ONLY), core
    blocked = "; ".join(f"sys.modules[{m!r}] = None" for m in RUNTIME_ONLY)
    code = (
        f"import sys; {blocked}\n"
        "from leyline_agent import LeylineTransport, wrap_openai, HTTPRuntime, Directive\n"
        "from leyline_agent.policies import PolicyPipeline, load_policy\n"
        "PolicyPipeline([load_policy('stale-tool'), load_policy('failed-call')])\n"
        "print('wrapper ok')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "wrapper ok" in r.stdout, r.stderr[-2000:]
