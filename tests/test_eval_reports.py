"""Report scripts over benchmark and training outputs: `eval.speedup` end to end on the tiny target and the one table
`make demo` prints over its results; `eval.depth_ceiling` over runs' held-out acceptance."""

import json

import pytest

from eval import depth_ceiling, report, speedup

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
    assert result["repeats"] == 3 and all(len(v) == 3 for v in result["tokens_per_s_each_repeat"].values())
    machine = result["machine"]  # what the figures were measured on, so other days' figures can be compared
    assert machine["torch_threads"] == 1 and machine["cpus_available"] >= 1 and machine["cpu"]
    assert min(machine[k] for k in ("bf16_gemm_gflops", "fp32_gemm_gflops", "copy_gbps", "python_ns_per_iter")) > 0
    capsys.readouterr()
    assert report.main(["speedup", str(out)]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].startswith("| source | plain tok/s | speculative tok/s | speedup | tau | lossless |")
    cells = [c.strip() for c in table[2].strip("|").split("|")]
    assert cells[0] == "prompt_lookup" and cells[5] == "true"
    assert float(cells[3]) == round(result["speedup"], 2) and cells[6] == "-"  # HF generate: not run


def test_speedup_profiles_the_widths_a_batch_verifies(tmp_path):
    """3 requests x (1 + K=5) tokens verify in one forward: the cost the group planner reads is measured to 32
    tokens (it was measured to 16 and extrapolated beyond)."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps(p) for p in PROMPTS) + "\n")
    out = tmp_path / "b3.json"
    assert speedup.main(["--prompts", str(prompts), "--target", "tiny-random-llama", "--source", "prompt_lookup",
                         "--max-new", "40", "--k", "5", "--batch", "3", "--threads", "1", "--modes", "plain,spec",
                         "--repeats", "1", "--check-lossless", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["lossless"] is True and max(map(int, result["verify_ms"])) == 32


def test_report_refuses_what_is_not_a_speedup_result(tmp_path, capsys):
    other = tmp_path / "acc.json"
    other.write_text(json.dumps({"benchmark": "acceptance", "tau": 1.5}))
    assert report.main(["speedup", str(other)]) == 2
    assert "is not an eval.speedup result" in capsys.readouterr().err
    assert report.main(["speedup", str(tmp_path / "missing.json")]) == 2
    assert "is not a readable JSON file" in capsys.readouterr().err
    assert report.main(["speedup"]) == 2


def test_tau_estimate_is_the_expected_chain_length():
    assert depth_ceiling.tau_estimate([0.5, 0.5]) == pytest.approx(1 + 0.5 + 0.25)
    assert depth_ceiling.tau_estimate([0.2, 0.5, 1.0], first=1.0) == pytest.approx(1 + 1 + 0.5 + 0.5)


def run_dir(tmp_path, name, acc):
    run = tmp_path / name
    run.mkdir()
    lines = [{"step": 100, "loss": 3.0}, {"step": 100, **{f"val_acc_{k + 1}": a / 2 for k, a in enumerate(acc)}},
             {"step": 200, **{f"val_acc_{k + 1}": a for k, a in enumerate(acc)}}]
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    return run


def test_depth_ceiling_margins_use_the_last_held_out_line(tmp_path, capsys):
    base, better = run_dir(tmp_path, "base", [0.3, 0.1, 0.1]), run_dir(tmp_path, "better", [0.3, 0.3, 0.3])
    with open(base / "metrics.jsonl", "a") as f:
        f.write('{"step": 300, "val_acc_1": 0.9, "val_ac')  # torn by a kill: skipped, the last whole line counts
    assert depth_ceiling.main([str(base), str(better), "--first", "1"]) == 0
    rows = {r["run"]: r for r in json.loads(capsys.readouterr().out.splitlines()[-1])["rows"]}
    b, m = rows[str(base)], rows[str(better)]
    assert b["tau_est"] == pytest.approx(1 + 0.3 * (1 + 0.1 * 1.1), abs=1e-4) and b["margin"] == 0
    assert m["tau_est at acc_1=1"] == pytest.approx(2.39, abs=1e-4)
    assert m["margin at acc_1=1"] == pytest.approx(2.39 / 2.11 - 1, abs=1e-4)


def test_depth_ceiling_names_the_bad_input(tmp_path, capsys):
    assert depth_ceiling.main([str(tmp_path / "nope")]) == 2
    assert "metrics.jsonl' does not exist" in capsys.readouterr().err
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 2.0}) + "\n")
    assert depth_ceiling.main([str(tmp_path / "r")]) == 2
    assert "has no held-out line" in capsys.readouterr().err
    assert depth_ceiling.main([str(tmp_path / "r"), "--first", "2"]) == 2
    assert "--first='2' must be" in capsys.readouterr().err


def test_heldout_prompts_are_the_last_sequences_first_user_turns(tiny_target, tmp_path):
    from eval.heldout_prompts import heldout_prompts
    from models.errors import DraftheadsError

    tok = tiny_target.tokenizer
    convs = [[{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": f"answer {i}"}]
             for i in range(5)]
    features = [{"input_ids": tok(tok.apply_chat_template(c, tokenize=False), add_special_tokens=False)["input_ids"]}
                for c in convs]
    rows = heldout_prompts(features, tok, 2)
    assert rows == [{"question_id": 3, "category": "heldout", "turns": ["question 3"]},
                    {"question_id": 4, "category": "heldout", "turns": ["question 4"]}]
    with pytest.raises(DraftheadsError, match="--holdout=6 must be in"):
        heldout_prompts(features, tok, 6)


def test_chain_simulation_follows_the_sequence_round_by_round():
    import torch

    from eval.chain_simulation import by_depth
    from train.chain import simulate_chain

    mask = torch.tensor([0, 0, 0] + [1] * 10, dtype=torch.bool)  # answer = tokens 3..12; first anchor 1
    hit = torch.zeros(13, 3, dtype=torch.bool)
    hit[1] = torch.tensor([1, 1, 0])  # round 1 at anchor 1 accepts 2, emits tokens 3..5 -> next anchor 4
    hit[4] = torch.tensor([0, 1, 1])  # round 2 accepts 0, emits 6 -> anchor 5
    hit[5] = torch.tensor([1, 1, 1])  # round 3 accepts 3, emits 7..10 -> anchor 9
    hit[9] = torch.tensor([1, 1, 0])  # round 4: 11 and 12 are left, so it drafts one (accepted) and emits 11, 12
    assert simulate_chain(hit, mask, max_new=64) == [(1, 2), (4, 0), (5, 3), (9, 1)]  # (anchor, accepted)
    assert sum(a + 1 for _, a in simulate_chain(hit, mask)) == 10  # every answer token, none past the end
    assert simulate_chain(hit, mask, max_new=4) == [(1, 2), (4, 0)]  # 3 tokens, then room for one, drafted by none
    assert simulate_chain(hit, mask) == simulate_chain(hit, mask, max_new=64)  # None: the whole answer
    # two answers around a user turn (tokens 13..17): each is its own request, the user turn is prompt, not rounds
    two = torch.cat([mask, torch.zeros(5, dtype=torch.bool), torch.ones(4, dtype=torch.bool)])
    hit2 = torch.cat([hit, torch.ones(9, 3, dtype=torch.bool)])
    assert simulate_chain(hit2, two) == [(1, 2), (4, 0), (5, 3), (9, 1), (16, 3)]  # tokens 18..21: one round
    assert sum(a + 1 for _, a in simulate_chain(hit2, two)) == 14  # the answers' tokens, not the user turn's
    stats = by_depth(hit[[1, 4, 5, 9]], 3)
    assert stats["agreement"] == [0.75, 1.0, 0.5]  # unconditional: round 2's later hits count here ...
    assert stats["acceptance"] == [0.75, 1.0, 0.3333]  # ... and not here (depth 3 given depths 1, 2: 1 of 3)
    assert stats["tau_est"] == round(1 + 0.75 + 0.75 * 1.0 + 0.75 * 1.0 * 0.3333, 4)
