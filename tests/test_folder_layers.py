"""The picture of the package by folder keeps the layer order: no folder imports from a folder above it, no
circle between folders, and a folder lies in one layer.

A node of the picture is a folder (a subpackage: dptrain.train, dptrain.strategies, dptrain.strategies.rules,
dptrain.bench, ...) or a module at the top of the package (dptrain.config, dptrain.costmodel, ...); the package
itself (dptrain/__init__.py) is one too. A folder's layer is the layer its own name is in, in the ```layers block
of docs/architecture.md; every module in it must be in that layer too, so that the folders show the layers. The
imports are tests/test_layers.py's (at module level or inside a function, and `registry.load` of a kind), each
drawn from the importer's folder to the imported one's; imports within one folder are not drawn.

tests/test_layers.py already forbids an upward import and a circle between modules; this is what it does not
see: a module of a folder kept in another layer (the cost model in bench/ was), and a circle made of imports
between folders that is no circle of modules (bench/'s commands -> config -> rules/auto -> bench/'s costmodel).
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

from test_layers import (ALLOWED, LAYERS, PACKAGE, ROOT, Import, imports_of, layer_of, make_package, modules_of,
                         read_layers, registry_kinds, violations)


def folder_of(module: str, modules: Mapping[str, Path], package: str) -> str:
    """The node `module` is drawn in: itself when it is a folder (a package) or a module at the top of `package`,
    else the folder holding it."""
    parent = module.rpartition(".")[0]
    if module == package or parent == package or modules[module].name == "__init__.py":
        return module
    return parent


def folders_of(modules: Mapping[str, Path], package: str) -> dict[str, list[str]]:
    """The modules of each node, by node."""
    folders: dict[str, list[str]] = {}
    for module in modules:
        folders.setdefault(folder_of(module, modules, package), []).append(module)
    return folders


def folder_imports(imports: list[Import], modules: Mapping[str, Path], package: str,
                   allowed: set[tuple[str, str]] = frozenset()) -> list[Import]:
    """Each import between two folders, drawn from folder to folder (its file and line kept: where it is)."""
    drawn = []
    for imp in imports:
        if (imp.importer, imp.imported) in allowed:
            continue
        importer, imported = folder_of(imp.importer, modules, package), folder_of(imp.imported, modules, package)
        if importer != imported:
            drawn.append(Import(importer, imported, imp.file, imp.line))
    return drawn


def folder_problems(modules: Mapping[str, Path], imports: list[Import], layers: list[tuple[str, list[str]]],
                    package: str, allowed: set[tuple[str, str]] = frozenset()) -> list[str]:
    """One line per module kept in a folder of another layer, then per folder that imports upward and per
    circle of folders (test_layers' checker, run on the picture by folder)."""
    problems = []
    for folder, members in sorted(folders_of(modules, package).items()):
        own = layer_of(folder, layers, package)
        for module in members:
            layer = layer_of(module, layers, package)
            if own is not None and layer is not None and layer != own:
                problems.append(f"{module} is in layer '{layers[layer][0]}' but its folder {folder} is in layer "
                                f"'{layers[own][0]}': give it a place of its own")
    drawn = folder_imports(imports, modules, package, allowed)
    return problems + [f"by folder: {line}" for line in violations(drawn, layers, folders_of(modules, package),
                                                                   package)]


# -- the rule on dptrain ----------------------------------------------------------------------------------------

def test_no_folder_imports_upward_or_in_a_circle_and_each_folder_is_one_layer():
    layers = read_layers((ROOT / "docs" / "architecture.md").read_text())
    modules = modules_of(ROOT / "src", PACKAGE)
    problems = folder_problems(modules, imports_of(modules, PACKAGE, registry_kinds()), layers, PACKAGE, ALLOWED)
    assert not problems, "the folders of src/dptrain do not show the layers:\n" + "\n".join(problems)


def test_the_picture_has_the_folders_and_top_modules_as_nodes():
    modules = modules_of(ROOT / "src", PACKAGE)
    folders = folders_of(modules, PACKAGE)
    assert {"dptrain", "dptrain.train", "dptrain.strategies", "dptrain.strategies.rules", "dptrain.bench",
            "dptrain.runtime", "dptrain.config", "dptrain.costmodel"} <= set(folders)
    assert "dptrain.strategies.rules.auto" in folders["dptrain.strategies.rules"]
    assert "dptrain.strategies.auto" in folders["dptrain.strategies"]
    assert folders["dptrain.config"] == ["dptrain.config"]


# -- the checker catches what it should -------------------------------------------------------------------------

def check(tmp_path: Path, files: dict[str, str], layers=LAYERS) -> list[str]:
    modules = make_package(tmp_path, files)
    return folder_problems(modules, imports_of(modules, "pkg"), layers, "pkg")


def test_imports_down_the_folders_pass(tmp_path):
    assert check(tmp_path, {"pkg/top.py": "import pkg.mid.a\n", "pkg/mid/a.py": "from pkg.low import x\n",
                            "pkg/mid/b.py": "from . import a\n", "pkg/low.py": "x = 1\n"}) == []


def test_a_module_kept_in_a_folder_of_another_layer_is_named(tmp_path):
    layers = [("top", ["pkg.top"]), ("middle", ["pkg.mid"]), ("inner", ["pkg.mid.inner"]), ("bottom", ["pkg"])]
    assert check(tmp_path, {"pkg/mid/a.py": "", "pkg/mid/inner.py": ""}, layers) == [
        "pkg.mid.inner is in layer 'inner' but its folder pkg.mid is in layer 'middle': give it a place of its own"]


def test_a_folder_importing_from_a_folder_above_is_named_where_it_imports(tmp_path):
    # The module pkg.mid.inner sits below pkg.low, so by module the import is downward; by folder it runs up.
    layers = [("top", ["pkg.top"]), ("middle", ["pkg.mid"]), ("inner", ["pkg.mid.inner"]), ("low", ["pkg.low"]),
              ("bottom", ["pkg"])]
    problems = check(tmp_path, {"pkg/mid/a.py": "", "pkg/mid/inner.py": "", "pkg/low.py": "import pkg.mid.inner\n"},
                     layers)
    assert problems == ["pkg.mid.inner is in layer 'inner' but its folder pkg.mid is in layer 'middle': give it a "
                        "place of its own",
                        f"by folder: {tmp_path / 'pkg/low.py'}:1: pkg.low -> pkg.mid imports upward: "
                        "layer 'low' imports from layer 'middle' above it"]


def test_a_circle_of_folders_that_is_no_circle_of_modules_is_named(tmp_path):
    layers = [("middle", ["pkg.mid", "pkg.one", "pkg.two"]), ("bottom", ["pkg"])]
    files = {"pkg/one/__init__.py": "", "pkg/one/a.py": "import pkg.two.c\n", "pkg/one/b.py": "",
             "pkg/two/__init__.py": "", "pkg/two/c.py": "", "pkg/two/d.py": "import pkg.one.b\n"}
    modules = make_package(tmp_path, files)
    assert violations(imports_of(modules, "pkg"), layers, modules, "pkg") == []  # by module: no circle
    assert check(tmp_path, files, layers) == [
        f"by folder: import cycle pkg.one -> pkg.two -> pkg.one ({tmp_path / 'pkg/one/a.py'}:1: pkg.one -> pkg.two; "
        f"{tmp_path / 'pkg/two/d.py'}:1: pkg.two -> pkg.one)"]
