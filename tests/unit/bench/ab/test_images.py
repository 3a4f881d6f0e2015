"""`moe-bench versions`: release comparison through container images, and its bad input."""

from __future__ import annotations

import pytest

from bench.cli import main


def test_versions_unreachable_engine(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DOCKER_HOST", "tcp://127.0.0.1:9")  # nothing listens on the discard port
    out = tmp_path / "results"
    assert main(["versions", "moe-engine:0.1.0", "moe-engine:0.2.0", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err == "moe-bench: error: Docker engine unreachable at tcp://127.0.0.1:9: Connection refused\n"
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not out.exists()


class _FakeImages:
    def __init__(self, present):
        self.present = present

    def get(self, name):
        from docker.errors import ImageNotFound

        if name not in self.present:
            raise ImageNotFound(f"No such image: {name}")


class _FakeClient:
    def __init__(self, present):
        self.images = _FakeImages(present)

    def ping(self):
        return True


def test_versions_missing_image_runs_nothing(tmp_path, monkeypatch, capsys):
    """One image of two is missing: exit 2 before the first container starts, nothing written."""
    import docker

    monkeypatch.setattr(docker, "from_env", lambda **kw: _FakeClient({"moe-engine:0.1.0"}))
    started = []
    monkeypatch.setattr("bench.ab.images.run_image", lambda *a, **kw: started.append(a) or 0)
    out = tmp_path / "results"
    assert main(["versions", "moe-engine:0.1.0", "moe-engine:nope", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "moe-engine:nope: no such image on this Docker engine" in err
    assert started == [] and not out.exists()


def test_versions_missing_image_on_a_real_engine(tmp_path, capsys):
    from bench.ab.images import VersionsError, connect

    try:
        connect()
    except VersionsError as err:
        pytest.skip(f"no Docker engine reachable: {err}")
    out = tmp_path / "results"
    assert main(["versions", "moe-engine:does-not-exist-1", "moe-engine:does-not-exist-2", "--out", str(out)]) == 2
    assert "moe-engine:does-not-exist-1: no such image" in capsys.readouterr().err
    assert not out.exists()


def test_versions_needs_two_images(capsys):
    assert main(["versions", "moe-engine:0.1.0"]) == 2
    assert "at least two images" in capsys.readouterr().err


def test_compare_versions_table():
    from result_docs import make_doc

    from bench.ab.images import compare_versions
    from bench.results import ResultDocument, metric

    def docs(version, tput):
        m = {
            "tokens_per_s_per_gpu": metric([tput, tput + 1, tput - 1], "tokens/s", "higher"),
            "loss": metric([1.0], "nats", None),
        }
        return [ResultDocument(make_doc("s", m, version=version))]

    table = compare_versions({"img:a": docs("0.1.0", 1000), "img:b": docs("0.2.0", 500), "img:c": docs("0.3.0", 1000)})
    lines = table.splitlines()
    assert lines[0] == "| scenario | metric | unit | img:a (0.1.0) | img:b (0.2.0) | img:c (0.3.0) |"
    row = "| s | tokens_per_s_per_gpu | tokens/s | 1000 | 500 (x0.500, regressed) | 1000 (x1.000, unchanged) |"
    assert row in lines
    assert not any("loss" in line for line in lines)  # not gated: left out of the table


def test_the_versions_table_says_accepted_for_a_change_a_release_between_the_images_accepts(tmp_path):
    """Peak 100 -> 105.5 bytes (+5.5%, beyond the 5% tolerance): accepted by release 0.2.0 up to 6%."""
    from result_docs import make_doc

    from bench.ab.images import compare_versions
    from bench.gate.accept import parse_acceptance
    from bench.results import load_results, metric, write_result

    def docs(version: str, peak: float):
        write_result(
            make_doc("s", {"peak_tensor_bytes": metric([peak], "bytes", "lower")}, version=version), tmp_path / version
        )
        return load_results(tmp_path / version)

    images = {"moe-engine:0.1.0": docs("0.1.0", 100.0), "moe-engine:0.2.0": docs("0.2.0", 105.5)}
    accepted = [parse_acceptance("peak_tensor_bytes@s<=6%: fp32 gradient buffers", release="0.2.0")]
    row = "| s | peak_tensor_bytes | bytes | 100 | 105.5 (x1.055, {}) |"
    assert row.format("accepted") in compare_versions(images, acceptances=accepted).splitlines()
    assert row.format("regressed") in compare_versions(images).splitlines()


def test_versions_marks_its_folder_so_the_page_compares_the_images_before_stored_results(tmp_path, monkeypatch):
    """Two fake images write one result each into a folder that already holds stored results of the two
    versions from two machines: the versions table is there before the page, and the page compares the
    images' results (one machine, 1,000 -> 1,000 tokens/s) instead of the stored ones (1,000 -> 500)."""
    import copy

    from result_docs import make_doc

    from bench.ab import images
    from bench.results import metric, write_result

    identity = {"cpu_model": "x", "cpu_cores": 2, "isa_flags": ["avx"], "memory_gib": 8.0, "gpu": None}

    def doc(version, tokens, gflops):
        data = make_doc(
            "e8-skewed-fp32",
            {"tokens_per_s_per_gpu": metric([tokens] * 3, "tokens/s", "higher")},
            version=version,
            machine="box",
        )
        ident = copy.deepcopy(identity)
        ident["calibration"] = {"kernel": "k", "gflops": gflops, "samples": [gflops]}
        data["machine"] = {**data["machine"], "identity": ident}
        return data

    out = tmp_path / "results"
    write_result(doc("0.1.0", 1000.0, 100.0), out / "stored" / "0.1.0" / "box")
    write_result(doc("0.2.0", 500.0, 60.0), out / "stored" / "0.2.0" / "box")
    versions = {"img:0.1.0": "0.1.0", "img:0.2.0": "0.2.0"}

    def fake_run(client, image, command, folder, gpus):
        write_result(doc(versions[image], 1000.0, 90.0), folder / "images" / versions[image] / "box")
        return 0

    monkeypatch.setattr(images, "connect", lambda: object())
    monkeypatch.setattr(images, "check_images", lambda client, names: None)
    monkeypatch.setattr(images, "run_image", fake_run)
    code, _ = images.run_versions(list(versions), "ci", out, gpus="none")
    assert code == 0 and (out / "report" / "versions.md").is_file()
    page = (out / "report" / "index.html").read_text()
    assert "Compared from image results (moe-bench versions) in this results folder" in page
    assert "data-gate='pass'" in page
