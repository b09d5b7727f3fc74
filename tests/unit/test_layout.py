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


# the package's import cycles that are left (type-only imports of Llama; issue 72, item 1): no other may appear, and
# these may only shrink
KNOWN_CYCLES = [
    {"h2o_local.llama", "h2o_local.completions", "h2o_local.llama_cpp_python"},
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


# the server's route modules, one per API dialect: each imports what they share (server/answers.py), never another
ROUTE_MODULES = {"routes", "ollama", "anthropic_messages", "openai_responses", "embeddings"}


def test_no_route_module_imports_another():
    graph = package_imports()
    found = [f"{m} imports {t}" for m in sorted(graph) for t in sorted(graph[m])
             if m.startswith("h2o_local.server.") and t.startswith("h2o_local.server.")
             and m.rsplit(".", 1)[1] in ROUTE_MODULES and t.rsplit(".", 1)[1] in ROUTE_MODULES]
    assert not found, "route modules importing each other:\n" + "\n".join(found)


# no function body over this many lines (llama.cpp's small functions named for what they do); the bindings' module
# is one table of what Python sees
MAX_FUNCTION_LINES = 80
LONG_FUNCTIONS_ALLOWED = {("cpp/bindings.cpp", "PYBIND11_MODULE")}
CPP_NOT_A_FUNCTION = re.compile(r"(namespace|struct|class|enum|extern|union|using|typedef|template|static_assert)\b")


def cpp_function_lengths(path):
    """(name, lines) of each function defined at column 0 (llama.cpp's style, no indent inside a namespace): from
    the line that opens its body to its closing brace at column 0; a function defined inside a class body counts
    within it only when it is itself at column 0 (short inline members are not)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    out, i = [], 0
    while i < len(lines):
        line = lines[i]
        if (line[:1].isalpha() or line[:1] in "_~") and "(" in line and not CPP_NOT_A_FUNCTION.match(line):
            j = i
            while j < len(lines) and not lines[j].rstrip().endswith(("{", ";")):
                j += 1
            if j < len(lines) and lines[j].rstrip().endswith("{") and not lines[j].rstrip().endswith("= {"):
                k = j + 1
                while k < len(lines) and not lines[k].startswith("}"):
                    k += 1
                name = re.search(r"([\w:~]+)\s*\(", line)
                out.append((name.group(1) if name else line.strip(), k - j + 1))
                i = k
        i += 1
    return out


def python_function_lengths(path):
    """(name, lines) of each function: from its body's first statement after the docstring (a long explicit
    signature is not logic) to its last line."""
    import ast

    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if len(body) > 1 and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                body = body[1:]
            out.append((node.name, node.end_lineno - body[0].lineno + 1))
    return out


def test_no_function_is_longer_than_80_lines():
    found = []
    for path in sorted((ROOT / "cpp").rglob("*.[ch]*")) + sorted((ROOT / "src").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        lengths = python_function_lengths(path) if path.suffix == ".py" else cpp_function_lengths(path)
        found += [f"{rel}: {name} ({n} lines)" for name, n in lengths
                  if n > MAX_FUNCTION_LINES and (rel, name) not in LONG_FUNCTIONS_ALLOWED]
    assert not found, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(found)


def test_the_function_length_rule_sees_long_functions(tmp_path):
    """The rule's readers find what they measure (a rule that can see nothing cannot fail)."""
    cpp = tmp_path / "a.cpp"
    cpp.write_text("namespace h2o {\n\nvoid Engine::decode(int a,\n                    int b) {\n" + "    x();\n" * 90
                   + "}\n\nint f() {\n    return 1;\n}\n\n} // namespace h2o\n")
    assert cpp_function_lengths(cpp) == [("Engine::decode", 92), ("f", 3)]
    py = tmp_path / "a.py"
    py.write_text('def g(\n    a,\n):\n    """doc."""\n' + "    a += 1\n" * 85 + "\n\ndef h():\n    return 1\n")
    assert python_function_lengths(py) == [("g", 85), ("h", 1)]


def test_tests_read_the_engine_through_named_views_only():
    """engine_view has one function per fact; none hands out the engine itself (a raw handle lets a test read
    anything below the surface, unnamed)."""
    import ast

    path = ROOT / "tests" / "support" / "engine_view.py"
    raw = [node.lineno for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
           if isinstance(node, ast.Return) and isinstance(node.value, ast.Attribute) and node.value.attr == "_engine"]
    assert not raw, f"engine_view hands out the engine at lines {raw}"
