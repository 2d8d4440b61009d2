"""`kiln serve` over real HTTP on loopback with the tiny real checkpoint: the official openai client
(tools, streaming, n, logprobs, models), reply parsing and stream splitting, request rendering,
batching of concurrent requests, hot weight loads mid-generation, errors, timeouts, a dead engine,
and the harness's openai policy completing a graded rollout on a toy task."""
from __future__ import annotations

import json
import os
import random
import socket
import struct
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from http.client import HTTPConnection

import openai
import pytest
import torch
from typer.testing import CliRunner

from kiln.bench.run import run_rollout
from kiln.cli import app
from kiln.config import Config, HarnessConfig, PolicyConfig
from kiln.harness.format import CALL_OPEN, THINK_OPEN
from kiln.model.checkpoint import load_checkpoint, save_checkpoint
from kiln.model.tokenizer import load_tokenizer
from kiln.sandbox import Snapshot
from kiln.serve import serve
from kiln.serve.protocol import APIError, ChatRequest, parse_body, render_prompt
from kiln.serve.responses import StreamSplitter, build_message, finish_reason
from kiln.tasks.record import load_suite
from kiln.tasks.toy import generate_toy
from tests.threads import one_thread  # noqa: F401 - autouse: one torch thread in this module
from tests.tiny_model import (
    tiny_model,
)

MODEL = "ckpt"  # the tiny checkpoint's folder name: the default model id
MSGS = [{"role": "user", "content": "Read a.py and fix the bug."}]
TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "Read a file.", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}]
LONG = {"ignore_eos": True}  # exactly max_tokens tokens: an untrained model may end a reply anywhere
TOKEN = "s3cret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    with serve(tiny_checkpoint, port=0, request_timeout=60) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return client_for(server)


def client_for(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)


def http(method: str, url: str, body=None, headers: dict | None = None) -> tuple[int, dict]:
    data = body if body is None or isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def extra(obj, key: str):
    """A field OpenAI's schema lacks (kiln, reasoning_content), as the client keeps it."""
    return (obj.model_extra or {}).get(key)


# ---- the official client ---------------------------------------------------------------------

def test_chat_completion_with_tools(client):
    r = client.chat.completions.create(model=MODEL, messages=MSGS, tools=TOOLS, temperature=0, max_tokens=24,
                                       extra_body=LONG)
    choice = r.choices[0]
    assert r.object == "chat.completion" and r.model == MODEL and r.id.startswith("chatcmpl-")
    assert choice.message.role == "assistant" and choice.finish_reason in ("length", "tool_calls")
    kiln = extra(choice, "kiln")
    assert len(kiln["token_ids"]) == r.usage.completion_tokens == 24 and kiln["versions"] == [0] * 24
    assert r.usage.total_tokens == r.usage.prompt_tokens + 24
    # The tools are rendered into the prompt; tool_choice "none" leaves them out.
    bare = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=1)
    none = client.chat.completions.create(model=MODEL, messages=MSGS, tools=TOOLS, tool_choice="none", max_tokens=1)
    assert bare.usage.prompt_tokens == none.usage.prompt_tokens < r.usage.prompt_tokens


@pytest.mark.parametrize("tools", [None, TOOLS], ids=["text", "tools"])
def test_stream_adds_up_to_the_whole_reply(client, tiny_checkpoint, tools):
    kw = {"model": MODEL, "messages": MSGS, "temperature": 0, "max_tokens": 64, "logprobs": True,
          "extra_body": LONG, **({"tools": tools} if tools else {})}
    whole = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    deltas = [c.choices[0] for c in chunks if c.choices]
    assert deltas[0].delta.role == "assistant"
    assert [d.finish_reason for d in deltas].count(None) == len(deltas) - 1  # only the last one finishes
    msg, choice = whole.choices[0].message, whole.choices[0]
    assert "".join(d.delta.content or "" for d in deltas) == (msg.content or "")
    assert "".join(extra(d.delta, "reasoning_content") or "" for d in deltas) == (extra(msg, "reasoning_content") or "")
    ids = [t for d in deltas for t in (extra(d, "kiln") or {}).get("token_ids", [])]
    assert ids == extra(choice, "kiln")["token_ids"] and len(ids) == 64
    lps = [e.logprob for d in deltas if d.logprobs for e in d.logprobs.content]
    assert lps == pytest.approx([e.logprob for e in choice.logprobs.content])
    assert deltas[-1].finish_reason == choice.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens == 64
    if tools is None:  # without tools the reply is the text exactly as generated
        assert msg.content == load_tokenizer(tiny_checkpoint).decode(ids)


def test_logprobs_one_per_token(client):
    r = client.chat.completions.create(model=MODEL, messages=MSGS, temperature=0.7, seed=1, max_tokens=20,
                                       logprobs=True, top_logprobs=2, extra_body=LONG)
    entries = r.choices[0].logprobs.content
    assert len(entries) == r.usage.completion_tokens == 20
    assert all(e.logprob <= 0 and e.top_logprobs == [] for e in entries)
    # Bytes, not text, are what add up: a byte-level token may hold part of a character.
    assert b"".join(bytes(e.bytes) for e in entries).decode("utf-8", "replace") == r.choices[0].message.content


def test_n_choices_are_seeded_samples(client):
    kw = {"model": MODEL, "messages": MSGS, "n": 3, "temperature": 1.0, "seed": 7, "max_tokens": 12,
          "extra_body": LONG}
    r = client.chat.completions.create(**kw)
    assert [c.index for c in r.choices] == [0, 1, 2] and r.usage.completion_tokens == 36
    samples = [tuple(extra(c, "kiln")["token_ids"]) for c in r.choices]
    assert len(set(samples)) > 1  # choice i uses seed + i
    assert [tuple(extra(c, "kiln")["token_ids"]) for c in client.chat.completions.create(**kw).choices] == samples


def test_models_and_health(client, server):
    assert [m.id for m in client.models.list()] == [MODEL]
    status, body = http("GET", server.url + "/health")
    assert status == 200 and body["status"] == "ok" and body["version"] == 0 and body["waiting"] == 0


# ---- replies and requests --------------------------------------------------------------------

REPLY = ('<think>\nLook first.\n</think>\nReading both.\n<tool_call>\n{"name": "read_file", "arguments": '
         '{"path": "a.py"}}\n</tool_call>\n<tool_call>{"name": "grep", "arguments": {"pattern": "def f"}}</tool_call>')


def test_reply_with_thinking_and_two_tool_calls():
    msg = build_message(REPLY, True, "call_x_")
    assert msg["content"] == "Reading both." and msg["reasoning_content"] == "Look first."
    calls = [(c["id"], c["type"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"]]
    assert calls == [("call_x_0", "function", "read_file", {"path": "a.py"}),
                     ("call_x_1", "function", "grep", {"pattern": "def f"})]
    assert finish_reason(msg, "stop") == "tool_calls"
    only_calls = build_message(REPLY.split("Reading both.")[1], True, "c")
    assert only_calls["content"] is None and len(only_calls["tool_calls"]) == 2
    # A malformed block: no tool_calls, the blocks stay in the content for the client to see.
    bad = build_message('Hm.\n<tool_call>{"name": "read_file", "arguments": {</tool_call>', True, "c")
    assert "tool_calls" not in bad and bad["content"] == 'Hm.\n<tool_call>{"name": "read_file", "arguments": {</tool_call>'
    assert finish_reason(bad, "length") == "length"
    assert build_message(REPLY, False, "c") == {"role": "assistant", "content": REPLY}  # no tools: as generated


@pytest.mark.parametrize("text,lead", [
    (REPLY, ""), ("  plain answer \n", ""), ("a</think>b", ""), ("<think>unclosed reasoning  ", ""),
    ("x</tool_call>y", ""), ("<think>a</think>b<think>c", ""), ("odd < and </ and <t and <tool_", ""),
    ('x<tool_call>{"name": "f", "arguments": {}}</tool_call> tail <think>late</think> end', ""),
    ('Hm.\n<tool_call>{"name": "read_file"', ""), ("reasoning\n</think>\n\nanswer", THINK_OPEN),
])
def test_stream_splitter_adds_up_to_the_message(text, lead):
    rng = random.Random(0)
    msg = build_message(text, True, "c", lead)
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 8))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        splitter, got = StreamSplitter(lead), {"content": "", "reasoning_content": ""}
        for delta in [splitter.push(p) for p in pieces] + [splitter.finish(msg)]:
            for key, value in delta.items():
                got[key] += value
        assert got == {"content": msg["content"] or "", "reasoning_content": msg.get("reasoning_content", "")}
        assert CALL_OPEN not in got["content"] or "tool_calls" not in msg  # parsed calls never leak as text



def test_tool_choice_decides_what_is_rendered_and_parsed():
    tools = TOOLS + [{"type": "function", "function": {"name": "grep", "parameters": {"type": "object"}}}]

    def request(choice):
        return parse_body(json.dumps({"messages": MSGS, "tools": tools, "tool_choice": choice}).encode(), ChatRequest)

    assert request("auto").rendered_tools() == request("required").rendered_tools() == tools  # as the client sent them
    assert request("none").rendered_tools() is None and not request("none").parse_tools
    named = request({"type": "function", "function": {"name": "grep"}})
    assert named.rendered_tools() == tools[1:] and named.parse_tools
    with pytest.raises(APIError, match="not among the tools"):
        request({"type": "function", "function": {"name": "nope"}})


def test_tool_history_in_the_request_is_rendered(client, tiny_checkpoint):
    history = MSGS + [
        {"role": "assistant", "content": None, "reasoning_content": "Look.",
         "tool_calls": [{"id": "call_1", "type": "function",
                         "function": {"name": "read_file", "arguments": '{"path": "a.py"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "def f(): pass"}]
    req = parse_body(json.dumps({"messages": history, "tools": TOOLS}).encode(), ChatRequest)
    tok = load_tokenizer(tiny_checkpoint)
    text = render_prompt(req, tok)
    assert '<think>\nLook.\n</think>\n\n<tool_call>\n{"name": "read_file", "arguments": {"path": "a.py"}}\n</tool_call>' in text
    assert "<tool_response>\ndef f(): pass\n</tool_response>" in text
    r = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, max_tokens=1)
    short = client.chat.completions.create(model=MODEL, messages=MSGS, tools=TOOLS, max_tokens=1)
    assert r.usage.prompt_tokens == len(tok.encode(text)) > short.usage.prompt_tokens


# ---- batching, weights, failures -------------------------------------------------------------

def test_concurrent_requests_are_batched(tiny_checkpoint):
    with serve(tiny_checkpoint, port=0, max_batch=8) as srv:
        client = client_for(srv)

        def one(i: int):
            return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"task {i}"}],
                                                  temperature=0.8, seed=i, max_tokens=32, extra_body=LONG)

        with ThreadPoolExecutor(8) as pool:
            replies = list(pool.map(one, range(8)))
        assert [r.usage.completion_tokens for r in replies] == [32] * 8
        status, health = http("GET", srv.url + "/health")
        assert status == 200 and health["peak_running"] > 1 and health["running"] == 0


def perturbed_checkpoint(src, out):
    """The same model with every matrix moved: another policy version, same shapes and tokenizer."""
    model, mtp = load_checkpoint(src)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim > 1:
                p.add_(torch.randn_like(p) * p.std())
    return save_checkpoint(model, out, mtp=mtp, tokenizer_dir=src)


def test_load_weights_while_generating(tiny_checkpoint, tmp_path):
    second = perturbed_checkpoint(tiny_checkpoint, tmp_path / "v1")
    wrong = save_checkpoint(tiny_model(vocab_size=300)[0], tmp_path / "wrong")
    load = "/admin/load_weights"
    with serve(tiny_checkpoint, port=0, admin_token=TOKEN) as srv:
        client = client_for(srv)
        probe = {"model": MODEL, "messages": MSGS, "temperature": 0, "max_tokens": 16, "extra_body": LONG}
        before = extra(client.chat.completions.create(**probe).choices[0], "kiln")
        # Once the stream has begun, its engine holds after each step until new weights are queued:
        # decoded in native runs, the tiny model would otherwise finish before the checkpoint loads.
        engine, hold, queued = srv.engine, threading.Event(), threading.Event()
        real_step, real_update = engine.step, engine.update_weights

        def step():
            done = real_step()
            if hold.is_set() and engine.running:
                queued.wait(10)
            return done

        def update_weights(*args, **kwargs):
            real_update(*args, **kwargs)
            queued.set()
        engine.step, engine.update_weights = step, update_weights
        hold.set()
        stream = client.chat.completions.create(model=MODEL, messages=MSGS, temperature=0, max_tokens=200,
                                                stream=True, extra_body=LONG)
        versions, loaded = [], None
        for chunk in stream:
            versions += (extra(chunk.choices[0], "kiln") or {}).get("versions", []) if chunk.choices else []
            if versions and loaded is None:  # mid-generation
                assert http("POST", srv.url + load, {"checkpoint": str(second)})[0] == 401  # no token
                loaded = http("POST", srv.url + load, {"checkpoint": str(second)}, AUTH)
        assert loaded == (200, {"version": 1, "checkpoint": str(second), "mtp": True})
        assert len(versions) == 200 and versions == sorted(versions) and versions[0] == 0 and versions[-1] == 1
        after = extra(client.chat.completions.create(**probe).choices[0], "kiln")
        assert after["versions"] == [1] * 16 and after["token_ids"] != before["token_ids"]
        # Bad checkpoints are refused with a reason; the server goes on with version 1.
        status, body = http("POST", srv.url + load, {"checkpoint": str(tmp_path / "nope")}, AUTH)
        assert status == 400 and "nope" in body["error"]["message"] and "still serving version 1" in body["error"]["message"]
        status, body = http("POST", srv.url + load, {"checkpoint": str(wrong)}, AUTH)
        assert status == 400 and "shape" in body["error"]["message"]
        assert http("GET", srv.url + "/health")[1]["version"] == 1
        assert extra(client.chat.completions.create(**probe).choices[0], "kiln") == after
        # Loaded while idle, the first weights come back as version 5: the same replies again.
        loaded = http("POST", srv.url + load, {"checkpoint": str(tiny_checkpoint), "version": 5}, AUTH)
        assert loaded[1]["version"] == 5 and http("GET", srv.url + "/health")[1]["version"] == 5
        again = extra(client.chat.completions.create(**probe).choices[0], "kiln")
        assert again == {"token_ids": before["token_ids"], "versions": [5] * 16}


def test_bad_requests_get_openai_errors(client, server):
    url = server.url + "/v1/chat/completions"
    cases = [
        (b"{not json", 400, None, "not valid JSON"),
        ({"model": MODEL}, 400, "messages", "Field required"),
        ({"messages": MSGS, "max_tokens": "5"}, 400, "max_tokens", "valid integer"),
        ({"messages": MSGS, "max_token": 5}, 400, "max_token", "unknown field"),
        ({"messages": [{"role": "user"}]}, 400, "messages[0]", "needs content"),
        ({"messages": MSGS, "model": "gpt-9"}, 404, "model", "serves 'ckpt'"),
        ({"messages": [{"role": "user", "content": "x " * 3000}]}, 400, "messages", "context is 2048"),
    ]
    for body, status, param, text in cases:
        got, err = http("POST", url, body)
        assert (got, err["error"]["param"]) == (status, param), (body, err)
        assert text in err["error"]["message"] and err["error"]["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model=MODEL, messages=MSGS, temperature=-1)
    assert http("GET", server.url + "/v1/nothing")[0] == 404
    assert http("POST", server.url + "/v1/completions", {"prompt": "x"})[0] == 404
    assert http("GET", url)[0] == 405
    assert http("GET", server.url + "/health")[0] == 200  # and it still serves


def test_timeouts_and_a_dead_engine_answer_instead_of_hanging(tiny_checkpoint):
    # 0.2 s against ~1,900 tokens: the native step decodes the tiny model at ~1,000 tokens/s, so
    # 1,500 tokens in 1 s could finish before the timeout on an idle machine.
    with serve(tiny_checkpoint, port=0, request_timeout=0.2) as srv:
        url = srv.url + "/v1/chat/completions"
        start = time.monotonic()
        status, body = http("POST", url, {"messages": MSGS, "max_tokens": 1900, "ignore_eos": True})
        assert status == 504 and "--request-timeout" in body["error"]["message"]
        assert time.monotonic() - start < 5
        # A weight update the engine refuses kills its loop (the long request is still running in it).
        srv.engine.update_weights({"no.such.weight": torch.zeros(1)}, 7)
        deadline = time.monotonic() + 10
        while http("GET", srv.url + "/health")[0] == 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        status, body = http("GET", srv.url + "/health")
        assert status == 500 and "no.such.weight" in body["error"]["message"]
        status, body = http("POST", url, {"messages": MSGS, "max_tokens": 4})
        assert status == 500 and "engine failed" in body["error"]["message"]


def test_cli_refuses_a_missing_checkpoint(tmp_path):
    result = CliRunner().invoke(app, ["serve", "--checkpoint", str(tmp_path / "missing")])
    assert result.exit_code == 2 and "error:" in result.output and "missing" in result.output


# ---- the harness against the server ----------------------------------------------------------

def test_openai_policy_completes_a_toy_rollout(server, tcfg, tmp_path):
    """The done-when: kiln's own agent, through its openai policy, runs a graded rollout on a toy
    task against `kiln serve` over loopback. The untrained model writes garbage; the harness must
    turn it into observations and finish."""
    suite, out = tmp_path / "suite", tmp_path / "bench"
    assert generate_toy(str(suite), 1, level=1, sandbox_cfg=tcfg, progress=False).kept == 1
    task = load_suite(str(suite))[0]
    os.makedirs(out / "trajectories")
    # One small tool keeps the prompt (tools listed in the system message and rendered again from
    # the request's tools) inside the tiny model's 2048-token context for both turns.
    cfg = Config(sandbox=tcfg, harness=HarnessConfig(tools=["read_file"], max_turns=2, max_turn_tokens=16),
                 policy=PolicyConfig(base_url=server.url + "/v1", model=MODEL, max_retries=0, timeout_s=60))
    snapshot = Snapshot.from_dir(task.repo_dir, tcfg.state_dir)
    try:
        row = run_rollout(task, 0, "openai", cfg, snapshot, str(out))
    finally:
        snapshot.drop()
    with open(out / row["trajectory"]) as f:
        traj = json.load(f)
    turns = [t for s in traj["segments"] for t in s["turns"]]
    assert row["stop_reason"] in ("finished", "max_turns") and 1 <= len(turns) <= 2
    assert all(t["prompt_tokens"] > 1000 and 0 < t["completion_tokens"] <= 16 for t in turns)
    assert traj["segments"][0]["messages"][2]["role"] == "assistant"
    assert row["correctness"]["score"] == 0


def test_a_client_that_resets_its_connection_is_no_error(server, capfd):
    # A keep-alive client that leaves with a reset (here forced: SO_LINGER 0) while the server waits
    # for its next request: the server's read fails, and that is the client's business, not a traceback.
    with socket.create_connection((server.host, server.port), timeout=10) as s:
        s.sendall(f"GET /health HTTP/1.1\r\nHost: {server.host}\r\n\r\n".encode())
        assert s.recv(4096).startswith(b"HTTP/1.")
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    time.sleep(0.5)  # the server's thread notices the reset
    status, _ = http("GET", server.url + "/health")
    assert status == 200
    assert "Traceback" not in capfd.readouterr().err


def test_close_ends_the_connections_clients_keep_alive(tiny_checkpoint):
    """A client that keeps its connection open (an SDK's pool) holds no handler thread past close():
    one still reading when the interpreter exits is killed in its teardown, which aborted the
    process while it freed a request's tensors."""
    before = set(threading.enumerate())  # other servers' handlers (the module's, still open)
    srv = serve(tiny_checkpoint, port=0)
    conn = HTTPConnection(srv.host, srv.port, timeout=30)
    conn.request("GET", "/health")
    assert json.loads(conn.getresponse().read())["status"] == "ok"  # answered; the connection stays open
    handlers = [t for t in threading.enumerate() if "process_request_thread" in t.name and t not in before]
    assert len(handlers) == 1 and handlers[0].is_alive()
    closing = threading.Thread(target=srv.close, daemon=True)
    closing.start()
    closing.join(timeout=30)
    assert not closing.is_alive()
    assert not any(t.is_alive() for t in handlers)
    assert conn.sock.recv(1) == b""  # the server ended it
    conn.close()
