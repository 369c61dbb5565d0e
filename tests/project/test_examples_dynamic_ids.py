"""examples/dynamic_ids.py: its --quick run prints the per-phase table and the summary,
and both contenders (modulo hashing, the LRU id map) learn: better than chance."""

import math
import re

from examples import dynamic_ids


def test_quick_run_prints_summary_and_both_learn(capsys):
    summary = dynamic_ids.run(dynamic_ids.parse_args(["--quick", "--contenders", "modulo,lru"]))
    out = capsys.readouterr().out
    capacity, phases, _ = dynamic_ids.SIZES["quick"]
    phase_rows = [ln for ln in out.splitlines() if re.match(r"\s*\d+ \|\s+\d+ \| log-loss:", ln)]
    assert len(phase_rows) == phases
    assert all(ln.count("|") == 8 for ln in phase_rows)  # 3 losses, 3 AUCs, 1 eviction count
    assert "summary over phases 1-" in out
    rows = {}
    for ln in out.split("summary over phases", 1)[1].splitlines()[2:]:
        cells = [c.strip() for c in ln.split("|")]
        rows[cells[0]] = cells
    assert list(rows) == ["truth", "modulo", "lru"]
    assert rows["modulo"][3:] == ["-", "-"]
    assert int(rows["lru"][3]) > capacity  # admissions: more ids than rows went through
    assert int(rows["lru"][4]) > 0  # so the map evicted
    for name in ("modulo", "lru"):
        loss, auc = summary[name]
        assert [float(rows[name][1]), float(rows[name][2])] == [round(loss, 4), round(auc, 4)]
        assert loss < math.log(2) and auc > 0.6, (name, loss, auc)  # chance: log 2, 0.5
    assert summary["truth"][1] > max(summary["modulo"][1], summary["lru"][1])
