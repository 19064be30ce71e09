"""bench/nondeterminism_probe.py: it names the op whose bits vary from run to run, not its users."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch

from bench import nondeterminism_probe
from mutwo.runtime.planning.captured import capture_graph
from tests import models


def _captured() -> Any:
    workload = models.mlp()
    model = workload.model.eval()
    return capture_graph(model, torch.optim.SGD(model.parameters(), lr=0.1), workload.batch, workload.loss_fn)


def test_a_deterministic_graph_has_no_differing_node() -> None:
    lowered = _captured()
    assert nondeterminism_probe.probe(lowered.graph, lowered.inputs) == []


def test_the_first_varying_op_is_the_cause_and_its_users_inherit(monkeypatch: pytest.MonkeyPatch) -> None:
    lowered = _captured()
    varying = next(n for n in lowered.graph if "mm" in str(n.target))  # the first matmul varies by one ulp
    calls = itertools.count()
    run_node = nondeterminism_probe.Fingerprinter.run_node

    def noisy_run_node(self: Any, node: torch.fx.Node) -> Any:
        result = run_node(self, node)
        if node.meta.get("mutwo_id") == varying.id and next(calls) == 1:  # its second run only
            result = torch.nextafter(result, torch.full_like(result, float("inf")))
            self.prints[node.name] = nondeterminism_probe.fingerprint(result)
        return result

    monkeypatch.setattr(nondeterminism_probe.Fingerprinter, "run_node", noisy_run_node)
    rows = nondeterminism_probe.probe(lowered.graph, lowered.inputs)
    causes = [row for row in rows if row["first_cause"]]
    assert [row["target"] for row in causes] == [str(varying.target)], rows
    assert causes[0]["phase"] == "forward" and len(rows) > 1, "its users inherit the difference"
    # SGD's in-place parameter update writes the difference into the parameters: seen, and inherited
    updates = [row for row in rows if row["writes_differ"]]
    assert updates and all(row["phase"] == "optimizer" and not row["first_cause"] for row in updates), rows


def test_a_bad_config_is_one_line_and_exit_code_2(tmp_path: Any, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    out = tmp_path / "probe.json"
    monkeypatch.setattr("sys.argv", ["nondeterminism_probe.py", str(tmp_path / "missing.yaml"), "--out", str(out)])
    with pytest.raises(SystemExit) as exited:
        nondeterminism_probe.main()
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert exited.value.code == 2 and "does not exist; pass the path of a YAML file" in error
    assert not out.exists()
