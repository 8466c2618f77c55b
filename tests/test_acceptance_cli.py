"""`python -m eval.acceptance` end to end on the tiny target, and its input errors."""

import json

import pytest

import eval.acceptance as acceptance
from eval.acceptance import load_prompts, main
from eval.report import markdown_table
from models.errors import DraftheadsError

PROMPTS = [
    {"question_id": 1, "category": "writing", "turns": ["Say hi hi hi.", "Now say it twice."]},
    {"question_id": 2, "category": "writing", "turns": ["Count: 1 2 3 1 2 3"]},
    {"question_id": 3, "category": "qa", "turns": ["What is a byte?"]},
]


@pytest.fixture()
def prompt_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps(p) for p in PROMPTS) + "\n")
    return path


def cli(prompt_file, out, *extra):
    return main(["--prompts", str(prompt_file), "--source", "prompt_lookup", "--target", "tiny-random-llama",
                 "--max-new", "12", "--k", "3", "--out", str(out), "--threads", "1", "--no-progress", *extra])


def test_cli_writes_json_and_markdown(prompt_file, tmp_path, capsys, monkeypatch):
    seen_prompts = []
    real = acceptance.generate_turn

    def recording(runtime, target, source, ids, *args, **kw):
        seen_prompts.append(target.tokenizer.decode(ids))
        res = real(runtime, target, source, ids, *args, **kw)
        seen_prompts.append(target.tokenizer.decode(res.tokens[0], skip_special_tokens=True))
        return res

    monkeypatch.setattr(acceptance, "generate_turn", recording)
    out = tmp_path / "res" / "acc.json"
    assert cli(prompt_file, out) == 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last["out"] == str(out) and last["md"] == str(out.with_suffix(".md")) and last["k"] == 3

    results = json.loads(out.read_text())
    overall = results["overall"]
    assert set(results["categories"]) == {"writing", "qa"}
    assert results["categories"]["writing"]["requests"] == 3 and overall["prompts"] == 3 and overall["requests"] == 4
    assert overall["tokens"] <= 4 * 12
    assert overall["tau"] == pytest.approx(overall["tokens"] / overall["rounds"], abs=1e-4)
    assert last["tau"] == pytest.approx(overall["tau"], abs=1e-4) and 1.0 <= overall["tau"] <= 4.0
    assert len(overall["acceptance"]) == 3 and 0 < overall["mean_draft_len"] <= 3
    assert results["target"]["name"] == "tiny-random-llama"
    assert [(r["question_id"], r["turn"]) for r in results["turns"]] == [(1, 0), (1, 1), (2, 0), (3, 0)]
    assert sum(r["tokens"] for r in results["turns"]) == overall["tokens"]
    assert "output_ids" not in results["turns"][0]
    # --save-tokens keeps each turn's output; greedy outputs do not depend on k
    out2 = tmp_path / "acc2.json"
    assert cli(prompt_file, out2, "--save-tokens", "--k", "1") == 0
    turns2 = json.loads(out2.read_text())["turns"]
    assert [len(r["output_ids"]) for r in turns2] == [r["tokens"] for r in results["turns"]]

    md = out.with_suffix(".md").read_text()
    assert "| category |" in md and "| qa |" in md and "acc@3" in md
    tested = overall["tested"]  # the last row: how many rounds each overall acceptance figure rests on
    assert 0 < tested[0] <= overall["rounds"] and md.splitlines()[-1].startswith(
        "| rounds testing it | - | - | - | - | - | " + " | ".join(map(str, tested)) + " |")

    # turn 2 follows the model's own turn-1 answer, in the chat template with the generation prompt
    turn1_answer, turn2_prompt = seen_prompts[1], seen_prompts[2]
    assert "Say hi hi hi." in turn2_prompt and "Now say it twice." in turn2_prompt
    assert turn1_answer in turn2_prompt and turn2_prompt.endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("content, message", [
    (None, "does not exist"),
    ('{"category": "qa", "turns": ["ok"]}\n{not json\n', "prompts.jsonl:2 is not valid JSON"),
    ('{"category": "qa", "turns": "just a string"}\n', "prompts.jsonl:1 needs a 'turns' field"),
])
def test_bad_prompt_files_exit_2_with_message(tmp_path, capsys, content, message):
    path = tmp_path / "prompts.jsonl"
    if content is not None:
        path.write_text(content)
    assert cli(path, tmp_path / "o.json") == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "o.json").exists()


def test_unknown_source_and_category_exit_2(prompt_file, tmp_path, capsys):
    args = ["--prompts", str(prompt_file), "--target", "tiny-random-llama", "--out", str(tmp_path / "o.json")]
    assert main(args + ["--source", "medusa"]) == 2
    assert "unknown draft source 'medusa'" in capsys.readouterr().err
    assert main(args + ["--source", "prompt_lookup", "--categories", "poetry"]) == 2
    assert "--categories poetry not in" in capsys.readouterr().err


def test_categories_alias_and_round_robin_limit(tmp_path):
    path = tmp_path / "p.jsonl"
    cats = ["writing"] * 3 + ["math"] * 3 + ["qa"] * 3
    path.write_text("".join(json.dumps({"category": c, "turns": [f"{c} {i}"]}) + "\n" for i, c in enumerate(cats)))
    mt = load_prompts(path, ["mt_bench"])
    assert {p["category"] for p in mt} == {"writing", "math"} and len(mt) == 6
    limited = load_prompts(path, None, limit=4)
    assert [p["category"] for p in limited] == ["writing", "math", "qa", "writing"]
    with pytest.raises(DraftheadsError, match="no prompts left"):
        load_prompts(path, None, limit=0)


def test_markdown_table_formats_cells():
    table = markdown_table([{"a": 1, "b": 0.12345, "c": None}, {"a": "x|y", "b": 2.0}], ["a", "b", "c"])
    assert table.splitlines() == ["| a | b | c |", "|---|---|---|", "| 1 | 0.123 | - |", "| x\\|y | 2.000 | - |"]


def test_tree_sources_run_through_the_runtime(prompt_file, tmp_path):
    """Every source goes through the runtime (auto); it gives the reference loop's greedy text, chain or tree."""
    import torch

    from models.checkpoint import save_draft
    from models.peagle import peagle_for_target
    from models.target import load_target

    target = load_target("tiny-random-llama")
    torch.manual_seed(0)
    save_draft(peagle_for_target(target, k=3), tmp_path / "head", target)
    outs = {}
    for name, extra in {"ref": ("--engine", "reference"), "rt": (),
                        "tree": ("--source", f"head:{tmp_path / 'head'},tree=1", "--k", "6")}.items():
        assert cli(prompt_file, tmp_path / f"{name}.json", "--save-tokens", *extra) == 0
        outs[name] = json.loads((tmp_path / f"{name}.json").read_text())
    assert [outs["ref"]["engine"], outs["rt"]["engine"], outs["tree"]["engine"]] == ["reference", "runtime", "runtime"]
    ids = {name: [r["output_ids"] for r in res["turns"]] for name, res in outs.items()}
    assert ids["rt"] == ids["ref"] and ids["tree"] == ids["ref"]
    tree = outs["tree"]["overall"]
    assert len(tree["acceptance"]) == 6 and tree["tau"] >= 1.0 and 0 < tree["mean_draft_len"] <= 6
