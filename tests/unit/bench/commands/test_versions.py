"""bench.commands.versions: ``moe-bench versions`` hands its options on, prints the table, passes the exit code."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.ab.images import VersionsError
from bench.cli import main
from bench.commands import versions


@pytest.mark.parametrize("code", [0, 1])
def test_the_table_is_printed_and_the_comparisons_exit_code_returned(monkeypatch, capsys, code):
    calls = []

    def fake_run_versions(images, suite, out, gpus):
        calls.append((images, suite, out, gpus))
        return code, "image  verdict\nA      pass\n"

    monkeypatch.setattr(versions, "run_versions", fake_run_versions)
    assert main(["versions", "img:a", "img:b", "--suite", "ci", "--out", "somewhere", "--gpus", "none"]) == code
    assert calls == [(["img:a", "img:b"], "ci", Path("somewhere"), "none")]
    assert capsys.readouterr().out == "image  verdict\nA      pass\n"


def test_defaults(monkeypatch):
    calls = []

    def fake_run_versions(*args):
        calls.append(args)
        return 0, ""

    monkeypatch.setattr(versions, "run_versions", fake_run_versions)
    assert main(["versions", "a", "b"]) == 0
    assert calls == [(["a", "b"], "default", Path("results"), "auto")]


def test_an_unusable_image_or_engine_is_bad_input(monkeypatch, capsys):
    def refuse(images, suite, out, gpus):
        raise VersionsError("an image is listed twice")

    monkeypatch.setattr(versions, "run_versions", refuse)
    assert main(["versions", "a", "a"]) == 2
    assert capsys.readouterr() == ("", "moe-bench: error: an image is listed twice\n")
