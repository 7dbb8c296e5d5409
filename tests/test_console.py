"""jaxllm.console: what the CLIs print for a Python warning."""

import io
import warnings

import pytest

from jaxllm.console import use_one_line_warnings


@pytest.fixture
def one_line(monkeypatch):
    monkeypatch.setattr(warnings, "showwarning", warnings.showwarning)  # restored after the test
    use_one_line_warnings()


def test_a_warning_is_one_line_with_its_category_unless_a_user_warning(one_line, capsys):
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.warn("checkpoint 4 not restored;\n  restored 3", UserWarning, stacklevel=1)
        warnings.warn("old API", DeprecationWarning, stacklevel=1)
    assert capsys.readouterr().err == (
        "warning: checkpoint 4 not restored; restored 3\nwarning (DeprecationWarning): old API\n"
    )


def test_a_closed_stream_drops_the_warning_as_python_does(one_line):
    class Broken(io.StringIO):
        def write(self, s):
            raise BrokenPipeError("reader exited")

    warnings.showwarning("lost", UserWarning, "f.py", 1, file=Broken())  # no exception
