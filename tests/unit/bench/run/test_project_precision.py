"""An fp32 layout stops at validation with the field named, not in a traceback from the trace."""

from bench.cli import main


def test_an_fp32_layout_is_refused_naming_the_precision(tmp_path, capsys):
    code = main(["project", "scenarios/smoke/e8-random-fp32.yaml", "--device", "h200-sxm", "--out", str(tmp_path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and "e8-random-fp32.yaml: precision: the trace prices bf16 and mxfp8 layouts" in err[0]
    assert list(tmp_path.iterdir()) == []
