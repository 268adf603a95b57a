"""``rwinterp circuit``: on a deep run, its outputs, and its one-line errors."""

from __future__ import annotations

import json

import pytest

from rwinterp.cli import main

DEEP = ["train", "--model", "deep", "--preset", "standard", "--layers", "2", "--heads", "2", "--d-model", "8",
        "--K", "4", "--N", "8", "--loss", "xent", "--optimizer", "adamw", "--lr", "0.02", "--steps", "20",
        "--next-token", "--n-train", "64", "--n-test", "24"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("circuit")
    assert main([*DEEP, "--out", str(root / "deep")]) == 0
    assert main(["train", "--K", "4", "--N", "8", "--steps", "2", "--n-train", "32", "--n-test", "16",
                 "--out", str(root / "paper")]) == 0
    return root


def test_circuit_writes_the_circuit_and_prints_it_as_json(runs, capsys):
    capsys.readouterr()
    roles = runs / "roles.json"
    roles.write_text(json.dumps({"L0H0": "previous-token"}))
    out = runs / "circ"
    assert main(["circuit", str(runs / "deep"), "--out", str(out), "--json", "--top", "4", "--roles", str(roles)]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["method"] == "default" and payload["circuit_size"] == 4 and payload["n_edges"] == 29
    edges = payload["edges"]
    assert [abs(e["score"]) for e in edges] == sorted((abs(e["score"]) for e in edges), reverse=True)
    assert {e["source"] for e in edges} == {"embeddings", "L0H0", "L0H1", "L1H0", "L1H1"}
    assert "logits" in {e["target"] for e in edges} and "L1H1.k" in {e["target"] for e in edges}
    assert all(e["source_role"] == "previous-token" for e in edges if e["source"] == "L0H0")
    assert payload["circuit"] == edges[:4]
    curve = payload["curve"]
    assert curve["sizes"][0] == 0 and curve["sizes"][-1] == 29 and 4 in curve["sizes"]
    assert curve["faithfulness"][0] == pytest.approx(0.0, abs=1e-9)
    assert curve["faithfulness"][-1] == pytest.approx(1.0, abs=1e-9)
    assert sorted(p.name for p in out.iterdir()) == ["circuit.json", "circuit.md", "circuit.png", "faithfulness.png"]
    assert json.loads((out / "circuit.json").read_text())["edges"] == edges


@pytest.mark.parametrize("args, message", [
    (["--top", "0"], "between 1 and the 29 edges"),
    (["--top", "30"], "between 1 and the 29 edges"),
    (["--ig-steps", "2"], "--ig-steps applies to --method eap-ig only"),
    (["--method", "eap-ig", "--ig-steps", "0"], "--ig-steps must be >= 1"),
    (["--threshold", "-1"], "threshold must be a finite number >= 0"),
    (["--roles", "missing.json"], "cannot read the roles file"),
])
def test_bad_input_is_one_line_and_exit_2(runs, capsys, args, message):
    capsys.readouterr()
    assert main(["circuit", str(runs / "deep"), "--out", str(runs / "bad"), *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert not (runs / "bad").exists()


def test_a_model_without_a_residual_stream_is_refused_in_one_line(runs, capsys):
    capsys.readouterr()
    assert main(["circuit", str(runs / "paper"), "--out", str(runs / "none")]) == 2
    err = capsys.readouterr().err
    assert "cannot be built" in err and "residual stream" in err and err.count("\n") == 1


def test_a_size_and_a_threshold_together_are_refused_by_the_parser(runs, capsys):
    with pytest.raises(SystemExit) as info:
        main(["circuit", str(runs / "deep"), "--out", str(runs / "bad"), "--top", "3", "--threshold", "0.1"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "not allowed with argument" in err and err.count("\n") == 1
