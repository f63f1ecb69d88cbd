"""Build the small bundled training corpus from the Python standard library's own documentation.

The text comes only from the running interpreter, so this works offline on any machine with
Python 3.11: the reference topics in `pydoc_data.topics` (what `help("if")` shows) and the
docstrings of the public standard-library modules, classes and functions. All of it is covered by
the PSF License Version 2. One document is one pydoc topic or one module's docs.

Usage:
    python scripts/build_corpus.py [--out_dir tests/assets/corpus]

Writes train.jsonl (every document except every 20th), validation.jsonl (every 20th document)
and README.md into the output directory. The output depends on the Python version and platform
(C modules document platform-specific functions), which the README records.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import inspect
import io
import json
import pkgutil
import platform
import re
import sys
import sysconfig
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT_DIR = REPO_ROOT / "tests" / "assets" / "corpus"
VALIDATION_EVERY = 20  # document i goes to validation when i % 20 == 19, about 5%
MIN_DOC_CHARS = 200  # modules with less text than this are mostly boilerplate

# Never imported: side effects on import (opening a browser, printing, starting a GUI), GUI
# toolkits, IDLE, and lib2to3, whose parser modules may write grammar pickles into the stdlib.
# Their docstrings are read from the source files with `ast` instead, which runs nothing.
READ_FROM_SOURCE = frozenset(
    {"antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo", "lib2to3"}
)
# Left out entirely: the test suite, and pydoc_data, whose topics are added one document each.
SKIP_MODULES = frozenset({"test", "pydoc_data"})
# Submodules left out wherever they appear; `__main__` modules run their program on import.
SKIP_SUBMODULE_NAMES = frozenset({"__main__", "test", "tests", "idle_test"})
# Codec modules are hundreds of generated, near-identical stubs; they would only add noise.
SKIP_PACKAGE_CHILDREN = frozenset({"encodings"})

# The base interpreter's library directories; inside a virtual environment "platstdlib" would
# otherwise point into the environment.
_BASE_PATHS = sysconfig.get_paths(
    vars={
        "base": sys.base_prefix,
        "platbase": sys.base_exec_prefix,
        "installed_base": sys.base_prefix,
    }
)
STDLIB_DIR = Path(_BASE_PATHS["stdlib"]).resolve()
_STDLIB_DIRS = tuple(str(Path(_BASE_PATHS[key]).resolve()) for key in ("stdlib", "platstdlib"))
_BLANK_LINES_RE = re.compile(r"\n{3,}")

# One module's docs before deduplication: (heading, normalized docstring) pairs in order; the
# module docstring itself has the heading "" (it goes right under the document's title).
Sections = list[tuple[str, str]]


def _is_public(name: str) -> bool:
    return not name.startswith("_")


def _is_documented_member(name: str) -> bool:
    """Public names and dunder methods (`__init__` often holds the constructor's docs)."""
    return _is_public(name) or (name.startswith("__") and name.endswith("__"))


def normalize_text(text: str) -> str:
    """Dedent, drop trailing spaces, and squeeze blank-line runs to one; paragraphs survive."""
    text = inspect.cleandoc(text.replace("\r\n", "\n").replace("\r", "\n"))
    text = "\n".join(line.rstrip() for line in text.split("\n"))
    return _BLANK_LINES_RE.sub("\n\n", text).strip()


# ---------------------------------------------------------------------------------------------
# Modules we import: docstrings read with `inspect`, which also covers C extension modules.


def _is_stdlib_module(module: ModuleType) -> bool:
    """True for built-in modules and modules whose file lives in the standard library.

    This rejects modules that site-packages shadows, e.g. setuptools' `distutils`, whose text
    is not covered by the PSF licence.
    """
    file = getattr(module, "__file__", None)
    if file is None:
        return module.__name__ in sys.builtin_module_names
    resolved = str(Path(file).resolve())
    return resolved.startswith(_STDLIB_DIRS) and "site-packages" not in resolved


def _import_quietly(name: str) -> ModuleType | None:
    """Import `name`, or None if it fails (wrong platform, missing optional library, ...)."""
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            return importlib.import_module(name)
        except (Exception, SystemExit):
            return None


def iter_stdlib_modules() -> Iterator[ModuleType]:
    """Importable public standard-library modules and their public submodules."""
    pending = sorted(
        name
        for name in sys.stdlib_module_names
        if _is_public(name) and name not in SKIP_MODULES | READ_FROM_SOURCE
    )
    seen: set[str] = set()
    while pending:
        name = pending.pop(0)
        if name in seen:
            continue
        seen.add(name)
        module = _import_quietly(name)
        if module is None or not _is_stdlib_module(module):
            continue
        yield module
        if hasattr(module, "__path__") and name not in SKIP_PACKAGE_CHILDREN:
            pending += [
                f"{name}.{info.name}"
                for info in pkgutil.iter_modules(module.__path__)
                if _is_public(info.name) and info.name not in SKIP_SUBMODULE_NAMES
            ]


def _own_doc(obj: object) -> str | None:
    """The object's own docstring (never one inherited from a base class), normalized."""
    doc = getattr(obj, "__doc__", None)
    if not isinstance(doc, str):
        return None
    return normalize_text(doc) or None


def _documented_here(module: ModuleType, name: str, obj: object) -> bool:
    """Whether `module` is the place to document `obj`: it is defined here, listed in
    `__all__`, or comes from a private accelerator module (`_io` for `io`, ...)."""
    if not (inspect.isclass(obj) or inspect.isroutine(obj)):
        return False
    if name in getattr(module, "__all__", ()):
        return True
    origin = getattr(obj, "__module__", None)
    if not isinstance(origin, str):
        return False
    return origin == module.__name__ or any(part.startswith("_") for part in origin.split("."))


def _class_members(cls: type) -> Iterator[tuple[str, object]]:
    """Public methods and properties, and dunder methods written in Python (C types' dunders
    carry only generic slot docs such as "Return self+value.")."""
    for name, member in sorted(vars(cls).items()):
        if _is_public(name):
            if inspect.isroutine(member) or inspect.isdatadescriptor(member):
                yield name, member
        elif _is_documented_member(name) and inspect.isfunction(member):
            yield name, member


def module_sections(module: ModuleType) -> Sections:
    """An imported module's docstring, then its public classes (with their members) and
    functions, each under a heading."""
    sections: Sections = []

    def add(heading: str, obj: object) -> None:
        doc = _own_doc(obj)
        if doc is not None:
            sections.append((heading, doc))

    add("", module)
    for name, obj in sorted(vars(module).items()):
        if not _is_public(name) or not _documented_here(module, name, obj):
            continue
        if inspect.isclass(obj):
            add(f"## class {module.__name__}.{name}", obj)
            for member_name, member in _class_members(obj):
                add(f"### {name}.{member_name}", member)
        else:
            add(f"## {module.__name__}.{name}", obj)
    return sections


# ---------------------------------------------------------------------------------------------
# Modules we must not import: docstrings read from the source with `ast`, same layout.


def iter_source_modules() -> Iterator[tuple[str, Path]]:
    """(dotted name, source file) of the public modules in READ_FROM_SOURCE."""
    for top in sorted(READ_FROM_SOURCE):
        package_dir = STDLIB_DIR / top
        files = sorted(package_dir.rglob("*.py")) if package_dir.is_dir() else []
        if not files and (STDLIB_DIR / f"{top}.py").is_file():
            files = [STDLIB_DIR / f"{top}.py"]
        for file in files:
            parts = list(file.relative_to(STDLIB_DIR).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            if any(not _is_public(p) or p in SKIP_SUBMODULE_NAMES for p in parts):
                continue
            yield ".".join(parts), file


def source_sections(name: str, file: Path) -> Sections:
    """Like `module_sections`, for a module parsed from its source file."""
    try:
        tree = ast.parse(file.read_text(encoding="utf-8"), filename=str(file))
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return []
    sections: Sections = []

    def add(heading: str, node: ast.AST) -> None:
        doc = ast.get_docstring(node, clean=False)
        if doc and (doc := normalize_text(doc)):
            sections.append((heading, doc))

    add("", tree)
    definitions = (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    for node in sorted(
        (n for n in tree.body if isinstance(n, definitions) and _is_public(n.name)),
        key=lambda n: n.name,
    ):
        if isinstance(node, ast.ClassDef):
            add(f"## class {name}.{node.name}", node)
            members = [
                n
                for n in node.body
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                and _is_documented_member(n.name)
            ]
            for member in sorted(members, key=lambda n: n.name):
                add(f"### {node.name}.{member.name}", member)
        else:
            add(f"## {name}.{node.name}", node)
    return sections


# ---------------------------------------------------------------------------------------------
# Assembly.


def topic_documents() -> list[str]:
    """The language-reference topics behind `help("keyword")`, sorted by topic name."""
    from pydoc_data.topics import topics

    return [text for key in sorted(topics) if (text := normalize_text(topics[key]))]


def build_documents() -> list[str]:
    """All documents in their fixed order: pydoc topics by name, then modules by dotted name.

    Each docstring is kept only at its first occurrence in that order; a module left with less
    than MIN_DOC_CHARS of text is dropped.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecated modules warn on import and attribute access
        modules = {module.__name__: module_sections(module) for module in iter_stdlib_modules()}
    for name, file in iter_source_modules():
        modules[name] = source_sections(name, file)

    documents: list[str] = []
    seen: set[str] = set()
    for text in topic_documents():
        if text not in seen:
            seen.add(text)
            documents.append(text)
    for name in sorted(modules):
        kept = []
        for heading, doc in modules[name]:
            if doc not in seen:
                seen.add(doc)
                kept.append(f"{heading}\n\n{doc}" if heading else doc)
        if sum(len(k) for k in kept) >= MIN_DOC_CHARS:
            documents.append("\n\n".join([f"# Module {name}", *kept]))
    return documents


def write_jsonl(path: Path, texts: list[str]) -> None:
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for text in texts:
            f.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")


def _readme(train: list[str], validation: list[str]) -> str:
    def stats(texts: list[str]) -> str:
        chars = sum(len(t) for t in texts)
        nbytes = sum(len(t.encode("utf-8")) for t in texts)
        return f"{len(texts)} documents, {chars:,} characters, {nbytes:,} UTF-8 bytes"

    python = f"Python {platform.python_version()} ({platform.system()} {platform.machine()})"
    return f"""# Bundled training corpus

A small English corpus for tests, examples and CPU smoke runs, made offline from the Python
standard library's own documentation:

- the language-reference topics of `pydoc_data.topics` (the text `help("if")` shows), and
- the docstrings of the public standard-library modules: each module's docstring followed by the
  docstrings of its public classes (with their public methods and properties) and functions,
  under simple headings.

One document is one topic or one module. Modules that must not be imported (side effects on
import, GUI toolkits, IDLE) are read from their source files with `ast` instead:
{", ".join(f"`{name}`" for name in sorted(READ_FROM_SOURCE))}.
Private modules and names, test packages, the generated codec modules of `encodings`, modules
that fail to import, and modules shadowed from site-packages are left out. Identical docstrings
are kept only once; whitespace is lightly normalized (dedented, trailing spaces dropped,
blank-line runs squeezed; paragraphs kept).

## Files

One JSON object per line, `{{"text": ...}}`:

- `train.jsonl`: {stats(train)}
- `validation.jsonl`: {stats(validation)}; every {VALIDATION_EVERY}th document

## How it was made

    python scripts/build_corpus.py

built with {python}. The script reads the standard library of the interpreter
that runs it, so other Python versions or platforms give slightly different text; document order
and the split are deterministic for a given interpreter.

## Licence

The text is taken from Python's documentation and source, copyright Python Software Foundation,
and is distributed under the PSF License Version 2 (PYTHON SOFTWARE FOUNDATION LICENSE VERSION 2).
The full licence text is Python's own LICENSE file: `LICENSE.txt` in the standard-library
directory of every Python installation (`python -c "import sysconfig;
print(sysconfig.get_paths()['stdlib'])"`), and `LICENSE` in the CPython source tree.
"""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out_dir",
        type=Path,
        default=DEFAULT_OUT_DIR,
        help="directory for train.jsonl, validation.jsonl and README.md",
    )
    args = parser.parse_args(argv)

    start = time.perf_counter()
    documents = build_documents()
    train = [d for i, d in enumerate(documents) if i % VALIDATION_EVERY != VALIDATION_EVERY - 1]
    validation = [
        d for i, d in enumerate(documents) if i % VALIDATION_EVERY == VALIDATION_EVERY - 1
    ]
    args.out_dir.mkdir(parents=True, exist_ok=True)
    write_jsonl(args.out_dir / "train.jsonl", train)
    write_jsonl(args.out_dir / "validation.jsonl", validation)
    (args.out_dir / "README.md").write_text(_readme(train, validation), encoding="utf-8")
    total_mb = sum(len(d.encode("utf-8")) for d in documents) / 1e6
    print(
        f"wrote {len(train)} train + {len(validation)} validation documents "
        f"({total_mb:.2f} MB) to {args.out_dir} in {time.perf_counter() - start:.1f}s"
    )


if __name__ == "__main__":
    main()
