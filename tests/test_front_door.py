"""`from tokenmind import LLM, SamplingParams, load_model` works, lazily, and every export is real."""

import subprocess
import sys

import tokenmind


def test_every_export_resolves():
    for name in tokenmind.__all__:
        assert getattr(tokenmind, name) is not None, name
    assert tokenmind.LLM.__module__ == "tokenmind.engine.llm"
    assert tokenmind.load_model.__module__ == "tokenmind.model.load"


def test_importing_the_package_does_not_import_torch():
    code = "import sys, tokenmind; assert 'torch' not in sys.modules; from tokenmind import SamplingParams; " \
           "assert 'torch' in sys.modules"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_an_unknown_name_is_an_attribute_error():
    try:
        tokenmind.no_such_thing
    except AttributeError as e:
        assert "no_such_thing" in str(e)
    else:
        raise AssertionError("expected AttributeError")
