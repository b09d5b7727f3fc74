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
