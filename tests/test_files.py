"""mkc.files.import_generated: the one way a generated module is imported."""
from __future__ import annotations

import sys

import pytest

from mkc.files import import_generated

SOURCE = "import dataclasses\n\n@dataclasses.dataclass\nclass Dims:\n    vocab: int = HELPER\n"


def test_a_file_imports_under_its_stem_with_the_names_given_before_it_runs(tmp_path):
    path = tmp_path / "tiny_mini.py"
    path.write_text(SOURCE)
    module = import_generated(path, namespace={"HELPER": 7})
    assert module.__name__ == "tiny_mini" and module.Dims().vocab == 7
    assert "tiny_mini" not in sys.modules            # not registered unless asked


def test_a_source_imports_registered_and_a_failed_one_is_dropped():
    name = "mkc_test_files_registered"
    module = import_generated(source=SOURCE.replace("HELPER", "3"), name=name, register=True)
    try:
        assert sys.modules[name] is module and module.Dims().vocab == 3
        assert module.__file__.endswith(f"{name}.py")      # a file: tracebacks show its lines
    finally:
        sys.modules.pop(name, None)
    with pytest.raises(NameError, match="HELPER"):
        import_generated(source=SOURCE, name=name + "_broken", register=True)
    assert name + "_broken" not in sys.modules


def test_a_path_or_a_source():
    with pytest.raises(ValueError, match="a path or a source"):
        import_generated()
    with pytest.raises(ValueError, match="needs its name"):
        import_generated(source="X = 1")
