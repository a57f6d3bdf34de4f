"""matplotlib is an optional extra (`pip install ".[plot]"`): without it every plot says how to get it,
and what does not need a plot still runs."""

import sys
import tomllib
from pathlib import Path

import pytest

from megamoe.bench import main as bench_main

ROOT = Path(__file__).resolve().parents[2]
HINT = 'pip install ".[plot]"'


@pytest.fixture
def no_matplotlib(monkeypatch):
    """As if matplotlib were not installed: importing it raises ImportError."""
    for name in [n for n in sys.modules if n == "matplotlib" or n.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.delitem(sys.modules, "megamoe.bench.plot", raising=False)  # imported again, without it


def test_matplotlib_is_an_optional_extra_that_the_tests_install():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not any(d.startswith("matplotlib") for d in project["dependencies"])
    assert project["optional-dependencies"]["plot"] == ["matplotlib"]
    assert "matplotlib" in project["optional-dependencies"]["test"]


def test_the_charts_name_the_extra_when_matplotlib_is_missing(no_matplotlib, tmp_path):
    from megamoe.bench.plot import write_chart

    with pytest.raises(ImportError, match=HINT.replace(".", r"\.").replace("[", r"\[")):
        write_chart({"records": []}, [tmp_path / "x.png"])
    pytest.importorskip("transformers")  # megamoe.train needs it
    from megamoe.train.plot import write_loss_curve, write_parity_plot

    with pytest.raises(ImportError, match=r"\.\[plot\]"):
        write_loss_curve([1], [1.0], tmp_path / "loss.png", title="t")
    with pytest.raises(ImportError, match=r"\.\[plot\]"):
        write_parity_plot({"a": [1.0]}, "a", tmp_path / "p.png", title="t")


def test_bench_plot_without_matplotlib_stops_before_measuring(no_matplotlib, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench_main(["--device", "cpu", "--backends", "naive", "--plot", "--out", str(tmp_path)])
    assert exit_info.value.code == 2 and HINT in capsys.readouterr().err
    assert not tmp_path.exists() or not any(tmp_path.iterdir())


def test_training_without_matplotlib_writes_its_metrics_and_says_why_there_is_no_plot(no_matplotlib, tmp_path,
                                                                                      capsys):
    pytest.importorskip("transformers")
    from megamoe.train import cli

    assert cli.main(["--config", str(ROOT / "configs" / "tiny.toml"), "--set", "train.device=cpu", "--set",
                     f"output.dir={tmp_path}", "--set", "train.steps=1"]) == 0
    captured = capsys.readouterr()
    assert (tmp_path / "metrics.jsonl").exists() and not (tmp_path / "loss.png").exists()
    assert HINT in captured.err and "loss.png" not in captured.out
