"""`python -m eval.speedup` end to end on the tiny target, and the one table `make demo` prints over its results."""

import json

from eval import report, speedup

PROMPTS = [{"question_id": 1, "category": "writing", "turns": ["Say hi hi hi hi."]},
           {"question_id": 2, "category": "writing", "turns": ["Count: 1 2 3 1 2 3 1 2 3"]},
           {"question_id": 3, "category": "writing", "turns": ["Repeat: a b a b a b"]}]


def test_speedup_result_becomes_a_table_row(tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps(p) for p in PROMPTS) + "\n")
    out = tmp_path / "pl.json"
    code = speedup.main(["--prompts", str(prompts), "--target", "tiny-random-llama", "--source", "prompt_lookup",
                         "--max-new", "8", "--k", "3", "--threads", "1", "--modes", "plain,spec",
                         "--check-lossless", "--out", str(out)])
    assert code == 0
    result = json.loads(out.read_text())
    assert result["lossless"] is True and result["prompts"] == 3
    capsys.readouterr()
    assert report.main(["speedup", str(out)]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].startswith("| source | plain tok/s | speculative tok/s | speedup | tau | lossless |")
    cells = [c.strip() for c in table[2].strip("|").split("|")]
    assert cells[0] == "prompt_lookup" and cells[5] == "true"
    assert float(cells[3]) == round(result["speedup"], 2) and cells[6] == "-"  # HF generate: not run


def test_report_refuses_what_is_not_a_speedup_result(tmp_path, capsys):
    other = tmp_path / "acc.json"
    other.write_text(json.dumps({"benchmark": "acceptance", "tau": 1.5}))
    assert report.main(["speedup", str(other)]) == 2
    assert "is not an eval.speedup result" in capsys.readouterr().err
    assert report.main(["speedup", str(tmp_path / "missing.json")]) == 2
    assert "is not a readable JSON file" in capsys.readouterr().err
    assert report.main(["speedup"]) == 2
