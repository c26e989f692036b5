"""The code's shape (docs/architecture.md): imports point one way, with no circle, and records are
written only through the record module."""

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = {"ring": "commlens.ring", "hooks": "commlens.hooks", "agent": "commlens.agent", "exporters": "commlens.exporters"}


def _modules() -> dict[str, pathlib.Path]:
    """Every module of the packages, subpackages' too (a package by its ``__init__``)."""
    found = {}
    for folder, package in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = [part for part in path.relative_to(ROOT / folder).with_suffix("").parts if part != "__init__"]
            found[".".join((package, *parts))] = path
    return found


def _imports(name: str, path: pathlib.Path) -> set[str]:
    """The commlens modules ``name`` imports, at any depth of its code (lazy imports too)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    modules, found = _modules(), set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):  # from a module: it; from a package: its modules named, or itself
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            base = ".".join(filter(None, (base, node.module)))
            named = {f"{base}.{alias.name}" for alias in node.names}
            found.update(named & modules.keys() or ({base} if node.module else set()))
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {module for module in found if module in modules and module != name}


def test_imports_point_one_way_and_never_in_a_circle():
    modules = _modules()
    graph = {name: _imports(name, path) for name, path in modules.items()}
    assert graph["commlens.agent.runtime"] >= {"commlens.agent.pipeline", "commlens.hooks.process_ring"}, graph
    assert graph["commlens.agent.verdicts.detectors"] >= {"commlens.agent.verdicts.facts", "commlens.agent.verdicts.catalogue"}
    contract = {"commlens.ring.layout", "commlens.ring.codec", "commlens.ring.ops"}
    for name, imported in graph.items():
        if name.startswith("commlens.ring"):  # the ring: nothing but its own; its contract nothing at all
            assert all(m.startswith("commlens.ring") for m in imported), (name, imported)
            assert not (imported if name in contract else set()), (name, imported)
        if name.startswith("commlens.hooks"):  # the training thread: itself and the ring, no reader of it
            assert all(m.startswith(("commlens.hooks", "commlens.ring")) for m in imported), (name, imported)
            assert "commlens.ring.reader" not in imported, (name, imported)
        if name.startswith("commlens.exporters."):  # the ring's contract, nothing that runs hooks
            assert imported <= {m for m in modules if m.startswith("commlens.exporters.")} | contract, (name, imported)
        wing = _wing(name)  # the agent's runtime imports neither wing; the verdicts nothing of the agent's but theirs
        if wing == "runtime":
            assert not {_wing(m) for m in imported} & {"verdicts", "cli"}, (name, imported)
        if wing == "verdicts":
            assert {_wing(m) for m in imported} <= {"verdicts", None}, (name, imported)
    visiting, done = [], set()

    def visit(name):
        assert name not in visiting, f"an import circle: {' -> '.join(visiting[visiting.index(name):] + [name])}"
        if name in done:
            return
        visiting.append(name)
        for other in graph[name]:
            visit(other)
        visiting.pop()
        done.add(name)

    for name in graph:
        visit(name)


def _wing(module: str) -> str | None:
    """The agent's part a module belongs to: ``verdicts``, ``cli`` or ``runtime`` (its package's lazy names
    are the runtime's); None: not the agent's."""
    if module == "commlens.agent":
        return "runtime"
    if not module.startswith("commlens.agent."):
        return None
    part = module.split(".")[2]
    return part if part in ("verdicts", "cli") else "runtime"


def test_records_are_written_only_through_the_record_module():
    positional = re.compile(r"\bwrite\((START|END|GPU_START|NAN|SNAPSHOT)\b")
    writers = [path.relative_to(ROOT) for folder in ("ring", "hooks", "agent", "exporters", "bench")
               for path in sorted((ROOT / folder).rglob("*.py")) if positional.search(path.read_text())]
    assert writers == [pathlib.Path("hooks/record.py")], writers


def test_the_c_record_is_the_python_record_field_for_field_and_code_for_code():
    """``ring/_record.h`` and ``ring/layout.py`` are one contract: the struct's fields in ``RECORD``'s
    order and widths, and every kind, status and flag the same number on both sides."""
    from commlens.ring import layout

    header = (ROOT / "ring/_record.h").read_text()
    struct = re.search(r"typedef struct \{(.*?)\} record_t;", header, re.S).group(1)
    widths = {"uint64_t": "Q", "uint32_t": "I", "int32_t": "i", "uint8_t": "B"}
    fields = [(name, widths[ctype]) for ctype, names in re.findall(r"(\w+) ([\w, ]+);", struct)
              for name in names.replace(" ", "").split(",")]
    assert [name for name, _ in fields] == list(layout.Record._fields), fields
    assert "<" + "".join(code for _, code in fields) == layout.RECORD.format
    codes = dict((name, int(value)) for name, value in re.findall(r"\b([A-Z][A-Z_0-9]+) = (\d+)", header))
    python = {f"KIND_{name}": getattr(layout, name) for name in ("START", "END", "NAN", "GPU_START", "SNAPSHOT", "LOSS_SCALE",
                                                               "FINGERPRINT")}
    python |= {f"STATUS_{status.upper()}": i for i, status in enumerate(layout.STATUS)}
    python |= {name: getattr(layout, name) for name in ("NAN_OUTPUT", "NAN_HAS_NAN", "NAN_HAS_INF", "FLAG_ASYNC",
                                                         "FLAG_LAST_BUCKET", "BUCKET_BITS")}
    assert codes == python


def test_c_and_cpp_write_records_and_set_the_issuing_flag_each_in_one_place():
    """One hot-path contract across the languages: C builds records only through ``_record.h``'s builders
    (in ``_all_reduce.c``), C++ only in ``_gpu.cpp`` (its GPU_START, from the fields Python built);
    the issuing flag is set by one file a language; and no module's namespace is handed to C."""
    sources = {path.relative_to(ROOT).as_posix(): path.read_text()
               for folder in ("ring", "hooks") for pattern in ("*.c", "*.cpp", "*.h", "*.py")
               for path in sorted((ROOT / folder).glob(pattern))}
    built = re.compile(r"\[11\]\s*=\s*\{|\bv\[0\]\s*=|_fields\(\w+,|\[0\] = GPU_START")
    builders = sorted(path for path, text in sources.items() if built.search(text) and not path.endswith(".py"))
    assert builders == ["hooks/_all_reduce.c", "hooks/_gpu.cpp", "ring/_record.h"], builders
    assert not re.search(r"\[11\]\s*=\s*\{|\bv\[0\]\s*=", sources["hooks/_all_reduce.c"])  # the builders, not by hand
    setting = sorted(path for path, text in sources.items() if re.search(r"\b(issuing_set|set_issuing)\(", text))
    assert setting == ["hooks/_all_reduce.c", "hooks/_ddp_hook.cpp", "hooks/_issuing.c", "hooks/issuing.py"], setting
    assert [path for path, text in sources.items() if path.endswith(".py") and "vars(" in text] == []
