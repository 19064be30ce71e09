"""The model zoo sweep: the CI subset runs here (about a minute on 2 cores); ``MUTWO_ZOO=full``
sweeps every model (about an hour on CPU), as ``python -m mutwo.tools.zoo`` does."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from mutwo.tools import zoo as zoo_tool
from mutwo.tools.zoo_models import ZooModel, zoo

REPO = Path(__file__).resolve().parent.parent
MODELS = zoo()
SWEPT = [m for m in MODELS if m.ci or os.environ.get("MUTWO_ZOO") == "full"]


@pytest.mark.parametrize("entry", SWEPT, ids=[m.name for m in SWEPT])
def test_model_is_captured_rewritten_and_checked_or_refused_with_its_sentence(entry: ZooModel) -> None:
    result = zoo_tool.run_model(entry)
    assert result.expected, f"{entry.name}: {result.status}: {result.reason} (expected: {entry.expect})"
    if result.status == "ok":
        assert result.nodes > 0 and 0 < result.peak_after <= result.peak_before
    if result.status == "refused":
        assert "\n" not in result.reason and ";" in result.reason  # one sentence: the cause; the fix


def test_the_ci_subset_covers_every_family() -> None:
    assert {m.family for m in MODELS if m.ci} == {m.family for m in MODELS}


def test_docs_table_is_rendered_from_the_committed_sweep() -> None:
    sweep = json.loads((REPO / zoo_tool.RESULTS).read_text(encoding="utf-8"))
    assert (REPO / "docs" / "zoo.md").read_text(encoding="utf-8") == zoo_tool.markdown(sweep)
    by_name = {m.name: m for m in MODELS}
    for result in sweep["results"]:
        assert result["name"] in by_name, f"{result['name']} is no longer in the zoo: sweep again"
        assert result["expected"], f"{result['name']} did not meet its expectation in the committed sweep"


@pytest.mark.parametrize("argv,words", [
    (["--only", "resnet9000"], ["unknown model 'resnet9000'", "resnet18"]),
    (["--render", "sweep.json"], ["--render needs --markdown"]),
    (["--render", "missing.json", "--markdown", "zoo.md"], ["cannot read 'missing.json'", "written by -o"]),
    (["--frobnicate"], ["unrecognized option", "--help"]),
], ids=["unknown-model", "render-without-markdown", "render-missing-file", "unknown-flag"])  # fmt: skip
def test_bad_usage_is_one_line_and_exit_2(argv: list[str], words: list[str], tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str],
                                          monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    monkeypatch.chdir(tmp_path)
    assert zoo_tool.main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith("zoo: error: "), err
    for word in words:
        assert word in err
    assert not any(tmp_path.iterdir())


def test_render_writes_the_table_of_a_sweep(tmp_path: Path) -> None:
    sweep = {"torch": "2.x", "passes": zoo_tool.DEFAULT_PASSES, "results": [
        dict(zoo_tool.ZooResult("tiny", "rnn", "ok", nodes=10, peak_before=2**21, peak_after=2**20,
                                recomputed=3, seconds=1.5, expected=True).__dict__, reduction=0.5),
        dict(zoo_tool.ZooResult("branchy", "refused", "refused", reason="it branches | on a value; do not",
                                expected=True).__dict__, reduction=None),
    ]}  # fmt: skip
    (tmp_path / "sweep.json").write_text(json.dumps(sweep), encoding="utf-8")
    assert zoo_tool.main(["--render", str(tmp_path / "sweep.json"), "--markdown", str(tmp_path / "zoo.md")]) == 0
    table = (tmp_path / "zoo.md").read_text(encoding="utf-8")
    assert "| tiny | rnn | ok | 10 | 2.00 → 1.00 | 3 | 1.5 |  |" in table
    assert "| branchy | refused | refused |  |  |  | 0.0 | it branches \\| on a value; do not |" in table
    assert f"Totals: {len(MODELS)} not swept, 1 ok, 1 refused." in table  # every zoo model has a row
    assert "| resnet18 | torchvision | not swept |  |  |  |  |  |" in table
