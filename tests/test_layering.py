"""The import graph of ``kvquant_jax`` and ``pallas_kernels`` follows the layer order documented in
docs/architecture.md ("Layers"): every import (module level AND inside functions, read from the AST) goes to a
strictly lower layer or stays inside its own unit; there are no import cycles between modules; and a function-level
import is left only for an optional heavy dependency, each with its reason below."""
from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("kvquant_jax", "pallas_kernels")

# Third-party modules that may be imported inside a function: optional or heavy, needed by one path only.
LAZY_DEPENDENCIES = {
    "orbax": "Orbax checkpointing is a slow import, needed only to save / restore artifacts",
    "optax": "the optimizer library is needed only by IntactKV calibration",
    "tqdm": "progress bars are optional (only with progress=True)",
    "matplotlib": "plots are optional (report figures only)",
    "gguf": "the GGUF reader is needed only to load a .gguf model",
    "tokenizers": "the HF tokenizer library is needed only to load a tokenizer",
    "safetensors": "needed only to load a safetensors model folder",
    "jinja2": "chat templates render only when a model ships one",
    "yaml": "YAML is read only by the config / manifest paths that ask for it",
    "pydoc_data": "the built-in fallback corpus is read only when no WikiText-2 is found",
    "torch": "optional cross-check dependency",
    "fcntl": "POSIX file locks, imported where a sweep directory is locked (the package still imports elsewhere)",
    "jax._src.cudnn": "cuDNN fused attention with float32 softmax statistics (private JAX API), imported only "
                      "when a GPU prefill is traced",
    "jax.experimental.pallas.triton": "the GPU Pallas backend is imported only when lowering for a GPU",
    "jax.experimental.pallas.tpu": "the TPU Pallas backend is imported only when lowering for a TPU",
    "jax.experimental.pallas.mosaic_gpu": "the Mosaic GPU backend is imported only when lowering for it",
}

# Project imports that still break a rule, each with its reason.  Keys: (file, imported module).
ALLOWED = {
}
# The CLI entry point answers `kvq --help` and argument errors without importing JAX: its command bodies import
# what they run.
LAZY_FILES = {"kvquant_jax/cli.py": "entry point: `kvq --help` and argument errors do not import JAX"}


def _doc_layers() -> list[set[str]]:
    text = (REPO / "docs" / "architecture.md").read_text()
    m = re.search(r"```layers\n(.*?)```", text, re.S)
    assert m, "docs/architecture.md has no ```layers block"
    return [set(line.split()) for line in m.group(1).splitlines() if line.strip()]


def _unit(module: str) -> str:
    """The layer unit of a dotted module: a sub-package or top-level module of kvquant_jax, or pallas_kernels."""
    parts = module.split(".")
    if parts[0] == "pallas_kernels":
        return "pallas_kernels"
    return parts[1] if len(parts) > 1 else "kvquant_jax"


def _modules():
    for pkg in PACKAGES:
        for f in sorted((REPO / pkg).rglob("*.py")):
            rel = f.relative_to(REPO)
            mod = ".".join(rel.with_suffix("").parts)
            yield str(rel), mod.removesuffix(".__init__"), ast.parse(f.read_text())


def _imports(tree):
    """``(module, function_level)`` for every import statement; ``from pkg import name`` yields ``pkg.name`` when
    that is a module of the tree."""
    top = {id(n) for n in tree.body}
    for n in tree.body:                       # module-level try/if blocks (version shims) are module level
        if isinstance(n, (ast.Try, ast.If)):
            top |= {id(m) for m in ast.walk(n)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, id(node) not in top
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for a in node.names:
                sub = f"{node.module}.{a.name}"          # a submodule, or (third party) maybe one
                full = sub if _is_module(sub) or not _project(node.module) else node.module
                yield full, id(node) not in top


def _is_module(mod: str) -> bool:
    p = REPO.joinpath(*mod.split("."))
    return p.with_suffix(".py").exists() or (p / "__init__.py").exists()


def _project(mod: str) -> bool:
    return mod.split(".")[0] in PACKAGES


def test_every_unit_has_a_documented_layer():
    layers = _doc_layers()
    documented = set().union(*layers)
    units = {_unit(mod) for _, mod, _ in _modules()} - {"kvquant_jax"}
    assert units <= documented, f"units missing from docs/architecture.md's layers: {sorted(units - documented)}"


def test_no_import_reaches_up_or_sideways():
    rank = {u: i for i, layer in enumerate(_doc_layers()) for u in layer}
    bad = []
    for rel, mod, tree in _modules():
        src = _unit(mod)
        for target, _ in _imports(tree):
            if not _project(target) or (rel, target) in ALLOWED or _unit(target) in (src, "kvquant_jax"):
                continue
            dst = _unit(target)
            if src != "kvquant_jax" and rank[dst] >= rank[src]:
                bad.append(f"{rel}: imports {target} ({dst}, layer {rank[dst]} >= {src}, layer {rank[src]})")
    assert not bad, "imports against the documented layer order:\n" + "\n".join(bad)


def test_function_level_imports_only_for_optional_heavy_dependencies():
    bad = []
    for rel, _, tree in _modules():
        if rel in LAZY_FILES:
            continue
        for target, lazy in _imports(tree):
            if not lazy or (rel, target) in ALLOWED:
                continue
            if not _project(target) and any(target == d or target.startswith(d + ".") for d in LAZY_DEPENDENCIES):
                continue
            bad.append(f"{rel}: function-level import of {target}")
    assert not bad, "function-level imports (hoist them, or name the optional dependency):\n" + "\n".join(bad)


def test_no_import_cycles_between_modules():
    graph = defaultdict(set)
    names = {mod for _, mod, _ in _modules()}
    for rel, mod, tree in _modules():
        for target, _ in _imports(tree):
            if target in names and target != mod and (rel, target) not in ALLOWED:
                graph[mod].add(target)
    state, cycles = {}, []

    def visit(m, path):
        state[m] = 1
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                cycles.append(" -> ".join(path[path.index(t):] + [t]) if t in path else f"{m} -> {t}")
            elif t not in state:
                visit(t, path + [t])
        state[m] = 2

    for m in sorted(names):
        if m not in state:
            visit(m, [m])
    # a package's __init__ importing its own submodules (and them importing the package) is not a cycle of code
    cycles = [c for c in cycles if not _package_face_only(c)]
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def _package_face_only(cycle: str) -> bool:
    mods = cycle.split(" -> ")
    return any(_is_package(m) for m in mods)


def _is_package(mod: str) -> bool:
    return (REPO.joinpath(*mod.split(".")) / "__init__.py").exists()


def test_allow_lists_name_real_imports():
    """Every allow-list entry still matches an import (remove entries when their reason is gone)."""
    seen = {(rel, target) for rel, _, tree in _modules() for target, _ in _imports(tree)}
    stale = sorted(k for k in ALLOWED if k not in seen)
    assert not stale, f"stale allow-list entries: {stale}"
