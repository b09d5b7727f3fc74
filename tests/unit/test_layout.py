"""The layout's rules that a reader relies on, checked by reading the sources (no model needed)."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# `name._private` where name is not self or cls: another object's private attribute
PRIVATE_REACH = re.compile(r"\b(?!self\b|cls\b)([A-Za-z_]\w*)\._([a-z]\w*)\b")
# each allowed reach, and why it is not one module reaching into another's object
ALLOWED = {
    ("tests/support/engine_view.py", "llm._engine"): "the one support module through which tests read the engine",
    ("src/h2o_local/policies.py", "value._adopt"): "a Policy classmethod on a Policy it just made",
    ("src/h2o_local/llama.py", "llm._engine"): "a Llama classmethod (for_kv_limit) on a Llama it just made",
    ("experiments/perhead.py", "other._evict"): "a method of the class on a copy of its own instance",
    ("src/h2o_local/grammar.py", "_llama_grammar._build_repetition"): "our vendored copy of llama.cpp's converter",
    ("tests/api/test_state_machine.py", "machine._chat"): "the test's own state machine",
}


def test_no_module_reaches_into_another_modules_private_names():
    found = []
    for folder in ("src", "benchmarks", "experiments", "tests", "scripts"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if path == Path(__file__).resolve():
                continue
            for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                code = line.split("#", 1)[0]
                for m in PRIVATE_REACH.finditer(code):
                    name, attr = m.group(1), m.group(2)
                    if name == "h2o_local":
                        continue  # the package's own modules (h2o_local._engine, the extension)
                    reach = f"{name}._{attr}"
                    if (rel, reach) not in ALLOWED and not code.lstrip().startswith(("from ", "import ", '"""')):
                        found.append(f"{rel}:{n}: {reach}")
    assert not found, "private names reached across modules:\n" + "\n".join(found)


# `from x import _name`: a private name imported from another module (the attribute-reach rule above misses it)
PRIVATE_IMPORT = re.compile(r"^\s*from\s+[\w.]+\s+import\s+(?:\(\s*)?([^#\n]*)")
COMPILED_MODULES = {"_engine", "_llama_grammar"}  # the C++ extension and the vendored converter: modules, not names


def test_no_module_imports_another_modules_private_names():
    found = []
    for folder in ("src", "benchmarks", "experiments", "tests", "scripts"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                m = PRIVATE_IMPORT.match(line)
                if not m:
                    continue
                names = [part.strip().split(" as ")[0] for part in m.group(1).rstrip("\\)").split(",")]
                private = [x for x in names if x.startswith("_") and not x.startswith("__")
                           and x not in COMPILED_MODULES]
                if private:
                    found.append(f"{rel}:{n}: {', '.join(private)}")
    assert not found, "private names imported across modules:\n" + "\n".join(found)


# the package's import cycles that are left (type-only imports of Llama and of the server's state; issue 72, item 1):
# no other may appear, and these may only shrink
KNOWN_CYCLES = [
    {"h2o_local.llama", "h2o_local.completions", "h2o_local.llama_cpp_python"},
    {"h2o_local.server.routes", "h2o_local.server.requests", "h2o_local.server.state", "h2o_local.server.embeddings"},
]


def package_imports():
    """Module -> the package's modules it imports anywhere in its text (inside functions and TYPE_CHECKING too);
    a module's import of its own package (`from . import x` in __init__) is left out."""
    import ast

    src = ROOT / "src"
    modules = {}
    for path in (src / "h2o_local").rglob("*.py"):
        name = ".".join(path.relative_to(src).with_suffix("").parts)
        modules[name.removesuffix(".__init__")] = path
    graph = {m: set() for m in modules}
    for m, path in modules.items():
        package = m if path.name == "__init__.py" else m.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets = []
            if isinstance(node, ast.ImportFrom):
                base = package.split(".")[:len(package.split(".")) - node.level + 1] if node.level else []
                target = ".".join(base + ([node.module] if node.module else [])) if node.level else node.module or ""
                targets = [f"{target}.{a.name}" if f"{target}.{a.name}" in modules else target for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            graph[m] |= {t for t in targets if t in modules and t != m and not m.startswith(t + ".")}
    return graph


def test_the_package_has_no_new_import_cycle():
    graph = package_imports()
    reach = {}
    for start in graph:
        seen, todo = set(), [start]
        while todo:
            for nxt in graph[todo.pop()]:
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        reach[start] = seen
    cycles = {frozenset(m for m in graph if m in reach[start] and start in reach[m]) | {start}
              for start in graph if start in reach[start]}
    for cycle in cycles:
        assert any(cycle <= known for known in KNOWN_CYCLES), f"an import cycle: {sorted(cycle)}"
